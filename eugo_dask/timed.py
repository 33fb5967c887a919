"""The timed emulated cluster: a schedule of the model (:mod:`eugo_dask.schedule`) run on a real
distributed scheduler and real workers, every task taking its estimated time, so a 2-core machine
times a plan as if it had N CPU threads and G GPUs.

Each task of the graph becomes a task that sleeps (the GIL released: threads overlap as a
machine's cores do) for its estimate times ``dilation``: its CPU time on the CPU worker, which has
``cpu_threads`` threads; its device time on GPU worker ``g`` (one per GPU, a ``GPU`` resource of 1:
one kernel at a time). Copies are tasks of their own that sleep ``latency + bytes / bandwidth``:

- ``copies="link"``: as eugo's copy tasks run now, on a thread of the GPU worker asking for no
  resource (a resource request would queue them behind the kernels waiting for the slot,
  ``_ensure_computing``), beside the kernel; each waits, on its thread, for the GPU's link in its
  direction (a lock per link: one copy each way at a time, as a DMA engine). With ``ahead``, the
  copies to a device are held by :class:`~eugo_dask.gates.Gates` on the scheduler as eugo's
  plugin holds them: each until the device task ``ahead`` places before its first consumer has
  ended;
- ``copies="slot"``: holding the worker's ``GPU`` resource, as eugo's copy tasks did before they
  asked for none of it.

Where each task runs is the simulated schedule's ``assignment`` (a CPU thread, or GPU ``g``), set
as worker restrictions; the order is distributed's own (Dask's priorities). Under the ``dual``
policy the dual tasks are not placed in advance: each carries both durations (its CPU time, and
its time holding a GPU slot with its copies inside it) in an ``eugo`` annotation of role
``dual``, eugo's scheduler plugin sends it where it expects it to finish first as it becomes
ready, and it sleeps the duration of where it was granted to run (a thread; or the slot, its
copies in and back taking the worker's links as copy tasks do); its result is on the host either
way. What comes back is
the makespan the scheduler achieved, from the first task's start to the last one's end, divided
by ``dilation``: comparable with :func:`~eugo_dask.schedule.simulate`'s and the bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from distributed.diagnostics.plugin import SchedulerPlugin

from eugo_dask.context import current_worker, granted_resources
from eugo_dask.gates import CHECK_MS, Gates
from eugo_dask.rewrite import DUAL_ROLE
from eugo_dask.schedule import (
    CopyMode,
    Costs,
    Machine,
    Schedule,
    dual_copy_seconds,
    dual_slot_seconds,
)

#: the resources of a GPU worker: one kernel at a time
GPU_WORKER_RESOURCES = {"GPU": 1}
#: a GPU worker's threads: the kernel's, and one for a copy each way
GPU_WORKER_THREADS = 3
#: the key (and layer) of the task that gathers the outputs
DONE = "timed-done"


def _sleep(seconds: float, *inputs: Any) -> int:
    time.sleep(seconds)
    return 0


_links: dict[str, threading.Lock] = {}
_links_lock = threading.Lock()


def _sleep_on_link(link: str, seconds: float, *inputs: Any) -> int:
    """A copy: ``seconds`` on link ``link`` (a GPU worker's, one direction), once it is free."""
    with _links_lock:
        lock = _links.setdefault(link, threading.Lock())
    with lock:
        time.sleep(seconds)
    return 0


def _sleep_dual(thread_s: float, in_s: float, kernel_s: float, back_s: float,
                *inputs: Any) -> int:
    """A dual task: where its worker granted it a GPU slot, its copy in on the worker's link
    up, its kernel, its copy back on the link down (the slot held throughout); else
    ``thread_s``."""
    granted = granted_resources() or {}
    if granted.get("GPU", 0) < 1:
        time.sleep(thread_s)
        return 0
    worker = getattr(current_worker(), "address", "")
    for direction, seconds in (("up", in_s), ("", kernel_s), ("down", back_s)):
        if direction and seconds:
            _sleep_on_link(f"{worker}-{direction}", seconds)
        else:
            time.sleep(seconds)
    return 0


@dataclass(frozen=True)
class TimedRun:
    """A schedule run on the timed cluster: ``makespan_s`` (model seconds: wall seconds over
    ``dilation``), and how many tasks and copies ran."""

    makespan_s: float
    tasks: int
    copies: int
    dilation: float
    #: where each task of the graph ran: -1 the CPU worker, g GPU worker g (as assigned)
    ran: tuple[int, ...] = ()
    #: copies held on the scheduler until a device task ended (``ahead``)
    gated: int = 0
    #: each task's and copy's compute (start, stop), wall clock, by key
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)


def task_key(i: int, dual: frozenset[int]) -> str:
    """The key of task ``i``: ``dual-<i>`` for a dual task, else ``task-<i>`` (the prefixes
    tell the plugin's ledger the durations distributed measured of each apart)."""
    return f"dual-{i}" if i in dual else f"task-{i}"


def _dual_tasks(costs: Costs, schedule: Schedule) -> frozenset[int]:
    """The tasks the scheduler plugin places at run time: the dual ones, under policy dual."""
    return costs.dual if schedule.policy == "dual" else frozenset()


def timed_graph(costs: Costs, schedule: Schedule, machine: Machine, *, dilation: float,
                copies: CopyMode, cpu_worker: str, gpu_workers: list[str]
                ) -> tuple[HighLevelGraph, str]:
    """The sleeping graph of ``schedule`` and its one output key (see the module docstring)."""
    # (a dual task's result is on the host wherever it ran: its copy back is inside it)
    dual = _dual_tasks(costs, schedule)
    where = tuple(-1 if i in dual else g for i, g in enumerate(schedule.assignment))
    layers: dict[str, dict[str, Task]] = {}
    annotations: dict[str, dict[str, Any]] = {}

    def add(layer: str, key: str, task: Task, restriction: dict[str, Any]) -> None:
        if layer not in layers:
            layers[layer], annotations[layer] = {}, restriction
        layers[layer][key] = task

    def copy(layer: str, key: str, g: int, seconds: float, source: str) -> None:
        """A copy on GPU ``g``'s link ``layer`` (up or down): in its slot, or on its link."""
        restriction: dict[str, Any] = {"workers": [gpu_workers[g]], "allow_other_workers": False}
        if copies == "slot":
            task = Task(key, _sleep, seconds, TaskRef(source))
            restriction["resources"] = {"GPU": 1}
        else:
            task = Task(key, _sleep_on_link, f"{gpu_workers[g]}-{layer}", seconds, TaskRef(source))
        add(f"{layer}-{g}", key, task, restriction)

    def down(u: int) -> str:
        """The copy of value ``u`` back to the host, made once."""
        g = where[u]
        key = f"down-{u}"
        if key not in layers.get(f"down-{g}", {}):
            copy("down", key, g, machine.d2h_s(costs.nbytes[u]) * dilation, task_key(u, dual))
        return key

    def up(u: int, g: int) -> str:
        """The copy of value ``u`` to GPU ``g``, made once (from the host, or via it)."""
        key = f"up-{u}-{g}"
        if key not in layers.get(f"up-{g}", {}):
            source = task_key(u, dual) if where[u] < 0 else down(u)
            copy("up", key, g, machine.h2d_s(costs.nbytes[u]) * dilation, source)
        return key

    for i in range(len(costs)):
        g = where[i]
        if i in dual:
            inputs = [task_key(u, dual) if where[u] < 0 else down(u) for u in costs.deps[i]]
            thread_s = costs.cpu_s[i] * dilation
            copy_in, copy_back = dual_copy_seconds(costs, machine, i)
            slot_s = dual_slot_seconds(costs, machine, i) * dilation
            key = task_key(i, dual)
            add("dual", key, Task(key, _sleep_dual, thread_s, copy_in * dilation,
                                  (costs.gpu_s[i] or 0.0) * dilation, copy_back * dilation,
                                  *map(TaskRef, inputs)),
                {"eugo": {"role": DUAL_ROLE, "cpu_s": thread_s, "est_s": slot_s}})
            continue
        if g < 0:
            inputs = [task_key(u, dual) if where[u] < 0 else down(u) for u in costs.deps[i]]
            seconds = costs.cpu_s[i] * dilation
            layer, restriction = "cpu", {"workers": [cpu_worker], "allow_other_workers": False}
        else:
            inputs = [task_key(u, dual) if where[u] == g else up(u, g) for u in costs.deps[i]]
            seconds = (costs.gpu_s[i] or 0.0) * dilation
            layer, restriction = f"gpu-{g}", {"workers": [gpu_workers[g]],
                                              "allow_other_workers": False,
                                              "resources": {"GPU": 1}}
        key = task_key(i, dual)
        add(layer, key, Task(key, _sleep, seconds, *map(TaskRef, inputs)), restriction)
    outputs = [task_key(u, dual) if where[u] < 0 else down(u) for u in sorted(costs.outputs)]
    # one task that gathers them (no time of its own), the graph's one output
    add(DONE, DONE, Task(DONE, _sleep, 0.0, *map(TaskRef, outputs)),
        {"workers": [cpu_worker], "allow_other_workers": False})
    graph = HighLevelGraph(
        {name: MaterializedLayer(tasks, annotations=annotations[name])
         for name, tasks in layers.items()},
        {name: set() for name in layers})
    return graph, DONE


class _Gating(SchedulerPlugin):
    """Holds the timed graph's copies to the devices (``up-…``) as eugo's plugin holds a
    graph's (:meth:`~eugo_dask.gates.Gates.pace`), ``ahead`` device tasks ahead."""

    name = "eugo-timed-gating"

    def __init__(self, scheduler: Any, ahead: int) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler, self.ahead = scheduler, ahead
        self.gates = Gates()
        self.watchdog = PeriodicCallback(lambda: self.gates.check(scheduler), CHECK_MS)
        self.watchdog.start()

    def update_graph(self, scheduler: Any, *, tasks: list | None = None, **kwargs: Any) -> None:
        keys = [str(k) for k in tasks or ()]
        device = [k for k in keys if k.startswith("task-")
                  and (scheduler.tasks[k].resource_restrictions or {}).get("GPU")]
        self.gates.pace(scheduler, [k for k in keys if k.startswith("up-")], device, None,
                        self.ahead)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        self.gates.transition(self.scheduler, key, finish)


async def _run(costs: Costs, schedule: Schedule, machine: Machine, dilation: float,
               copies: CopyMode, ahead: int | None, timeout_s: float) -> TimedRun:
    from dask.delayed import Delayed
    from distributed import Client, Scheduler, Worker

    async with Scheduler(host="127.0.0.1", dashboard_address=":0") as scheduler:
        clock = _Clock()
        scheduler.add_plugin(clock)
        async with Worker(scheduler.address, nthreads=machine.cpu_threads) as cpu, \
                _gpu_workers(scheduler.address, machine.gpus) as gpus, \
                Client(scheduler.address, asynchronous=True) as client:
            if schedule.policy == "dual":  # eugo's scheduler plugin places the dual tasks
                from eugo_dask.plugin import EugoSchedulerPlugin

                await client.register_plugin(EugoSchedulerPlugin())
            gating = None
            if ahead is not None and copies == "link":
                gating = _Gating(scheduler, ahead)
                scheduler.add_plugin(gating)
            graph, done = timed_graph(costs, schedule, machine, dilation=dilation,
                                         copies=copies, cpu_worker=cpu.address,
                                         gpu_workers=[w.address for w in gpus])
            future = client.compute(Delayed(done, graph), optimize_graph=False)
            try:
                await asyncio.wait_for(future, timeout_s)
            finally:
                if gating is not None:
                    gating.watchdog.stop()
            copies_run = sum(len(graph.layers[name]) for name in graph.layers
                             if name.startswith(("up-", "down-")))
            span = (max(clock.stops) - min(clock.starts)) if clock.starts else 0.0
            unit = {cpu.address: -1, **{w.address: g for g, w in enumerate(gpus)}}
            dual = _dual_tasks(costs, schedule)
            ran = tuple(unit.get(clock.workers.get(task_key(i, dual), ""), -2)
                        for i in range(len(costs)))
            return TimedRun(span / dilation, len(clock.starts), copies_run, dilation, ran,
                            gating.gates.made if gating is not None else 0, dict(clock.spans))


class _Clock(SchedulerPlugin):
    """A scheduler plugin that keeps when each task's compute started and stopped."""

    name = "eugo-timed-clock"

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.stops: list[float] = []
        self.workers: dict[Any, str] = {}  # key -> the worker that ran it
        self.spans: dict[str, tuple[float, float]] = {}  # key -> its compute's start, stop

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if start == "processing" and finish == "memory":
            self.workers[key] = kwargs.get("worker", "")
            for part in kwargs.get("startstops", ()):
                if part.get("action") == "compute":
                    self.starts.append(part["start"])
                    self.stops.append(part["stop"])
                    self.spans[str(key)] = (part["start"], part["stop"])


class _gpu_workers:
    """``count`` GPU workers, started and closed together."""

    def __init__(self, address: str, count: int) -> None:
        self.address, self.count = address, count
        self.workers: list[Any] = []

    async def __aenter__(self) -> list[Any]:
        from distributed import Worker

        self.workers = [Worker(self.address, nthreads=GPU_WORKER_THREADS,
                               resources=dict(GPU_WORKER_RESOURCES))
                        for _ in range(self.count)]
        await asyncio.gather(*self.workers)
        return self.workers

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))


def run_timed(costs: Costs, schedule: Schedule, *, dilation: float, copies: CopyMode = "link",
              ahead: int | None = None, timeout_s: float = 300.0) -> TimedRun:
    """Run ``schedule`` (its assignment) on a timed cluster of ``schedule.machine``'s shape
    (``ahead``: the device tasks whose copies to the devices may run ahead, as
    :func:`~eugo_dask.schedule.simulate` takes it; None: no gate)."""
    return asyncio.run(_run(costs, schedule, schedule.machine, dilation, copies, ahead,
                            timeout_s))
