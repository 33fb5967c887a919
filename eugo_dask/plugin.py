"""Scheduler plugin: GPU work on GPU workers, aggregation on CPU workers, counts of what ran.

Load it either way (they are equivalent; only the preload can add the dashboard page, which must
exist before the dashboard is built):

- ``dask scheduler --preload eugo_dask.plugin`` (this module's :func:`dask_setup`);
- ``client.register_plugin(EugoSchedulerPlugin())``.

Reach it as ``scheduler.plugins["eugo"]`` (the metrics and the dashboard do; no registry of its
own). What it does with the annotations the rewrite puts on every task
(:class:`~eugo_dask.rewrite.TaskRoles`):

- device work asks for the worker resource (``eugo.resource``, ``GPU``), so it runs on workers
  that advertise it, one task per resource unit (``--resources GPU=4`` runs four), beside the
  resources the user asked of it: the plugin adds it here to what the scheduler applied (the
  pass leaves it to the plugin, since its per-key annotation would replace the resources given
  to ``client.compute``). Copies (and reads' tokens) are restricted to the GPU workers instead,
  asking for no resource of eugo's: a worker runs the tasks that ask for resources from one
  queue whose head blocks the rest, so a copy asking for none of the slot still waited behind
  kernels waiting for it; kept to the GPU workers by worker restrictions, a copy runs on the
  next free thread (where the user named workers or hosts for it, or no GPU worker has joined
  yet, it asks for ``{GPU: 0}``, which only workers advertising the resource meet). The pass
  leaves a graph on the CPU where no worker advertises the resource it would ask for; when the
  last GPU worker leaves mid-computation, its pending GPU tasks are re-routed to run their CPU
  path on the workers there are;
- aggregation and ``finalize`` are restricted, loosely, to CPU workers when any exist, unless the
  user restricted them (workers, hosts, resources): every task keeps the user's restrictions.
  Root tasks (reads, data producers) are left unrestricted, so the scheduler still queues them.
  Queuing bounds what each worker is processing, not what waits for a consumer on another
  worker, and nothing bounds how far copies asking for no slot run ahead of the kernels: the
  plugin holds reads whose blocks go only to the device, and copies to the device, on the
  scheduler until the device task W (reads) or A (copies) places before has ended
  (:mod:`eugo_dask.gates`: a dependency only the scheduler knows, taken away before the task is
  sent, so nothing is fetched for it; the pass puts W and A in the copies' annotations), and
  warns where unpaced reads run ahead of a GPU worker (``benchmarks/root_tasks.py``). Where the
  plugin does not run, the pass paces reads with tokens (:mod:`eugo_dask.pace`, ``eugo-paced-…``,
  run on GPU workers like copies, holding no GPU slot);
- a GPU task whose user restrictions no GPU worker meets (``resources={"MEM": 1}`` with ``MEM`` on
  CPU workers only, ``workers=`` naming CPU workers, loose ones) runs its CPU path where they
  allow, with one warning per graph; so do pending ones when the GPU workers that met them leave;
- dual tasks (``eugo.dispatch: dual``: they carry both paths) are placed as they become ready,
  when their last input is made (in the ``transition`` hook, before the scheduler acts on the
  recommendation), or at once where their inputs exist already: on the CPU worker thread or GPU
  slot expected to finish them first (:class:`~eugo_dask.dispatch.Ledger`, kept current by
  transitions), restricted to that worker (a GPU slot also asks for one unit of the resource).
  A task is decided once; only one pinned to a worker that left, and waiting again, is decided
  anew. Where anything goes wrong the task stays unrestricted and runs its CPU path;
- every worker gets :class:`~eugo_dask.worker.EugoWorkerPlugin`: it checks the worker's own
  settings, reports a GPU worker that cannot use a device, and makes device arrays land as host
  arrays where they cannot be held.

Counts come from what workers report they ran (Fine Performance Metrics the worker sends with its
heartbeats: tasks that ran on the device or their CPU path, bytes each copy moved, fallbacks by
category), never from the plan. Events (which anyone may send) are accepted only in their known
shapes, with bounded label sets; a worker's report of itself (no device, an invalid setting)
only from that worker's own stream; text from either is logged escaped; what the plugin keeps is
bounded too.

Hook bodies never raise into the scheduler: errors are logged and counted.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from eugo_dask.config import check_keys, gpu_workers_on_demand, read_resource
from eugo_dask.context import SHOWN_HERE
from eugo_dask.dashboard import install as install_dashboard
from eugo_dask.dispatch import CPU_UNIT, GPU_UNIT, Ledger, UnitKind
from eugo_dask.gates import CHECK_MS, Gates
from eugo_dask.history import observe, save_all
from eugo_dask.history import pending as history_pending
from eugo_dask.metrics import register_metrics
from eugo_dask.pass_log import plan_work, recent_plans
from eugo_dask.rewrite import (
    CPU_ROLE,
    DEVICE_ROLES,
    DUAL_ROLE,
    GPU_ROLE,
    HOST_ROLE,
    PACE_ROLE,
    SLOTLESS_ROLES,
    TODEVICE_ROLE,
    TOHOST_ROLE,
    Role,
    device_request,
)
from eugo_dask.runtime import (
    EVENT_TOPIC,
    FALLBACK_CATEGORIES,
    FALLBACK_REASON,
    MAX_EVENT_TEXT,
    RAN_ON_CPU,
    RAN_ON_DEVICE,
    after_token,
    cpu_path_task,
)
from eugo_dask.usage import GraphUsage, UsageKind
from eugo_dask.worker import REPORT_OP, EugoWorkerPlugin

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

logger = logging.getLogger(__name__)
_task_logger = logging.getLogger(__name__ + ".tasks")

#: States of a task yet to run: a graph's new tasks are released until the scheduler moves them.
_PENDING = frozenset({"released", "waiting", "no-worker", "queued"})
#: graphs whose machine use the summary keeps
MAX_USAGE = 20
#: When a worker has left, once the scheduler has moved what it must run again (released ->
#: waiting): a task still released is done with (its result held nowhere, not wanted again).
_WAITING = frozenset({"waiting", "no-worker", "queued"})
#: States of GPU work not finished: waiting (for inputs or a worker) or running.
_BACKLOG = _WAITING | {"processing"}
#: Bounds on what the plugin keeps, whatever clients and workers send.
MAX_PREFIXES = 2_000
MAX_REASONS = 100
MAX_WARNINGS = 100
#: GPU tasks waiting on a GPU worker, fed by queued reads, past which the plugin warns that reads
#: run ahead of the device: per worker thread (plain Dask holds about one root task per thread),
#: and at least (a small computation's handful of blocks is no concern).
BACKLOG_PER_THREAD = 16
BACKLOG_MIN = 64


@dataclass
class PrefixStats:
    """What eugo's CPU-side tasks of one prefix did, and how the plan's estimates compared
    with the compute time workers measured."""

    cpu_tasks: int = 0  # tasks the plan kept on the CPU that finished
    predicted_s: float = 0.0
    actual_s: float = 0.0
    planned_gpu: int = 0  # GPU-planned tasks that finished (they report where they ran)
    planned_saving_s: float = 0.0  # estimated CPU seconds minus GPU seconds of those

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        self._fresh_state()

    # A plugin registered from a client arrives by pickle, without __init__: it carries its
    # resource, and starts with empty counters whatever the client's copy held.
    def __getstate__(self) -> dict[str, Any]:
        return {"resource": self.resource}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.resource = state["resource"]
        self._fresh_state()

    def _fresh_state(self) -> None:
        self.scheduler: Scheduler | None = None
        self.gpu_keys: set = set()  # device work and transfers not finished yet
        self.pace_keys: set = set()  # those of them that are reads' tokens (eugo_dask.pace)
        self.host_keys: set = set()  # aggregation / finalize not finished yet
        self.host_restricted: set = set()  # those of them the plugin restricted to CPU workers
        self.copy_restricted: set = set()  # copies the plugin restricted to the GPU workers
        self.cpu_keys: set = set()  # other planned tasks the plan kept on the CPU
        self.errors = 0
        self.warnings: deque[str] = deque(maxlen=MAX_WARNINGS)
        self._backlog_warned: set[str] = set()  # GPU workers warned of read-ahead this graph
        self._backlog_checked: set[tuple[str, str]] = set()  # (worker, task group) looked at
        self.prefixes: dict[str, PrefixStats] = {}
        #: distinct fallback reasons -> the task prefixes that reported them (each worker
        #: reports a reason once per prefix; the counts are the workers' metrics, by category)
        self.fallback_reasons: dict[str, set[str]] = {}
        self._gpu_addresses: set[str] = set()  # GPU workers the placed GPU tasks can go to
        self.workers_without_device: dict[str, str] = {}
        self.invalid_settings: dict[str, str] = {}
        self._estimates: dict[Any, tuple[float, float]] = {}
        #: (key, role, worker name) of recent eugo tasks, as the scheduler ran them
        self.placements: deque[tuple[Any, str | None, str | None]] = deque(maxlen=100_000)
        #: the machine use of the recent graphs placed, newest last, and of each pending task
        self.usage: deque[GraphUsage] = deque(maxlen=MAX_USAGE)
        self._usage_of: dict[Key, GraphUsage] = {}
        self.dual = _DualDispatch(self.resource)
        self.gates = Gates()  # tasks held back until a device task ends (eugo_dask.gates)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._guard("settings", self._check_own_settings)
        self._guard("metrics", register_metrics, scheduler)
        scheduler.stream_handlers.setdefault(REPORT_OP, functools.partial(_worker_report, scheduler))
        self._guard("gates", self._watch_gates, scheduler)
        try:
            # (it reports on the stream whose handler is now in place)
            await scheduler.register_worker_plugin(
                None, dumps(EugoWorkerPlugin(self.resource, report=True)), name="eugo",
                idempotent=True)
        except Exception:  # never break the scheduler
            self.errors += 1
            logger.exception("eugo scheduler plugin: installing the worker plugin failed")

    def _watch_gates(self, scheduler: Scheduler) -> None:
        """Start the gates' watchdog (:meth:`~eugo_dask.gates.Gates.check`) on the scheduler's
        loop, which the scheduler stops when it closes, and hide the gates from its check of
        resubmitted tasks (:meth:`~eugo_dask.gates.Gates.install`)."""
        from tornado.ioloop import PeriodicCallback

        self.gates.install(scheduler)

        callback = PeriodicCallback(
            functools.partial(self._guard, "gates", self.gates.check, scheduler), CHECK_MS)
        scheduler.periodic_callbacks["eugo-gates"] = callback
        callback.start()

    def _check_own_settings(self) -> None:
        """Say where the scheduler's own ``eugo.*`` settings hold a key eugo does not know (a
        misspelt ``DASK_EUGO__RESORCE`` in its environment left ``eugo.resource`` at its
        default, and nothing said so): kept among the warnings (``/eugo``, ``summary()``)."""
        try:
            check_keys()
        except ValueError as exc:
            self._warn(f"eugo: the scheduler's settings: {exc}")

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
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
        self._backlog_warned.clear()  # a new graph: warn again where it piles up
        self._backlog_checked.clear()
        cpu_workers = self._cpu_workers(scheduler)
        self._gpu_addresses = set(self._gpu_workers(scheduler))
        rerouted: list[TaskState] = []
        usage = self._new_usage(scheduler, roles)
        asked: dict[Any, dict[str, Any]] = {}  # the user's resources -> with the GPU's
        kept: dict[int, dict[str, Any] | None] = {}  # those, for a copy: without the GPU's
        fits: dict[Any, bool] = {}
        copies: list[Key] = []  # copies to the device, paced to the device tasks
        device: list[Key] = []
        pacing = None
        for key, role in roles.items():
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state not in _PENDING or not isinstance(role, dict):
                continue
            kind = role.get("role")
            if kind == GPU_ROLE:
                device.append(key)
            elif (kind == TODEVICE_ROLE and _is_count(role.get("ahead"))
                  and _is_count(role.get("reads_ahead"))):
                copies.append(key)
                pacing = (int(role["reads_ahead"]), int(role["ahead"]))
            if kind == PACE_ROLE:  # bookkeeping, not work: in no usage or prefix count
                self.pace_keys.add(key)
            else:
                self._usage_of[key] = usage
                usage.tasks += 1
            if role.get("cpu_s") is not None and role.get("est_s") is not None:
                self._estimates[key] = (role["cpu_s"], role["est_s"])
            if kind == CPU_ROLE:
                self.cpu_keys.add(key)
            elif kind == DUAL_ROLE:
                if not _restricted(ts):  # (else: its CPU path, where the user said)
                    self.dual.add(key, ts.prefix.name, role.get("cpu_s"), role.get("est_s"))
            elif kind in DEVICE_ROLES:
                self.gpu_keys.add(key)
                wanted = self._asking_for_device(ts, kind, asked)
                if self._device_fits(scheduler, ts, wanted, fits):
                    # (copies and reads' tokens: on the GPU workers, asking for no slot at all)
                    if kind in SLOTLESS_ROLES and self._keep_on_gpu_workers(ts):
                        ts.resource_restrictions = _without_slot(wanted, self.resource, kept)
                    else:
                        ts.resource_restrictions = wanted
                else:  # (or the GPU workers left between planning and now)
                    self._run_on_cpu(ts)
                    rerouted.append(ts)
            elif kind == HOST_ROLE:
                self.host_keys.add(key)
                if cpu_workers and not _is_root(ts) and not _restricted(ts):
                    ts.worker_restrictions = set(cpu_workers)
                    ts.loose_restrictions = True
                    self.host_restricted.add(key)
        if pacing is not None and self._gpu_addresses:  # (copies kept to the GPU workers)
            self.gates.pace(scheduler, [k for k in copies if k in self.copy_restricted], device,
                            *pacing)
        if rerouted:
            self._say_rerouted(scheduler, rerouted, "GPU-planned tasks", "")
        self.dual.decide_ready(scheduler, [scheduler.tasks[k] for k in roles
                                           if k in self.dual.costs and k in scheduler.tasks])

    def _new_usage(self, scheduler: Scheduler, roles: dict) -> GraphUsage:
        """The record of a graph's machine use, with the machine it is placed on now and its
        plan's work (found by the plan id its tasks carry, where the pass ran here)."""
        slots = sum(ws.resources.get(self.resource, 0) for ws in scheduler.workers.values())
        threads = sum(ws.nthreads for ws in scheduler.workers.values())
        plan = next((r.get("plan") for r in roles.values() if isinstance(r, dict)), None)
        usage = GraphUsage(plan, 0, max(int(threads - slots), 0), int(slots),
                           plan_work(plan) if plan is not None else None)
        self.usage.append(usage)
        return usage

    def _asking_for_device(self, ts: TaskState, role: Role, asked: dict[Any, dict[str, Any]]
                           ) -> dict[str, Any]:
        """The resources a device task of ``role`` asks for: the user's own (the scheduler
        applied them: the pass left the resource to the plugin, so as not to replace them) and
        the GPU resource's (:func:`~eugo_dask.rewrite.device_request`: the slot for device work,
        none of it for a copy). One dict per distinct request, shared by the tasks that make it."""
        user = ts.resource_restrictions
        request = (role in SLOTLESS_ROLES, frozenset(user.items()) if user else None)
        wanted = asked.get(request)
        if wanted is None:
            wanted = asked[request] = device_request(role, self.resource, user)
        return wanted

    def _keep_on_gpu_workers(self, ts: TaskState) -> bool:
        """Restrict copy ``ts`` to the GPU workers, where the user named no workers or hosts
        and a GPU worker is there; whether it did.

        Kept there by its worker restrictions, a copy asks for no resource of eugo's: a worker
        runs every task that asks for a resource from one queue, in priority order, whose head
        stops the rest while its resources are taken (``_ensure_computing`` in
        ``distributed/worker_state_machine.py``), so a copy asking for none of the slot
        (``{resource: 0}``) waited behind kernels of higher priority waiting for the slot, a
        thread free beside them. Asking for nothing, it runs on the next free thread.
        Otherwise it asks for ``{resource: 0}``, which only workers advertising the resource
        meet: a worker advertising it at 0 (``--resources GPU=0``, a CPU worker to eugo) meets
        it too, and a copy sent there passes its chunk through (no device), every kernel that
        reads the chunk copying it again (a matmul's copies to the device 15x the plan's).
        Kept current as GPU workers come and go (:meth:`_worker_joined`, :meth:`_worker_left`)."""
        if ts.worker_restrictions or ts.host_restrictions or not self._gpu_addresses:
            return False
        ts.worker_restrictions = set(self._gpu_addresses)
        self.copy_restricted.add(ts.key)
        return True

    def _device_fits(self, scheduler: Scheduler, ts: TaskState, wanted: dict[str, Any],
                     fits: dict[Any, bool]) -> bool:
        """Whether a worker meets the restrictions of device task ``ts`` asking for ``wanted``
        (the user's resources and the GPU's): its resources, and the workers or hosts the user
        named, as ``Scheduler.valid_workers`` reads them (a paused worker counts: it resumes).
        Answered once per distinct restriction in ``fits``: a graph's tasks mostly share theirs.

        Never where the user's restrictions are loose: a resource request does not go with
        them (a worker without the resource would be sent the task once no other can take it)."""
        if ts.loose_restrictions:
            return False
        workers, hosts = ts.worker_restrictions, ts.host_restrictions
        restriction = (frozenset(workers) if workers else None,
                       frozenset(hosts) if hosts else None, frozenset(wanted.items()))
        fit = fits.get(restriction)
        if fit is None:
            named = {scheduler.coerce_hostname(h) for h in hosts} if hosts else set()
            fit = fits[restriction] = any(
                (not (workers or hosts) or ws.address in (workers or ()) or ws.host in named)
                and ws.resources.get(self.resource, 0) > 0  # a GPU worker (a copy asks for 0)
                and all(ws.resources.get(r, 0) >= n for r, n in wanted.items())
                for ws in scheduler.workers.values()) or self._awaits_gpu_workers(
                scheduler, ts, wanted)
        return fit

    def _awaits_gpu_workers(self, scheduler: Scheduler, ts: TaskState, wanted: dict[str, Any]
                            ) -> bool:
        """Whether device task ``ts`` waits for a GPU worker to start: no worker advertises the
        resource, GPU workers start on demand (``eugo.gpu-workers-on-demand``: an autoscaled GPU
        group at zero, which the waiting task's backlog scales up), and the user asked for
        nothing (workers, hosts, resources) a new GPU worker might not meet."""
        return (set(wanted) == {self.resource} and not ts.worker_restrictions
                and not ts.host_restrictions and not self._gpu_workers(scheduler)
                and gpu_workers_on_demand())

    def gpu_backlog(self) -> int:
        """GPU work waiting and running: eugo's device tasks and copies that ask for the GPU
        resource and have not finished (waiting for inputs, queued, waiting for a worker, or
        processing); the metric GPU groups scale on."""
        scheduler = self.scheduler
        if scheduler is None:
            return 0
        count = 0
        pace_keys = self.pace_keys  # (reads' tokens wait for device work: they are none)
        for key in self.gpu_keys:
            ts = scheduler.tasks.get(key) if key not in pace_keys else None
            if ts is not None and ts.state in _BACKLOG and (
                    key in self.copy_restricted  # (a copy kept there asks for no resource)
                    or self.resource in (ts.resource_restrictions or ())):
                count += 1
        return count

    def _run_on_cpu(self, ts: TaskState) -> None:
        """Re-route a GPU task: no request for the GPU resource and, for a copy, none of the GPU
        workers the plugin kept it to (the user's restrictions stay as they are), and a run
        spec that runs the CPU path wherever it lands, so no device array is made even if a GPU
        worker joins later and picks it up (its consumers may be on CPU workers)."""
        if ts.resource_restrictions:
            ts.resource_restrictions = {
                r: n for r, n in ts.resource_restrictions.items() if r != self.resource
            } or None
        if ts.key in self.copy_restricted:
            self.copy_restricted.discard(ts.key)
            ts.worker_restrictions = None
        ts.run_spec = cpu_path_task(ts.run_spec)

    def _say_rerouted(self, scheduler: Scheduler, rerouted: list[TaskState], what: str,
                      left: str) -> None:
        """One warning for the GPU tasks ``rerouted`` together: no worker (``left``: "left",
        after one left) advertises the resource, or none that does meets the restrictions the
        user gave them (the first task's, named)."""
        if not self._gpu_workers(scheduler):
            self._warn(f"eugo: the last worker with {self.resource!r} left; pending GPU tasks "
                       "run their CPU path on the remaining workers" if left else
                       f"eugo: no worker advertises the resource {self.resource!r}; "
                       f"{len(rerouted)} {what} run their CPU path on the workers there are")
            return
        ts = rerouted[0]
        given = [f"{name}={sorted(map(str, value))}" for name, value in
                 (("workers", ts.worker_restrictions), ("hosts", ts.host_restrictions)) if value]
        if ts.resource_restrictions:
            given.append(f"resources={ts.resource_restrictions}")
        if ts.loose_restrictions:
            given.append("allow_other_workers")
        self._warn(f"eugo: {len(rerouted)} {what}: no worker {left and left + ' '}advertising "
                   f"{self.resource!r} meets the restrictions the user gave them "
                   f"({', '.join(given)[:200]}); they run their CPU path where those allow")

    def _warn(self, message: str, *, level: int = logging.WARNING) -> None:
        """Keep and log ``message``, escaped: it may hold text of a client's or a worker's."""
        message = _escaped(message)
        self.warnings.append(message[:MAX_EVENT_TEXT])
        logger.log(level, message)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self._guard("add_worker", self._worker_joined, scheduler, worker)

    def _worker_joined(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is None:
            return
        self.dual.worker_joined(ws)
        if ws.resources.get(self.resource):
            self._gpu_addresses.add(worker)
            _allow_worker(scheduler, self.copy_restricted, worker)
        else:
            _allow_worker(scheduler, self.host_restricted, worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str = "",
                      **kwargs: Any) -> None:
        self._guard("remove_worker", self._worker_left, scheduler, worker, stimulus_id)

    def _worker_left(self, scheduler: Scheduler, worker: str, stimulus_id: str) -> None:
        self.dual.worker_left(scheduler, worker, stimulus_id)
        self.workers_without_device.pop(worker, None)
        self.invalid_settings.pop(worker, None)
        _disallow_worker(scheduler, self.host_restricted, worker)
        if worker not in self._gpu_addresses:  # (GPU tasks' fits are the GPU workers')
            return
        self._gpu_addresses.discard(worker)
        rerouted, stuck = [], []
        fits: dict[Any, bool] = {}
        for key in self.gpu_keys:
            ts = scheduler.tasks.get(key)
            if ts is None:
                continue
            wanted = self._copy_left_worker(ts, worker) if key in self.copy_restricted else (
                ts.resource_restrictions)
            if (ts.state not in _WAITING or not wanted
                    or self.resource not in wanted  # running its CPU path already
                    or self._device_fits(scheduler, ts, wanted, fits)):
                continue
            self._run_on_cpu(ts)
            rerouted.append(ts)
            if ts.state == "no-worker":
                stuck.append(key)
        if rerouted:
            self._say_rerouted(scheduler, rerouted, "pending GPU tasks", "left")
        if stuck:
            scheduler.transitions({k: "processing" for k in stuck},
                                  stimulus_id=f"eugo-reroute-{stimulus_id}")

    def _copy_left_worker(self, ts: TaskState, worker: str) -> dict[str, Any]:
        """Take GPU worker ``worker``, which left, out of the restrictions of copy ``ts`` (kept
        to the GPU workers, :meth:`_keep_on_gpu_workers`), and return what it asks for with the
        GPU resource's ``{resource: 0}``. Where no GPU worker is left, the copy asks for
        ``{resource: 0}`` again and is kept by its worker restrictions no more (a copy
        restricted to no worker could run anywhere): it waits for a GPU worker to start where
        GPU workers start on demand, and is re-routed to its CPU path otherwise (by the
        caller, which tells which from what it asks for)."""
        wanted = {self.resource: 0, **(ts.resource_restrictions or {})}
        if ts.worker_restrictions:
            ts.worker_restrictions.discard(worker)
        if not ts.worker_restrictions and self._gpu_addresses:  # (one that joined since it ran)
            ts.worker_restrictions = set(self._gpu_addresses)
        elif not ts.worker_restrictions:
            ts.worker_restrictions = None
            ts.resource_restrictions = wanted
            self.copy_restricted.discard(ts.key)
        return wanted

    def transition(self, key: Key, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.gates.held or self.gates.paced or self.gates.within:
            self._guard("gates", self.gates.transition, self.scheduler, key, finish)
        if (self.dual.costs or self.dual.charged) and (start == "processing"
                                                        or finish == "processing"):
            self._guard("dispatch", self.dual.transition, self.scheduler, key, start, finish,
                        kwargs.get("startstops"))
        if finish == "memory" and start == "processing":
            startstops = kwargs.get("startstops") or ()
            self._guard("transition", self._count, key, kwargs.get("worker"), startstops)
            if key in history_pending:  # eugo.learn: the worker's own compute time
                self._guard("transition", self._learn, key, startstops)
        elif finish == "processing" and key in self.gpu_keys:
            self._guard("transition", self._watch_backlog, key)
        elif finish == "forgotten":
            self._usage_of.pop(key, None)
            self.gpu_keys.discard(key)
            self.pace_keys.discard(key)
            self.host_keys.discard(key)
            self.host_restricted.discard(key)
            self.copy_restricted.discard(key)
            self.cpu_keys.discard(key)
            self._estimates.pop(key, None)
            self.dual.forget(key)

    def _watch_backlog(self, key: Key) -> None:
        """Warn, once per worker and graph, where GPU tasks fed by queued reads pile up on a GPU
        worker: distributed queues no task with resource restrictions (dask/distributed#9164),
        so a CPU worker that finished a read takes the next while the device lags behind.
        Only reads not paced (by the plugin, :mod:`eugo_dask.gates`, or the pass's tokens,
        :mod:`eugo_dask.pace`) count: a paced read waits for the device (unpaced: a graph
        planned elsewhere, ``eugo.read-ahead: null``, or a read whose gate would not come
        before it)."""
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        ws = ts.processing_on if ts is not None else None
        if ts is None or ws is None or ws.address in self._backlog_warned:
            return
        assigned = len(ws.processing)
        if assigned < max(BACKLOG_MIN, BACKLOG_PER_THREAD * ws.nthreads):
            return
        checked = (ws.address, ts.group.name)  # a group's tasks share their inputs' kind
        if checked in self._backlog_checked:
            return
        self._backlog_checked.add(checked)
        unpaced = functools.partial(_unpaced_read, gates=self.gates)
        if not any(unpaced(dts) or any(map(unpaced, dts.dependencies)) for dts in ts.dependencies):
            return
        self._backlog_warned.add(ws.address)
        self._warn(f"eugo: {assigned} tasks are assigned to GPU worker {ws.name}, fed by queued "
                   "reads that run ahead of its device; their blocks wait in memory "
                   "(dask/distributed#9164). Worker memory limits bound it: distributed spills "
                   "and pauses.")

    def _prefix(self, name: str) -> PrefixStats:
        stats = self.prefixes.get(name)
        if stats is None:
            if len(self.prefixes) >= MAX_PREFIXES:
                name = "other"
            stats = self.prefixes.setdefault(name, PrefixStats())
        return stats

    def _count(self, key: Key, worker: str | None, startstops: Any) -> None:
        scheduler = self.scheduler
        gpu, host, cpu = key in self.gpu_keys, key in self.host_keys, key in self.cpu_keys
        sent = self.dual.sent_to.get(key)
        if scheduler is None or not (gpu or host or cpu or sent):
            return
        ts = scheduler.tasks.get(key)
        if ts is None:
            return
        role = (ts.annotations or {}).get("eugo", {}).get("role")
        ws = scheduler.workers.get(worker) if worker is not None else None
        usage = self._usage_of.pop(key, None)
        if usage is not None:
            kind: UsageKind = ("copies" if role in (TODEVICE_ROLE, TOHOST_ROLE) else
                               "gpu" if (role == GPU_ROLE or (sent and sent[0] == GPU_UNIT))
                               and ws is not None and ws.resources.get(self.resource)
                               else "cpu")
            usage.ran(kind, startstops, worker)
        self.placements.append((key, role, str(ws.name) if ws is not None else worker))
        if role == PACE_ROLE:
            return
        stats = self._prefix(ts.prefix.name)
        estimate = self._estimates.pop(key, None)
        if role == GPU_ROLE:
            stats.planned_gpu += 1
            if estimate is not None:
                stats.planned_saving_s += estimate[0] - estimate[1]
        elif role in (CPU_ROLE, HOST_ROLE):
            stats.cpu_tasks += 1
        if estimate is not None and role in (GPU_ROLE, CPU_ROLE, HOST_ROLE):
            stats.predicted_s += estimate[1]
            stats.actual_s += _compute_seconds(startstops)

    def _learn(self, key: Key, startstops: Any) -> None:
        seconds = _compute_seconds(startstops)
        if seconds > 0:
            observe(key, seconds)

    async def close(self) -> None:
        save_all()

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == EVENT_TOPIC:
            self._guard("log_event", self._event, msg)

    def _event(self, msg: Any) -> None:
        """Tasks' (and the pass's) reports, accepted only in their known shapes. Anyone may send
        one (a client too): a worker's report of itself comes on its own stream instead
        (:meth:`_worker_reported`)."""
        text = _texts(msg)
        if "fallback" in text and FALLBACK_REASON.match(text["fallback"]):
            reason = text["fallback"]
            if reason in self.fallback_reasons or len(self.fallback_reasons) < MAX_REASONS:
                prefixes = self.fallback_reasons.setdefault(reason, set())
                if len(prefixes) < MAX_REASONS:
                    prefixes.add(text.get("prefix", "?"))
            _task_logger.debug("fallback in %s: %s", _escaped(text.get("prefix", "?")),
                               _escaped(reason))
        elif "warning" in text:  # (the pass's, through tell_scheduler; or anyone's)
            self._warn(text["warning"],
                       level=logging.DEBUG if SHOWN_HERE in text else logging.WARNING)

    def _worker_reported(self, worker: str, report: Any) -> None:
        """What ``worker`` says of itself at start (:class:`~eugo_dask.worker.EugoWorkerPlugin`):
        a setting of its own that is invalid, or that it advertises the resource but cannot use
        a device."""
        text = _texts(report)
        if self.scheduler is None or worker not in self.scheduler.workers:
            return
        if "no-device" in text:
            self.workers_without_device[worker] = text["no-device"]
            self._warn(f"eugo: GPU worker {worker} cannot use a device "
                       f"({text['no-device']}): its GPU tasks run their CPU path")
        elif "invalid-setting" in text:
            # the first, as the worker's own "no device" reason names the first
            self.invalid_settings.setdefault(worker, text["invalid-setting"])
            self._warn(f"eugo: worker {worker}: {text['invalid-setting']}")

    # -- reading ------------------------------------------------------------------------------
    def worker_reports(self) -> dict[str, Any]:
        """What workers report their eugo tasks did, per task prefix (from the Fine Performance
        Metrics they send with their heartbeats): tasks that ran on a device or on the CPU,
        bytes copied each way, and fallbacks by category.

        Any task can report under eugo's labels (``context_meter.digest_metric``): a series
        whose total is not a finite non-negative number (a NaN, an infinity or a negative value
        reported into it) is dropped, and counted in ``dropped_reports``."""
        ran: dict[str, dict[str, int]] = {"gpu": {}, "cpu": {}}
        copied = {"eugo-h2d": 0, "eugo-d2h": 0}
        fallbacks: Counter[str] = Counter()
        dropped = 0
        metrics = self.scheduler.cumulative_worker_metrics if self.scheduler is not None else {}
        for key, value in list(metrics.items()):
            if not (isinstance(key, tuple) and len(key) == 4 and key[0] == "execute"):
                continue
            _, prefix, activity, unit = key
            if unit == "tasks" and activity in (RAN_ON_DEVICE, RAN_ON_CPU):
                counts = ran["gpu" if activity == RAN_ON_DEVICE else "cpu"]
            elif unit == "bytes" and activity in copied:
                counts = copied
                prefix = activity
            elif (unit == "tasks" and isinstance(activity, str)
                  and activity.startswith("eugo-fallback-")
                  and activity[len("eugo-fallback-"):] in FALLBACK_CATEGORIES):
                counts = fallbacks
                prefix = activity[len("eugo-fallback-"):]
            else:
                continue
            if not _is_count(value):
                dropped += 1
                continue
            counts[prefix] = counts.get(prefix, 0) + int(value)
        return {"ran": ran, "bytes_h2d": copied["eugo-h2d"], "bytes_d2h": copied["eugo-d2h"],
                "fallbacks": dict(fallbacks), "dropped_reports": dropped}

    def summary(self) -> dict[str, Any]:
        """The counters, as plain data: tasks by where they ran (GPU tasks as workers report;
        CPU-planned tasks as they finished), bytes copied, fallbacks, estimates, warnings."""
        reports = self.worker_reports()
        tasks: dict[str, dict[str, int]] = {"gpu": dict(reports["ran"]["gpu"]),
                                            "cpu": dict(reports["ran"]["cpu"])}
        for prefix, stats in self.prefixes.items():
            if stats.cpu_tasks:
                tasks["cpu"][prefix] = tasks["cpu"].get(prefix, 0) + stats.cpu_tasks
        on_device = sum(reports["ran"]["gpu"].values())
        cpu_path = sum(reports["ran"]["cpu"].values())
        planned_saving = sum(s.planned_saving_s for s in self.prefixes.values())
        # the saving the plan promised, for the share of GPU tasks that did run on a device
        share = on_device / (on_device + cpu_path) if on_device + cpu_path else 0.0
        return {
            "tasks": {k: v for k, v in tasks.items() if v},
            "bytes_h2d": reports["bytes_h2d"],
            "bytes_d2h": reports["bytes_d2h"],
            "fallbacks": reports["fallbacks"],
            "fallback_reasons": {r: sorted(p) for r, p in self.fallback_reasons.items()},
            "dropped_reports": reports["dropped_reports"],
            "estimated_saved_s": planned_saving * share,
            "prefixes": {p: s.to_dict() for p, s in self.prefixes.items()},
            "workers_without_device": dict(self.workers_without_device),
            "invalid_settings": dict(self.invalid_settings),
            "warnings": list(self.warnings),
            "errors": self.errors,
            "plans": recent_plans(),  # the pass's, in this process (the dashboard shows them)
            "usage": [u.to_dict() for u in self.usage],
            "dual": dict(self.dual.sent),
            "gates": self.gates.summary(),  # reads and copies held on the scheduler
        }


class _DualDispatch:
    """The scheduler's side of run-time dispatch (see the module docstring): the dual tasks of
    the graphs placed, the ledger of units (:class:`~eugo_dask.dispatch.Ledger`) and where each
    task was sent. Its methods run inside the plugin's hooks, guarded there: whatever fails
    leaves a task unrestricted, and a dual task without the GPU slot runs its CPU path."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.ledger = Ledger()
        #: dual tasks not forgotten -> (prefix, seconds on a CPU thread, on a GPU slot)
        self.costs: dict[Key, tuple[str, float, float]] = {}
        #: decided dual tasks -> (the kind of unit and the worker they were sent to)
        self.sent_to: dict[Key, tuple[UnitKind, str | None]] = {}
        #: tasks on the ledger -> (worker, kind, unit, expected end)
        self.charged: dict[Key, tuple[str, UnitKind, int, float]] = {}
        #: decisions made, by kind (what the plugin decided; workers report where tasks ran)
        self.sent: Counter[str] = Counter()
        self._workers_known = False

    def add(self, key: Key, prefix: str, thread_s: Any, slot_s: Any) -> None:
        """A dual task of a graph placed now, not started (a key computed before and released
        since is decided again)."""
        self.sent_to.pop(key, None)
        self.charged.pop(key, None)
        if _is_seconds(thread_s) and _is_seconds(slot_s):
            self.costs[key] = (prefix, float(thread_s), float(slot_s))

    def _know_workers(self, scheduler: Scheduler) -> None:
        if not self._workers_known:
            self._workers_known = True
            for ws in scheduler.workers.values():
                self.worker_joined(ws)

    def worker_joined(self, ws: Any) -> None:
        slots = int(ws.resources.get(self.resource, 0) or 0)
        self.ledger.set_worker(ws.address, threads=0 if slots else ws.nthreads, slots=slots,
                               now=time.time())

    def decide_ready(self, scheduler: Scheduler, tasks: list[TaskState]) -> None:
        """Decide the dual ``tasks`` whose inputs all exist already (roots among them), in
        Dask's order."""
        ready = [ts for ts in tasks if ts.key not in self.sent_to and ts.state in _PENDING
                 and all(d.state == "memory" for d in ts.dependencies)]
        for ts in sorted(ready, key=lambda t: t.priority or ()):
            self.decide(scheduler, ts)

    def decide(self, scheduler: Scheduler, ts: TaskState) -> None:
        """Send dual task ``ts`` (not started) to the unit expected to finish it first."""
        self._know_workers(scheduler)
        prefix, thread_s, slot_s = self.costs[ts.key]
        now = time.time()
        choice = self.ledger.choose(prefix, thread_s, slot_s, now)
        self.sent_to[ts.key] = (choice.kind, choice.worker)
        self.sent[choice.kind] += 1
        if choice.worker is not None:
            seconds = self.ledger.seconds(prefix, choice.kind, thread_s if choice.kind == CPU_UNIT
                                          else slot_s)
            charged = self.ledger.charge(choice.worker, choice.kind, seconds, now)
            if charged is not None:
                self.charged[ts.key] = (choice.worker, choice.kind, *charged)
        if choice.kind == GPU_UNIT and choice.worker is not None:
            ts.resource_restrictions = {self.resource: 1}
            ts.worker_restrictions = {choice.worker}
            ts.loose_restrictions = False
        elif choice.worker is not None:  # (loose: any worker, should this one leave)
            ts.worker_restrictions = {choice.worker}
            ts.loose_restrictions = True
        _task_logger.debug("dual %s -> %s %s, expected to finish in %.3g s", ts.key,
                           choice.kind, choice.worker, choice.finish - now)

    def transition(self, scheduler: Scheduler | None, key: Key, start: str, finish: str,
                   startstops: Any) -> None:
        if scheduler is None:
            return
        if start == "processing":
            self._left_worker(key, finish, startstops)
        if finish == "memory" and start == "processing":
            ts = scheduler.tasks.get(key)
            for dts in ts.dependents if ts is not None else ():
                if (dts.key in self.costs and dts.key not in self.sent_to
                        and dts.state == "waiting" and not dts.waiting_on):
                    self.decide(scheduler, dts)
        elif finish == "processing" and key not in self.charged:
            self._charge_other(scheduler, key)

    def _charge_other(self, scheduler: Scheduler, key: Key) -> None:
        """Put a task other than a dual one on the ledger of the worker it was sent to: the
        dual tasks decided later wait behind it (its prefix's mean duration as distributed
        measured it, else its plan's estimate, else nothing)."""
        ts = scheduler.tasks.get(key)
        ws = ts.processing_on if ts is not None else None
        if ts is None or ws is None or not self.costs:
            return
        gpu = (ts.resource_restrictions or {}).get(self.resource, 0) >= 1
        role = (ts.annotations or {}).get("eugo") or {}
        seconds: Any = ts.prefix.duration_average
        if not seconds or seconds < 0:
            seconds = role.get("est_s") if gpu else role.get("cpu_s")
        if not _is_seconds(seconds):
            return
        kind: UnitKind = GPU_UNIT if gpu else CPU_UNIT
        charged = self.ledger.charge(ws.address, kind, float(seconds), time.time())
        if charged is not None:
            self.charged[key] = (ws.address, kind, *charged)

    def _left_worker(self, key: Key, finish: str, startstops: Any) -> None:
        """A task left its worker (done, failed or released): settle the ledger, and learn
        from a dual task's measured compute time."""
        charged = self.charged.pop(key, None)
        if charged is None:
            return
        worker, kind, unit, expected_end = charged
        self.ledger.settle(worker, kind, unit, expected_end, time.time())
        cost = self.costs.get(key)
        if cost is not None and finish == "memory" and startstops:
            prefix, thread_s, slot_s = cost
            self.ledger.observe(prefix, kind, thread_s if kind == CPU_UNIT else slot_s,
                                _compute_seconds(startstops))

    def worker_left(self, scheduler: Scheduler, worker: str, stimulus_id: str) -> None:
        """Dual tasks sent to ``worker`` and waiting again (they had not started, or it lost
        them) are decided anew among the workers there are; those stuck without a worker go
        to one."""
        self.ledger.remove_worker(worker)
        stuck = []
        for key, (_, sent) in list(self.sent_to.items()):
            ts = scheduler.tasks.get(key)
            if sent != worker or ts is None or ts.state not in _WAITING:
                continue
            del self.sent_to[key]
            self.charged.pop(key, None)
            ts.resource_restrictions = None
            ts.worker_restrictions = None
            ts.loose_restrictions = False
            if ts.state == "no-worker" or not ts.waiting_on:
                self.decide(scheduler, ts)
            if ts.state == "no-worker":
                stuck.append(key)
        if stuck:
            scheduler.transitions({k: "processing" for k in stuck},
                                  stimulus_id=f"eugo-dual-{stimulus_id}")

    def forget(self, key: Key) -> None:
        self.costs.pop(key, None)
        self.sent_to.pop(key, None)
        self.charged.pop(key, None)


def _is_seconds(value: Any) -> bool:
    """A finite, non-negative number of seconds."""
    return _is_count(value)


def _worker_report(scheduler: Scheduler, worker: str, report: Any) -> None:
    """The scheduler's handler of :data:`~eugo_dask.worker.REPORT_OP` messages: on a worker's
    stream the scheduler passes ``worker``, that worker's address. A client's stream passes
    ``client``, which this handler does not take: the call fails, and the scheduler drops that
    client's connection, as for any message it has no handler for."""
    plugin = scheduler.plugins.get(EugoSchedulerPlugin.name)
    if isinstance(plugin, EugoSchedulerPlugin):
        plugin._guard("worker report", plugin._worker_reported, worker, report)


def _texts(msg: Any) -> dict[str, str]:
    """The text fields of a report (longer texts than eugo's own senders make are not eugo's:
    dropped)."""
    if not isinstance(msg, dict):
        return {}
    return {k: v for k, v in msg.items() if isinstance(k, str) and isinstance(v, str)
            and len(v) <= MAX_EVENT_TEXT}


def _escaped(text: str) -> str:
    """``text`` on one line: characters that do not print (newlines, carriage returns, terminal
    escapes) as Python writes them escaped, so that text from clients and workers cannot make
    lines of its own in the scheduler's log."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _restricted(ts: TaskState) -> bool:
    """Whether the user restricted the task (``workers=``, ``resources=``, ``dask.annotate``):
    eugo's own restriction of a host task, loose, would change where the user said it runs (and
    loose restrictions do not go with resource restrictions: a worker without the resource would
    be sent the task)."""
    return bool(ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions)


def _without_slot(wanted: dict[str, Any], resource: str, kept: dict[int, dict[str, Any] | None]
                  ) -> dict[str, Any] | None:
    """What a copy kept to the GPU workers by worker restrictions asks for: ``wanted`` without
    eugo's ``{resource: 0}`` (the user's own resources; None where they asked for none). One
    dict per distinct request, as ``wanted`` is, in ``kept``."""
    if id(wanted) not in kept:
        kept[id(wanted)] = {r: n for r, n in wanted.items()
                            if not (r == resource and n == 0)} or None
    return kept[id(wanted)]


def _allow_worker(scheduler: Scheduler, keys: set, worker: str) -> None:
    """Add ``worker``, which joined, to the restrictions the plugin gave the pending tasks
    ``keys`` (host tasks to CPU workers, copies to GPU workers)."""
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None and ts.state in _PENDING and ts.worker_restrictions is not None:
            ts.worker_restrictions.add(worker)


def _disallow_worker(scheduler: Scheduler, keys: set, worker: str) -> None:
    """Take ``worker``, which left, out of the restrictions the plugin gave the host tasks
    ``keys`` (loose ones); a task restricted to no worker left is restricted no more."""
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is not None and ts.worker_restrictions:
            ts.worker_restrictions.discard(worker)
            if not ts.worker_restrictions:
                ts.worker_restrictions = None


def _is_root(ts: TaskState) -> bool:
    """A task the scheduler may queue as a root (a read, a data producer): left unrestricted,
    since distributed queues only unrestricted root-ish tasks."""
    run_spec = ts.run_spec
    return not ts.dependencies or bool(getattr(run_spec, "data_producer", False))


def _unpaced_read(ts: TaskState, gates: Gates) -> bool:
    """A root task (:func:`_is_root`) that neither the pass paced to the device (with a token)
    nor the plugin (:mod:`eugo_dask.gates`: held, or one of the first reads its window lets
    run)."""
    return (_is_root(ts) and getattr(ts.run_spec, "func", None) is not after_token
            and ts.key not in gates.paced and ts.key not in gates.within)


def _is_count(value: Any) -> bool:
    """A finite, non-negative number (a reported count of tasks or bytes)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def _compute_seconds(startstops: Any) -> float:
    seconds = sum(ss["stop"] - ss["start"] for ss in startstops if ss.get("action") == "compute")
    return seconds if math.isfinite(seconds) else 0.0


def dask_setup(scheduler: Scheduler) -> None:
    """``dask scheduler --preload eugo_dask.plugin`` entry point."""
    scheduler.add_plugin(EugoSchedulerPlugin())


# A preload is imported before the scheduler builds its dashboard: add the Eugo page now.
install_dashboard()
