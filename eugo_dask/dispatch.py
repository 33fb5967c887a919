"""Run-time dispatch of dual tasks: a ledger of when each CPU thread and GPU slot is expected to
be free, and the choice of the one that finishes a task first.

A dual task (``eugo.dispatch: dual``; :class:`~eugo_dask.plan.DualCost`) can run on a CPU
thread for ``thread_s`` or on a GPU slot for ``slot_s`` (its copies in and back inside it).
StarPU's dmda scores every unit by expected finish, transfers included; so does
:meth:`Ledger.choose`, over the units the ledger knows:

- each CPU worker's threads and each GPU worker's slots (its units of the GPU resource), each
  with the time it is expected to be free;
- kept current by whoever owns the ledger (eugo's scheduler plugin, from the scheduler's
  transitions): a task assigned to a worker is charged to the unit of its kind there that frees
  first (:meth:`Ledger.charge`), and settled when it leaves it (:meth:`Ledger.settle`): that
  unit's later work moves earlier or later by how much sooner or later than expected it ended;
- each kind's estimates scaled by what dual tasks of a prefix measured against what was
  expected (:meth:`Ledger.observe`), so estimates off by a factor stop steering once tasks have
  run.

Pure arithmetic on times the caller hands in: nothing here knows distributed (the scheduler
plugin does) or runs a task. The schedule model (:mod:`eugo_dask.schedule`, policy ``dual``)
decides with the same :func:`earliest_unit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple

#: Where a dual task runs: a CPU thread or a GPU slot.
UnitKind = Literal["cpu", "gpu"]
CPU_UNIT: Final = "cpu"
GPU_UNIT: Final = "gpu"
#: How much one measured task moves a prefix's scale (an exponential average).
OBSERVE_WEIGHT: Final = 0.3
#: Measured / expected ratios beyond these are taken as these (one odd task steers little).
SCALE_LIMITS: Final = (0.01, 100.0)


class Choice(NamedTuple):
    """Where a dual task goes: ``kind``, the worker (None: any worker of that kind), the unit
    there, and when it is expected to finish."""

    kind: UnitKind
    worker: str | None
    unit: int
    finish: float


def earliest_unit(free_at: list[float]) -> tuple[int, float]:
    """The unit of ``free_at`` (times each is expected to be free) that frees first, and when;
    ``(-1, inf)`` where there is none. (``min`` and ``index`` run in C: a decision looks at
    every worker's units.)"""
    if not free_at:
        return -1, math.inf
    when = min(free_at)
    return free_at.index(when), when


@dataclass
class Ledger:
    """When each unit of each worker is expected to be free (see the module docstring)."""

    #: worker -> the expected free time of each of its CPU threads / GPU slots
    threads: dict[str, list[float]] = field(default_factory=dict)
    slots: dict[str, list[float]] = field(default_factory=dict)
    #: (prefix, kind) -> measured seconds over expected, of the dual tasks that ran
    scale: dict[tuple[str, UnitKind], float] = field(default_factory=dict)
    #: kind -> worker -> when its first unit of that kind frees (a decision reads one number
    #: per worker, kept as its units change)
    _first: dict[UnitKind, dict[str, float]] = field(
        default_factory=lambda: {CPU_UNIT: {}, GPU_UNIT: {}})

    def __post_init__(self) -> None:
        for kind in (CPU_UNIT, GPU_UNIT):
            self._first[kind] = {w: min(units) for w, units in self._units(kind).items() if units}

    def set_worker(self, worker: str, *, threads: int, slots: int, now: float) -> None:
        """A worker with ``threads`` CPU threads for dual tasks (0 on a GPU worker, whose threads
        serve its copies and slots) and ``slots`` GPU slots; free now where new."""
        counts: tuple[tuple[UnitKind, int], ...] = ((CPU_UNIT, threads), (GPU_UNIT, slots))
        for kind, count in counts:
            units = self._units(kind)
            if count > 0:
                self._first[kind][worker] = min(units.setdefault(worker, [now] * count))
            else:
                units.pop(worker, None)
                self._first[kind].pop(worker, None)

    def remove_worker(self, worker: str) -> None:
        for kind in (CPU_UNIT, GPU_UNIT):
            self._units(kind).pop(worker, None)
            self._first[kind].pop(worker, None)

    def _units(self, kind: UnitKind) -> dict[str, list[float]]:
        return self.threads if kind == CPU_UNIT else self.slots

    def seconds(self, prefix: str, kind: UnitKind, estimate: float) -> float:
        """``estimate`` scaled by what tasks of ``prefix`` measured on ``kind``."""
        return estimate * self.scale.get((prefix, kind), 1.0)

    def choose(self, prefix: str, thread_s: float, slot_s: float, now: float) -> Choice:
        """The unit that finishes a dual task of ``prefix`` first: ``thread_s`` on a CPU thread
        or ``slot_s`` on a GPU slot (estimates, scaled as measured), each starting when its unit
        frees (not before ``now``). A tie goes to the CPU (the path that needs no device); with
        no CPU worker, a CPU choice names none (any worker runs the CPU path)."""
        best = Choice(CPU_UNIT, None, -1, now + self.seconds(prefix, CPU_UNIT, thread_s))
        options: tuple[tuple[UnitKind, float], ...] = ((CPU_UNIT, thread_s), (GPU_UNIT, slot_s))
        for kind, seconds in options:
            first = self._first[kind]
            if not first:
                continue
            worker = min(first, key=first.__getitem__)
            when = first[worker]
            finish = max(when, now) + self.seconds(prefix, kind, seconds)
            if finish < best.finish or (best.worker is None and kind == CPU_UNIT):
                best = Choice(kind, worker, self._units(kind)[worker].index(when), finish)
        return best

    def charge(self, worker: str, kind: UnitKind, seconds: float, now: float
               ) -> tuple[int, float] | None:
        """A task of ``seconds`` assigned to ``worker``'s units of ``kind``: queued on the one
        that frees first. Its number and the task's expected end; None where the ledger has no
        such unit there (a copy on a GPU worker's thread: not what dual tasks wait for)."""
        free_at = self._units(kind).get(worker)
        if not free_at:
            return None
        unit, when = earliest_unit(free_at)
        end = free_at[unit] = max(when, now) + seconds
        self._first[kind][worker] = min(free_at)
        return unit, end

    def settle(self, worker: str, kind: UnitKind, unit: int, expected_end: float,
               now: float) -> None:
        """The task charged to ``unit`` (expected to end at ``expected_end``) left it at
        ``now``: the unit's later work moves by the difference (never to before ``now``)."""
        free_at = self._units(kind).get(worker)
        if free_at is None or unit >= len(free_at):
            return
        free_at[unit] = max(free_at[unit] + (now - expected_end), now)
        self._first[kind][worker] = min(free_at)

    def observe(self, prefix: str, kind: UnitKind, expected_s: float, measured_s: float) -> None:
        """A dual task of ``prefix`` ran on ``kind`` for ``measured_s`` where ``expected_s``
        (unscaled) was estimated: move the prefix's scale towards their ratio."""
        if not (expected_s > 0 and measured_s > 0 and math.isfinite(measured_s)):
            return
        low, high = SCALE_LIMITS
        ratio = min(max(measured_s / expected_s, low), high)
        old = self.scale.get((prefix, kind))
        self.scale[(prefix, kind)] = (ratio if old is None
                                      else old + OBSERVE_WEIGHT * (ratio - old))
