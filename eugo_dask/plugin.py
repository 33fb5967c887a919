"""Scheduler plugin: GPU work on GPU workers, aggregation and I/O on CPU workers, never a hang.

Load it either way:

- ``dask scheduler --preload eugo_dask.plugin`` (this module's :func:`dask_setup`);
- ``client.register_plugin(EugoSchedulerPlugin())``.

What it does with the annotations the rewrite puts on every task (:class:`~eugo_dask.rewrite.
TaskRoles`):

- device work and transfers already ask for the worker resource (``eugo.resource``, ``GPU``);
  while at least one worker advertises it, that is where they run, one task per resource unit
  (``dask worker --resources GPU=1`` runs one at a time; ``GPU=4`` runs four);
- with no such worker, the resource request is dropped and those tasks run their CPU path on
  whatever workers there are (a warning says so once per graph). When the last GPU worker leaves
  mid-computation, its pending tasks are re-routed the same way; a GPU worker that joins later is
  used by later graphs;
- aggregation, ``finalize`` and I/O tasks are restricted to CPU workers (those without the
  resource) when any exist, loosely: with none able to take them they may run elsewhere;
- counters for the dashboard: tasks by device and prefix, bytes copied each way, fallbacks and
  their reasons (reported by workers), and estimated seconds saved against an all-CPU run.

Hook bodies never raise into the scheduler: errors are logged and counted.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from eugo_dask.config import read_resource
from eugo_dask.dashboard import install as install_dashboard
from eugo_dask.history import observe, save_all
from eugo_dask.history import pending as history_pending
from eugo_dask.metrics import register_metrics
from eugo_dask.optimization import recent_plans
from eugo_dask.rewrite import (
    CPU_ROLE,
    DEVICE_ROLES,
    GPU_ROLE,
    HOST_ROLE,
    TODEVICE_ROLE,
    TOHOST_ROLE,
)
from eugo_dask.runtime import EVENT_TOPIC, cpu_path_task

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

logger = logging.getLogger(__name__)
_task_logger = logging.getLogger(__name__ + ".tasks")

_PENDING = frozenset({"released", "waiting", "no-worker", "queued"})


class EugoSchedulerPlugin(SchedulerPlugin):
    """Places eugo's GPU and host tasks on the right workers and keeps its counters.

    Parameters
    ----------
    resource
        Worker resource that marks GPU workers; default ``eugo.resource``.
    """

    name = "eugo"
    idempotent = True

    def __init__(self, *, resource: str | None = None) -> None:
        self.resource = resource if resource is not None else read_resource()
        self.scheduler: Scheduler | None = None
        self.gpu_keys: set = set()  # device work and transfers not finished yet
        self.host_keys: set = set()  # aggregation / finalize / I/O not finished yet
        self.cpu_keys: set = set()  # other planned tasks the plan kept on the CPU
        self.errors = 0
        self.warnings: list[str] = []
        self.prefixes: dict[str, PrefixStats] = defaultdict(PrefixStats)
        self.fallbacks: Counter[str] = Counter()
        self.saved_s = 0.0
        self._estimates: dict[Any, tuple[float, float]] = {}
        #: (key, role, worker name) of recent eugo tasks, as the scheduler ran them
        self.placements: deque[tuple[Any, str | None, str | None]] = deque(maxlen=100_000)

    @property
    def bytes_h2d(self) -> int:
        return sum(p.h2d_bytes for p in self.prefixes.values())

    @property
    def bytes_d2h(self) -> int:
        return sum(p.d2h_bytes for p in self.prefixes.values())

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._guard("metrics", register_metrics, scheduler)

    def _guard(self, what: str, fn, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # never break the scheduler
            self.errors += 1
            logger.exception("eugo scheduler plugin: %s failed", what)

    # -- which workers are which ------------------------------------------------------------
    def _gpu_workers(self, scheduler: Scheduler) -> list[str]:
        return [a for a, ws in scheduler.workers.items() if ws.resources.get(self.resource)]

    def _cpu_workers(self, scheduler: Scheduler) -> set[str]:
        return {a for a, ws in scheduler.workers.items() if not ws.resources.get(self.resource)}

    # -- hooks --------------------------------------------------------------------------------
    def update_graph(
        self,
        scheduler: Scheduler,
        *,
        tasks: list | None = None,
        annotations: dict | None = None,
        **kwargs: Any,
    ) -> None:
        self._guard("update_graph", self._place_graph, scheduler, annotations or {})

    def _place_graph(self, scheduler: Scheduler, annotations: dict) -> None:
        self.scheduler = scheduler
        roles = annotations.get("eugo") or {}
        if not roles:
            return
        cpu_workers = self._cpu_workers(scheduler)
        gpu_present = bool(self._gpu_workers(scheduler))
        rerouted = 0
        for key, role in roles.items():
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state not in _PENDING:
                continue
            kind = role["role"]
            if role.get("cpu_s") is not None:
                self._estimates[key] = (role["cpu_s"], role["est_s"])
            if kind == CPU_ROLE:
                self.cpu_keys.add(key)
            elif kind in DEVICE_ROLES:
                self.gpu_keys.add(key)
                if not gpu_present:
                    self._run_on_cpu(ts)
                    rerouted += 1
            elif kind == HOST_ROLE:
                self.host_keys.add(key)
                if cpu_workers:
                    ts.worker_restrictions = set(cpu_workers)
                    ts.loose_restrictions = True
        if rerouted:
            self._warn(
                f"eugo: no worker advertises the resource {self.resource!r}; {rerouted} "
                "GPU-planned tasks run their CPU path on the workers there are"
            )

    def _run_on_cpu(self, ts: TaskState) -> None:
        """Re-route a GPU task: no resource request, and a run spec that runs the CPU path
        wherever it lands, so no device array is made even if a GPU worker joins later and
        picks it up (its consumers may be on CPU workers)."""
        if ts.resource_restrictions:
            ts.resource_restrictions = {
                r: n for r, n in ts.resource_restrictions.items() if r != self.resource
            } or None
        ts.worker_restrictions = None
        ts.host_restrictions = None
        ts.run_spec = cpu_path_task(ts.run_spec)

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning(message)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self._guard("add_worker", self._worker_joined, scheduler, worker)

    def _worker_joined(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is None or ws.resources.get(self.resource):
            return
        for key in self.host_keys:
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.state in _PENDING and ts.worker_restrictions is not None:
                ts.worker_restrictions.add(worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str = "",
                      **kwargs: Any) -> None:
        self._guard("remove_worker", self._worker_left, scheduler, worker, stimulus_id)

    def _worker_left(self, scheduler: Scheduler, worker: str, stimulus_id: str) -> None:
        for key in self.host_keys:
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.worker_restrictions:
                ts.worker_restrictions.discard(worker)
                if not ts.worker_restrictions:
                    ts.worker_restrictions = None
        if self._gpu_workers(scheduler):
            return
        stuck = []
        for key in self.gpu_keys:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state not in _PENDING:
                continue
            self._run_on_cpu(ts)
            if ts.state == "no-worker":
                stuck.append(key)
        if stuck or self.gpu_keys:
            self._warn(f"eugo: the last worker with {self.resource!r} left; pending GPU tasks "
                       "run their CPU path on the remaining workers")
        if stuck:
            scheduler.transitions({k: "processing" for k in stuck},
                                  stimulus_id=f"eugo-reroute-{stimulus_id}")

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "memory" and start == "processing":
            startstops = kwargs.get("startstops") or ()
            self._guard("transition", self._count, key, kwargs.get("worker"), startstops)
            if key in history_pending:  # eugo.learn: the worker's own compute time
                self._guard("transition", self._learn, key, startstops)
        elif finish == "forgotten":
            self.gpu_keys.discard(key)
            self.host_keys.discard(key)
            self.cpu_keys.discard(key)
            self._estimates.pop(key, None)

    def _count(self, key: Any, worker: str | None, startstops: Any) -> None:
        scheduler = self.scheduler
        if scheduler is None or not (key in self.gpu_keys or key in self.host_keys
                                     or key in self.cpu_keys):
            return
        ts = scheduler.tasks.get(key)
        if ts is None:
            return
        role = (ts.annotations or {}).get("eugo", {}).get("role")
        stats = self.prefixes[ts.prefix.name]
        ws = scheduler.workers.get(worker) if worker is not None else None
        self.placements.append((key, role, str(ws.name) if ws is not None else worker))
        if role == TODEVICE_ROLE:
            stats.h2d_bytes += ts.nbytes
            return
        if role == TOHOST_ROLE:
            stats.d2h_bytes += ts.nbytes
            return
        on_gpu = role == GPU_ROLE and ws is not None and bool(ws.resources.get(self.resource))
        if on_gpu:
            stats.gpu_tasks += 1
        else:
            stats.cpu_tasks += 1
        estimate = self._estimates.pop(key, None)
        if estimate is not None:
            stats.predicted_s += estimate[1] if on_gpu or role != GPU_ROLE else estimate[0]
            stats.actual_s += _compute_seconds(startstops)
            if on_gpu:
                self.saved_s += estimate[0] - estimate[1]

    def _learn(self, key: Any, startstops: Any) -> None:
        seconds = _compute_seconds(startstops)
        if seconds > 0:
            observe(key, seconds)

    async def close(self) -> None:
        save_all()

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == EVENT_TOPIC and isinstance(msg, dict) and "fallback" in msg:
            self.fallbacks[msg["fallback"]] += 1
            self.prefixes[str(msg.get("prefix"))].fallbacks[msg["fallback"]] += 1
            _task_logger.debug("fallback in %s: %s", msg.get("prefix"), msg["fallback"])

    # -- reading ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The counters, as plain data."""
        by_device: dict[str, dict[str, int]] = defaultdict(dict)
        for prefix, stats in self.prefixes.items():
            for device, n in (("gpu", stats.gpu_tasks), ("cpu", stats.cpu_tasks)):
                if n:
                    by_device[device][prefix] = n
        return {
            "tasks": dict(by_device),
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "fallbacks": dict(self.fallbacks),
            "estimated_saved_s": self.saved_s,
            "prefixes": {p: s.to_dict() for p, s in self.prefixes.items()},
            "warnings": list(self.warnings),
            "errors": self.errors,
            "plans": [dict(p) for p in recent_plans],
        }


@dataclass
class PrefixStats:
    """What eugo did for one task prefix."""

    gpu_tasks: int = 0
    cpu_tasks: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    predicted_s: float = 0.0
    actual_s: float = 0.0
    fallbacks: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fallbacks"] = dict(self.fallbacks)
        return out


def _compute_seconds(startstops: Any) -> float:
    return sum(ss["stop"] - ss["start"] for ss in startstops if ss.get("action") == "compute")


def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload eugo_dask.plugin`` entry point."""
    scheduler.add_plugin(EugoSchedulerPlugin())


# A preload is imported before the scheduler builds its dashboard: add the Eugo page now.
install_dashboard()
