"""What a computation got from the machine, as the scheduler ran it: its makespan, how busy the
CPU threads, the GPUs and the copies kept them, beside the work bound of its plan on the same
machine (:func:`~eugo_dask.schedule.area_split`). The scheduler plugin keeps one
:class:`GraphUsage` per graph it placed; its summary, and so the dashboard, shows the recent ones.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from eugo_dask.schedule import area_split

#: What a task's compute seconds count as: kernels on a GPU worker, copies between host and
#: device, or the work of the CPU threads (CPU-planned tasks, host work, re-routed GPU tasks).
UsageKind = Literal["cpu", "gpu", "copies"]


@dataclass
class GraphUsage:
    """One graph as it ran: the machine it had when it was placed (``cpu_threads``: every
    worker thread but those the GPU slots take; ``gpu_slots``), the eugo tasks placed, and
    from each one's compute start and stop, as workers report them, the makespan and the
    seconds each kind of work kept its units busy. ``work`` is its plan's (None: unknown).

    Copies ask for none of the GPU slot, so a GPU worker runs several at once beside a kernel:
    their busy seconds are the time each GPU worker had a copy in flight (the union of their
    intervals, ``copy_spans``), not the sum of their durations, which made a link more than
    100% busy."""

    plan: str | None
    tasks: int
    cpu_threads: int
    gpu_slots: int
    work: list[tuple[int, float, float | None]] | None
    started: float = math.inf
    stopped: float = -math.inf
    done: int = 0
    busy: dict[UsageKind, float] = field(
        default_factory=lambda: {"cpu": 0.0, "gpu": 0.0, "copies": 0.0})
    #: per GPU worker, the disjoint intervals (start, stop), sorted, in which a copy ran
    copy_spans: dict[str | None, list[tuple[float, float]]] = field(default_factory=dict)

    def ran(self, kind: UsageKind, startstops: Any, worker: str | None = None) -> None:
        """A task of the graph finished on ``worker``: its compute intervals count as
        ``kind``."""
        self.done += 1
        for part in startstops:
            if part.get("action") == "compute":
                start, stop = float(part["start"]), float(part["stop"])
                self.started, self.stopped = min(self.started, start), max(self.stopped, stop)
                if kind == "copies":
                    self._copy_ran(worker, start, stop)
                else:
                    self.busy[kind] += max(stop - start, 0.0)

    def _copy_ran(self, worker: str | None, start: float, stop: float) -> None:
        """Merge a copy's interval into ``worker``'s copy spans; the copies' busy seconds grow
        by the time it adds to them."""
        spans = self.copy_spans.setdefault(worker, [])
        first = bisect.bisect_left(spans, (start,))  # the first span starting at or after it
        if first and spans[first - 1][1] >= start:
            first -= 1
        last, covered = first, 0.0
        while last < len(spans) and spans[last][0] <= stop:
            start, stop = min(start, spans[last][0]), max(stop, spans[last][1])
            covered += spans[last][1] - spans[last][0]
            last += 1
        spans[first:last] = [(start, max(stop, start))]
        self.busy["copies"] += max(stop - start, 0.0) - covered

    @property
    def makespan_s(self) -> float:
        """From the first compute start to the last stop so far (0 before any)."""
        return max(self.stopped - self.started, 0.0) if self.done else 0.0

    def bound_s(self) -> float | None:
        """The plan's work split over this machine so that both kinds finish together (a lower
        bound on makespan if the estimates hold; the critical path is not in it)."""
        if self.work is None:
            return None
        cpu, gpu, _ = area_split(self.work, max(self.cpu_threads, 1), self.gpu_slots)
        return max(cpu, gpu)

    def to_dict(self) -> dict[str, Any]:
        span = self.makespan_s
        units = {"cpu": self.cpu_threads, "gpu": self.gpu_slots, "copies": self.gpu_slots}
        return {
            "plan": self.plan, "tasks": self.tasks, "done": self.done,
            "cpu_threads": self.cpu_threads, "gpu_slots": self.gpu_slots,
            "makespan_s": span, "bound_s": self.bound_s(),
            "busy_s": dict(self.busy),
            "busy": {kind: (seconds / (units[kind] * span) if units[kind] and span else 0.0)
                     for kind, seconds in self.busy.items()},
        }
