"""Where eugo runs: the distributed scheduler a pass runs in, the worker a task runs in, the local
scheduler a graph computed here runs on.

The one module that reads distributed's objects for that, private attributes included
(``Scheduler._instances``, ``_active_graph_updates``). It never imports distributed: where
distributed is not loaded in this process, no scheduler or worker of it runs here either, so
each lookup goes through ``sys.modules`` and answers None (or nothing) without it. That keeps
the planner and the task wrappers (:mod:`eugo_dask.runtime`), which ask these questions, free
of distributed (the import contracts in ``pyproject.toml`` say so).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import dask

logger = logging.getLogger(__name__)


# --- a distributed scheduler in this process (where the pass runs for a cluster) ------------------
def running_schedulers() -> list[Any]:
    """The distributed schedulers running in this process."""
    module = sys.modules.get("distributed.scheduler")  # imported only where one may run
    if module is None:
        return []
    return [s for s in list(module.Scheduler._instances) if s.status.name == "running"]


def running_scheduler() -> Any:
    """The distributed scheduler this pass runs in, or None (a client, a local scheduler, or
    several schedulers in one process of which none is receiving a graph)."""
    candidates = running_schedulers()
    if len(candidates) > 1:  # several in one process (tests): the one receiving a graph
        candidates = [s for s in candidates if getattr(s, "_active_graph_updates", 0)]
    return candidates[0] if len(candidates) == 1 else None


def scheduler_plugin(scheduler: Any, name: str) -> Any:
    """The plugin registered on ``scheduler`` under ``name``, or None."""
    return scheduler.plugins.get(name) if scheduler is not None else None


#: A worker as the planner sees it: the resources it advertises and its threads.
WorkerShape = tuple[dict[str, float], int]


def scheduler_workers(scheduler: Any) -> list[WorkerShape]:
    """The workers of ``scheduler`` (:data:`WorkerShape`); empty without a scheduler."""
    if scheduler is None:
        return []
    return [(dict(ws.resources), int(ws.nthreads)) for ws in list(scheduler.workers.values())]


#: Seconds ``explain()`` waits for the scheduler to say which workers it has (a scheduler that
#: does not answer in that time is planned for as the profile's machine).
SCHEDULER_TIMEOUT_S = 5.0


def client_workers() -> list[WorkerShape] | None:
    """The workers of the distributed cluster ``compute`` would run on now (the default
    synchronous client's, as its scheduler reports them), or None where ``compute`` runs
    elsewhere (a local scheduler, an asynchronous client, a scheduler that cannot be asked)."""
    get = compute_get()
    client = getattr(get, "__self__", None)
    module = sys.modules.get("distributed.client")
    if (module is None or not isinstance(client, module.Client) or client.asynchronous
            or client.status != "running" or client.scheduler is None):
        return None
    try:
        # the scheduler's answer itself: scheduler_info() returns the client's cached identity,
        # which its periodic refresh (n_workers=0, no workers) may have replaced meanwhile
        info = client.sync(client.scheduler.identity, n_workers=-1,
                           callback_timeout=SCHEDULER_TIMEOUT_S)
    except (OSError, RuntimeError, TimeoutError):  # closed, unreachable or not answering:
        # plan for the profile
        return None
    return [(dict(w.get("resources") or {}), int(w.get("nthreads") or 0))
            for w in (info.get("workers") or {}).values()]


def gpu_task_slots(workers: list[WorkerShape], resource: str) -> list[tuple[float, int]]:
    """For each worker that advertises ``resource``: (its units, its threads)."""
    return [(float(resources[resource]), threads)
            for resources, threads in workers if resources.get(resource)]


def cpu_task_threads(workers: list[WorkerShape], resource: str) -> int:
    """The threads of ``workers`` that run host tasks: those of the workers that do not
    advertise ``resource`` (where the eugo plugin keeps host work), or, where every worker
    does, theirs less one per unit of it (at least one each); 0 without workers."""
    plain = sum(threads for resources, threads in workers if not resources.get(resource))
    return plain or sum(max(threads - int(resources[resource]), 1)
                        for resources, threads in workers)


def read_slots(scheduler: Any) -> int:
    """The root tasks the workers of ``scheduler`` take at once: each worker's threads times
    distributed's ``worker-saturation``, rounded up, as the scheduler counts a worker's room for
    queued tasks (1.1 where queuing is off); 0 without a scheduler."""
    if scheduler is None:
        return 0
    saturation = float(getattr(scheduler, "WORKER_SATURATION", 1.1))
    if not math.isfinite(saturation):
        saturation = 1.1
    return sum(max(math.ceil(saturation * ws.nthreads), 1)
               for ws in list(scheduler.workers.values()))


def client_here(scheduler: Any) -> bool:
    """Whether a running distributed client of this process is connected to ``scheduler``
    (a ``LocalCluster``'s: the scheduler runs in its client's process)."""
    module = sys.modules.get("distributed.client")
    if module is None:
        return False
    address = getattr(scheduler, "address", None)
    for client in list(module.Client._instances):
        try:
            if getattr(client, "status", None) != "running":
                continue
            cluster = getattr(client, "cluster", None)
            if (getattr(cluster, "scheduler", None) is scheduler
                    or (address is not None and client.scheduler.address == address)):
                return True
        except Exception:  # (a client closing meanwhile)
            continue
    return False


#: What an event of :func:`tell_scheduler` carries where a client of the scheduler's own process
#: shows its warning: the plugin that keeps it logs it at DEBUG.
SHOWN_HERE = "shown-to-a-client-here"


def tell_scheduler(scheduler: Any, topic: str, warning: str, *, client: bool,
                   logged_by_plugin: bool = False) -> None:
    """Log a warning and hand it to the scheduler's event log under ``topic``, from the thread
    Dask materializes graphs in; with ``client``, to the clients too (distributed's "warn"
    topic, which ``worker.warn`` uses: a client shows it as a ``RuntimeWarning``).

    Said once in each process: with ``logged_by_plugin`` the plugin receiving ``topic`` logs
    it (eugo's, escaped) and this does not; where a client of this process shows the warning
    (a ``LocalCluster``'s scheduler runs in its client's process), the log line is at DEBUG."""
    shown_here = client and client_here(scheduler)
    if not logged_by_plugin:
        logger.log(logging.DEBUG if shown_here else logging.WARNING, warning)
    event = {"warning": warning, **({SHOWN_HERE: "yes"} if shown_here else {})}
    scheduler.loop.add_callback(scheduler.log_event, topic, event)
    if client:
        scheduler.loop.add_callback(scheduler.log_event, "warn", {
            "message": pickle.dumps(warning), "category": pickle.dumps(RuntimeWarning)})


# --- the distributed worker a task runs in ------------------------------------------------------
def current_worker() -> Any:
    """The distributed worker whose task is running in this thread, or None."""
    module = sys.modules.get("distributed.worker")  # loaded in every worker
    if module is None:
        return None
    try:
        return module.get_worker()
    except ValueError:  # not inside a distributed worker
        return None


def granted_resources() -> dict[str, float] | None:
    """The resources the distributed worker running this thread's task holds for it (what the
    scheduler asked of the task, as the worker acquired them before starting it), or None
    outside a task of a distributed worker."""
    module = sys.modules.get("distributed.worker")
    worker = current_worker()
    if module is None or worker is None:
        return None
    key = getattr(module.thread_state, "key", None)
    ts = worker.state.tasks.get(key) if key is not None else None
    return dict(ts.resource_restrictions or {}) if ts is not None else None


def running_workers() -> list[Any]:
    """The distributed workers running (or paused) in this process."""
    module = sys.modules.get("distributed.worker")
    if module is None:
        return []
    return [w for w in list(module.Worker._instances) if w.status.name in ("running", "paused")]


def close_worker(worker: Any, reason: str, closed: Callable[[], None]) -> None:
    """Close ``worker`` from any thread, without its nanny, as distributed closes a worker that
    failed hard (``fail_hard``): a nanny then starts a fresh worker process and the scheduler
    recomputes the keys the worker held. ``closed`` is called once the close has ended (or
    failed)."""
    async def close() -> None:
        try:
            await worker.close(nanny=False, executor_wait=False, reason=reason)
        finally:
            closed()

    worker.loop.add_callback(close)


class _NoMeter:
    """What distributed's context meter does where no callback listens (no distributed here)."""

    @contextlib.contextmanager
    def meter(self, label: str) -> Iterator[None]:
        yield

    def digest_metric(self, label: str, value: float, unit: str) -> None:
        pass


_NO_METER = _NoMeter()


def context_meter() -> Any:
    """distributed's context meter (Fine Performance Metrics on the dashboard) where distributed
    is loaded; elsewhere one that records nothing, as distributed's own does with no callback
    (only a worker or a client of distributed adds one)."""
    module = sys.modules.get("distributed.metrics")
    return module.context_meter if module is not None else _NO_METER


# --- the local scheduler a graph computed here runs on --------------------------------------------
def compute_get() -> Any:
    """The scheduler function ``compute`` would use now (``dask.base.get_scheduler``), or None.
    A default asynchronous distributed client (``gen_cluster`` tests, ``Client(asynchronous=True)``)
    gives its ``get``: Dask refuses to hand one to synchronous code, and the pass is synchronous
    code inside that client's own ``compute``/``persist`` or ``dask.optimize``."""
    from dask.base import get_scheduler

    try:
        return get_scheduler()
    except RuntimeError:  # "Attempting to use an asynchronous Client in a synchronous context"
        client = sys.modules.get("distributed.client")
        if client is None:
            raise
        try:
            return client.default_client().get
        except ValueError:  # no default client after all: not the refusal above
            return None


def local_scheduler() -> tuple[str, int] | None:
    """How a graph computed here runs, as dask.config says (``scheduler``, ``num_workers``, a
    default distributed client): ``("threads" or "processes", how many)``, or None for a
    distributed client or a scheduler of another kind. A ``scheduler=`` argument of
    ``compute`` is not seen by the optimization that calls this."""
    from dask import local, threaded
    from dask.system import CPU_COUNT

    named = dask.config.get("scheduler", None) is not None
    scheduler = compute_get() if named or "distributed" in sys.modules else None
    workers = dask.config.get("num_workers", None) or CPU_COUNT
    if scheduler is None or scheduler is threaded.get:
        return ("threads", workers)
    if scheduler is local.get_sync:
        return ("threads", 1)
    multiprocessing = sys.modules.get("dask.multiprocessing")
    if multiprocessing is not None and scheduler is multiprocessing.get:
        return ("processes", workers)
    if isinstance(scheduler, functools.partial) and scheduler.func is local.get_async:
        return ("threads", scheduler.args[1])  # a concurrent.futures pool of threads
    return None
