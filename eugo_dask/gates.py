"""Gates on the scheduler: tasks held back until a device task ends, with no task or transfer of
their own (reads and copies paced to the device).

Where eugo's scheduler plugin runs, the pass leaves a graph's reads as they are and writes in its
copies' ``eugo`` annotations how far reads and copies may run ahead of the device
(``reads_ahead``, ``ahead``); the plugin picks, for each read and copy it paces, the device task
it waits for, its **gate** (:meth:`Gates.pace`), and makes the gate a dependency of the task on
the scheduler only (:meth:`Gates.hold`): the scheduler's own bookkeeping (``dependencies``,
``dependents``, ``waiting_on``, ``waiters``) holds the task in ``waiting`` until the gate is in
memory, as it would for any dependency, and then releases it the way it releases any task whose
inputs exist: a read still goes through root-task queuing, since it is a data producer and has no
restriction. Before the scheduler acts on that release the plugin takes the edge away again
(:meth:`Gates.release`, from the gate's ``transition``): the task is sent to a worker without the
gate among its dependencies, so no worker fetches the device result or runs anything for the
gate. The paced tokens the pass writes where no plugin runs (``eugo-paced-…``,
:mod:`eugo_dask.pace`) cost a task each and, since the read that waits for one runs on a CPU
worker, a fetch from the GPU worker each (a comm round trip, and the read's block then travels
alone instead of in a batch).

Nothing is held forever:

- a gate already in memory, or not pending (erred, forgotten), holds nothing;
- a gate that errs lets go of its held tasks, which run as in plain Dask (a read does not
  depend on its gate: the scheduler's blame, put on every waiter, is taken back);
- a gate whose worker dies is recomputed by the scheduler, and its tasks wait for it;
- a held task that is cancelled or forgotten leaves the scheduler's records of its gate as any
  task does;
- a task submitted again while held (the same collection computed twice at once, graphs sharing
  reads) is compared by the scheduler with what it had, dependencies included: the gate is
  hidden from that comparison (:meth:`Gates.install`), so distributed neither warns of a
  different ``run_spec`` for the key nor skips adding the graph's dependencies to it;
- a watchdog (:meth:`Gates.check`, from a periodic callback) releases every gate where no task
  has finished anywhere for :data:`STALL_S` while tasks are held, so even a wrong gate (one
  that waited, through other tasks, on what it holds) costs a pause, never a hang, and releases a
  gate whose task cannot run (``no-worker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from eugo_dask.runtime import to_host

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

logger = logging.getLogger(__name__)

#: States of a gate that may still end: a held task waits for it.
_PENDING_GATE = frozenset({"released", "waiting", "queued", "no-worker", "processing"})
#: Seconds without any task finishing anywhere, with tasks held, after which every gate is
#: released (the watchdog).
STALL_S = 10.0
#: How often the watchdog looks, in milliseconds.
CHECK_MS = 1000


class Gates:
    """The gates the plugin made: each gate's held tasks, and when a task last finished."""

    def __init__(self) -> None:
        self.held: dict[Key, set[Key]] = {}  # a gate -> the tasks it holds
        self.paced: set[Key] = set()  # the tasks held, until they are forgotten
        # the reads of a paced graph inside its window (the first ``reads_ahead``, never held:
        # paced all the same), until they are forgotten
        self.within: set[Key] = set()
        self.last_finished = time.monotonic()
        #: gates made, and gates released by the watchdog (not by their task ending)
        self.made = 0
        self.forced = 0

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, scheduler: Scheduler, key: Key, gate: Key) -> bool:
        """Make ``gate`` a dependency of task ``key`` on the scheduler, where both are in the
        graph, ``key`` has not been scheduled yet (released: the scheduler works out what it
        waits on when it first moves it), ``gate`` may still end, and ``gate`` comes before
        ``key`` in Dask's order (``ts.priority``). Whether it did.

        Dask's order runs every task after its dependencies, so each edge of the graph goes
        from a task to one later in the order; so does each gate: no task can then wait, through
        its dependencies and gates, on itself (gates made by different rules, a paced read's
        and a copy's, could otherwise close a loop between them)."""
        ts = scheduler.tasks.get(key)
        gts = scheduler.tasks.get(gate)
        if (ts is None or gts is None or ts.state != "released"
                or gts.state not in _PENDING_GATE or gts in ts.dependencies
                or ts.priority is None or gts.priority is None
                or not gts.priority < ts.priority):
            return False
        if not self.held:  # (the watchdog counts from the first task held)
            self.last_finished = time.monotonic()
        ts.dependencies.add(gts)
        gts.dependents.add(ts)
        self.held.setdefault(gate, set()).add(key)
        self.paced.add(key)
        self.made += 1
        return True

    def release(self, scheduler: Scheduler, gate: Key) -> list[Key]:
        """Take the edges from ``gate`` to the tasks it holds away: called once the gate has
        ended (in its ``transition``, before the scheduler acts on its dependents) or by the
        watchdog. Returns the held tasks that waited on nothing else (the watchdog moves them
        on)."""
        keys = self.held.pop(gate, None)
        gts = scheduler.tasks.get(gate)
        if not keys or gts is None:
            return []
        free = []
        for key in keys:
            ts = scheduler.tasks.get(key)
            if ts is None or gts not in ts.dependencies:
                continue
            ts.dependencies.discard(gts)
            gts.dependents.discard(ts)
            if gts.waiters:
                gts.waiters.discard(ts)
            if gts.state == "erred":
                _unblame(ts, gts)
            if ts.waiting_on and gts in ts.waiting_on:
                ts.waiting_on.discard(gts)
                if not ts.waiting_on and ts.state == "waiting":
                    free.append(key)
        return free

    def transition(self, scheduler: Scheduler, key: Key, finish: str) -> None:
        """The scheduler's transition of ``key`` to ``finish``: a gate that ended lets go of
        its tasks."""
        if finish == "memory":
            self.last_finished = time.monotonic()
        if key in self.held and finish in ("memory", "erred", "forgotten"):
            self.release(scheduler, key)
        if finish == "forgotten":
            self.forget(key)

    def check(self, scheduler: Scheduler) -> None:
        """The watchdog: release gates stuck without a worker, and every gate where nothing
        has finished for :data:`STALL_S` (see the module docstring); move on the tasks they
        held that wait on nothing else."""
        if not self.held:
            return
        stalled = time.monotonic() - self.last_finished > STALL_S
        free: list[Key] = []
        for gate in list(self.held):
            gts = scheduler.tasks.get(gate)
            if stalled or gts is None or gts.state not in _PENDING_GATE - {"no-worker"}:
                self.forced += 1
                free.extend(self.release(scheduler, gate))
        if stalled:
            logger.warning("eugo: no task finished for %.0f s while tasks waited for the device: "
                           "their gates are released", STALL_S)
            self.last_finished = time.monotonic()
        if free:
            scheduler.transitions({k: "processing" for k in free},
                                  stimulus_id=f"eugo-gates-{time.time()}")

    def pace(self, scheduler: Scheduler, copies: Sequence[Key], device: Sequence[Key],
             reads_ahead: int | None, ahead: int) -> int:
        """Pace a graph's reads and copies to the device (``copies``) to its device tasks
        (``device``), in Dask's order (``ts.priority``) among those device tasks; returns the
        tasks held.

        - A copy is held until the device task ``ahead`` places before its first consumer,
          among the device tasks that first consume a copy, has ended: at most ``ahead``
          device tasks' copies run ahead of the device, whatever becomes ready at once (a layer
          made on the CPU, blocks read before), and device tasks that copy nothing (the rest
          of a block's chain on the device) do not count.
        - A read (a root task whose result goes only to copies to the device, and to no
          client) is held until the first device task consuming the read ``reads_ahead``
          places before it (the reads put in the order of their first consumers) has ended,
          with its copy back where it has one: at most ``reads_ahead`` reads are done whose
          first consumer on the device is not (None: reads are not held).

        Each only where its gate comes before it in Dask's order (:meth:`hold`)."""
        tasks = scheduler.tasks
        ranked = sorted(((ts.priority, ts) for ts in map(tasks.get, device)
                         if ts is not None and ts.priority is not None), key=itemgetter(0))
        ordered = [ts for _, ts in ranked]
        rank = {ts: i for i, ts in enumerate(ordered)}
        copy_states = {ts for ts in map(tasks.get, copies) if ts is not None}
        first_of: dict[TaskState, int] = {}  # a copy -> the rank of its first consumer
        for ts in copy_states:
            first = min((rank[d] for d in ts.dependents if d in rank), default=None)
            if first is not None:
                first_of[ts] = first
        # the device tasks that first consume a copy, in Dask's order: a copy waits for the one
        # `ahead` places before its own first consumer among them (counting every device task,
        # a block's chain of several device tasks let a copy run less than a block ahead)
        consumers = sorted(set(first_of.values()))
        place = {first: i for i, first in enumerate(consumers)}
        held = 0
        for ts, first in first_of.items():
            i = place[first]
            if i >= ahead and self.hold(scheduler, ts.key, ordered[consumers[i - ahead]].key):
                held += 1
        if reads_ahead is None:
            return held
        reads: dict[TaskState, int] = {}  # a read -> the rank of its first consumer
        for ts, first in first_of.items():
            for read in ts.dependencies:
                if (read not in reads and _read_only_by(read, copy_states)):
                    reads[read] = min((first_of[c] for c in read.dependents if c in first_of),
                                      default=first)
        by_first = sorted(reads.items(), key=lambda item: (item[1], item[0].priority or ()))
        self.within.update(ts.key for ts, _ in by_first[:reads_ahead])
        for j in range(reads_ahead, len(by_first)):
            gate = _ended(ordered[by_first[j - reads_ahead][1]])
            if self.hold(scheduler, by_first[j][0].key, gate.key):
                held += 1
        return held

    def install(self, scheduler: Scheduler) -> bool:
        """Hide the gates from the scheduler's check of a resubmitted task
        (``Scheduler._generate_taskstates`` compares the keys of a known task's
        ``dependencies`` with the new graph's, warning "Detected different `run_spec`" and
        treating the key as a collision where they differ): the edges of the held tasks the new
        graph names are taken away for the call and put back after it, in the same tick of
        the event loop. Whether it was installed (not where the scheduler has no such method)."""
        original = getattr(scheduler, "_generate_taskstates", None)
        if original is None or getattr(original, "_eugo_gates", None) is self:
            return False

        def generate(*args: Any, **kwargs: Any) -> Any:
            dsk = kwargs.get("dsk", args[1] if len(args) > 1 else None)
            hidden = self._hide(scheduler, dsk) if self.paced and dsk else []
            try:
                return original(*args, **kwargs)
            finally:
                for ts, gts in hidden:
                    if ts.key in self.paced and ts.key in self.held.get(gts.key, ()):
                        ts.dependencies.add(gts)

        generate._eugo_gates = self  # type: ignore[attr-defined]
        scheduler._generate_taskstates = generate  # type: ignore[method-assign]
        return True

    def _hide(self, scheduler: Scheduler, dsk: Any) -> list[tuple[TaskState, TaskState]]:
        """Take each held task that ``dsk`` names off its gates' ``dependencies`` (only
        those: its gates' ``dependents``, ``waiting_on`` and ``waiters`` stay); what was taken."""
        hidden = []
        for key in [k for k in self.paced if k in dsk]:
            ts = scheduler.tasks.get(key)
            if ts is None:
                continue
            for gts in [d for d in ts.dependencies if key in self.held.get(d.key, ())]:
                ts.dependencies.discard(gts)
                hidden.append((ts, gts))
        return hidden

    def forget(self, key: Key) -> None:
        """Task ``key`` is forgotten (its edges left with it); from :meth:`transition`."""
        self.held.pop(key, None)
        self.paced.discard(key)
        self.within.discard(key)

    def summary(self) -> dict[str, Any]:
        return {"held": sum(map(len, self.held.values())), "gates": len(self.held),
                "made": self.made, "forced": self.forced}


def _unblame(ts: TaskState, gts: TaskState) -> None:
    """Gate ``gts`` erred while it held ``ts``: the scheduler has blamed ``ts`` for the failure
    (``_propagate_erred`` blames every waiter, ``_transition_released_erred`` every dependent)
    and recommended it ``erred``; a read or copy does not depend on its gate, so take the blame
    back. ``ts`` is waiting, and the scheduler moves a waiting task to ``erred`` by way of
    ``released``, which recommends ``waiting`` for a task without blame that someone waits for:
    ``ts`` then waits on its own dependencies, as in plain Dask. Where nothing waits for it
    (no waiter, no client), it is left to err: nothing needs it."""
    if (ts.state == "waiting" and ts.exception_blame is not None
            and ts.exception_blame is gts.exception_blame and (ts.waiters or ts.who_wants)
            and not any(dts.state == "erred" for dts in ts.dependencies)):
        ts.exception_blame = None


def _read_only_by(ts: TaskState, copies: set[TaskState]) -> bool:
    """A root task (no dependencies, or a data producer: one distributed queues) that only the
    copies ``copies`` read, and no client wants."""
    return ((not ts.dependencies or bool(getattr(ts.run_spec, "data_producer", False)))
            and not ts.who_wants and bool(ts.dependents) and ts.dependents <= copies)


def _ended(ts: TaskState) -> TaskState:
    """The task whose end says device task ``ts`` is done with: its copy back to the host
    where it has one (its result waits on the GPU worker until then), else itself."""
    for dts in ts.dependents:
        if getattr(dts.run_spec, "func", None) is to_host:
            return dts
    return ts
