"""The ``eugo`` graph pass and :func:`explain`.

The pass reads its settings (frozen on the client at submission where a cluster optimizes the
graph: :mod:`eugo_dask.array_optimize`, which also runs it from Dask's ``array_optimize``
hook), finds where it runs (:mod:`eugo_dask.context`), then splits, describes, places and
rewrites the graph (:mod:`eugo_dask.unfuse`, :mod:`eugo_dask.describe`, :mod:`eugo_dask.plan`,
:mod:`eugo_dask.rewrite`), and notes what it did in :mod:`eugo_dask.pass_log`. :func:`explain`
runs the same steps up to the placement, for a collection.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import dask
from dask._task_spec import GraphNode
from dask.array.optimization import optimize as dask_array_optimize
from dask.base import is_dask_collection, tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.typing import NestedKeys

from eugo_dask._version import __version__
from eugo_dask.array_expressions import expression_graph, hook_installed
from eugo_dask.array_optimize import current_submission, may_be_ours
from eugo_dask.config import (
    Settings,
    cluster_profile,
    device_settings,
    emulated_device_count,
    gpu_workers_on_demand,
    history_path,
    keyword_settings,
    load_profile,
    read_settings,
    resolve_profile,
)
from eugo_dask.context import (
    WorkerShape,
    client_workers,
    cpu_task_threads,
    gpu_task_slots,
    local_scheduler,
    read_slots,
    running_scheduler,
    scheduler_plugin,
    scheduler_workers,
    tell_scheduler,
)
from eugo_dask.describe import GraphDescription, describe_graph
from eugo_dask.graph import ChunkInfo, Key, flatten_keys, task_spec_dict
from eugo_dask.history import ensure_local_timing, expect, get_history
from eugo_dask.pace import copies_ahead
from eugo_dask.pass_log import record_failure, record_outcome, record_plan
from eugo_dask.plan import ColdStart, Plan, place
from eugo_dask.profile import Profile
from eugo_dask.rewrite import Rewrite, annotated_graph, rewrite_graph, roles_of_rewritten
from eugo_dask.runtime import EVENT_TOPIC, PlannedDevice, device_first_use_paid, device_started
from eugo_dask.schedule import (
    Machine,
    balanced_shares,
    summarize,
    work_by_group,
    work_groups,
)
from eugo_dask.unfuse import split_mixed_tasks

logger = logging.getLogger(__name__)


def _current_settings() -> Settings:
    submission = current_submission()
    if submission is None:  # a local scheduler: this machine's devices
        return read_settings().resolved()
    # submitted to a distributed scheduler: plan for the cluster's workers, with the cluster's
    # own profile where the client left it to us (eugo.profile: auto); learned durations are
    # the scheduler's own (a client does not choose where the scheduler writes)
    frozen = submission.settings
    changes: dict[str, Any] = {"history": history_path()}
    if frozen.profile == "auto":
        cluster = cluster_profile()
        if cluster is not None:
            changes["profile"] = cluster
    frozen = Settings(**{**frozen.to_dict(), **changes})
    scheduler = running_scheduler()
    if scheduler is None:
        return frozen.resolved()
    workers = [resources for resources, _ in scheduler_workers(scheduler)]
    if not any(resources.get(frozen.resource) for resources in workers):
        if frozen.device != "none" and gpu_workers_on_demand():
            # GPU workers start when GPU work waits (an autoscaled group at zero): plan for them
            return frozen.resolved(gpu_workers=True)
        if frozen.device != "none":
            # a resource request nothing can satisfy would wait forever in no-worker
            advertised = sorted({r for resources in workers for r in resources})
            # a cluster without GPU workers is no mistake (unsupported work stays on the CPU
            # silently); workers that advertise other resources suggest a misspelt one, which
            # the client hears of too
            # (eugo's plugin, where the scheduler has it, keeps the warning and logs it)
            tell_scheduler(scheduler, EVENT_TOPIC, (
                f"eugo: no worker advertises the resource {frozen.resource!r} (workers "
                f"advertise: {advertised or 'none'}); this graph runs unchanged on the CPU"),
                client=bool(advertised),
                logged_by_plugin=scheduler_plugin(scheduler, "eugo") is not None)
        return Settings(**{**frozen.to_dict(), "device": "none"})
    return frozen.resolved(gpu_workers=True)


def _resource_asked(settings: Settings) -> str | None:
    """The resource the pass asks for on each device task (``eugo.resource``), or None where
    the scheduler it runs in has eugo's plugin for that resource: the plugin asks for it after
    the scheduler applied the restrictions the user gave the whole submission
    (``client.compute(..., resources=..., workers=...)``, which the pass does not see), where a
    per-key ``resources`` annotation would replace the user's."""
    plugin = scheduler_plugin(running_scheduler(), "eugo")  # (the eugo plugin's name)
    return None if getattr(plugin, "resource", None) == settings.resource else settings.resource


def _device_memory_bytes(settings: Settings, device: str, profile_memory: float) -> float:
    limit = profile_memory
    if device == "emulated":
        limit = min(limit, settings.emulated_memory_limit)
    return limit * settings.device_memory_fraction


class _Described(NamedTuple):
    """A graph split and described, ready to be placed (under one or several settings)."""

    graph: dict[Key, GraphNode]
    keys: Key | NestedKeys
    description: GraphDescription
    profile: Profile

    def place(self, settings: Settings, *, machine: Machine | None = None) -> Plan:
        """The plan under ``settings``; under ``eugo.dispatch: balanced``, by the bound's split
        on ``machine`` (None: the machine the graph runs on, :func:`_machine`)."""
        device = None if settings.device == "none" else settings.device
        shares = None
        if settings.dispatch == "balanced" and settings.min_speedup != 0:
            shares = _layer_shares(self.description, self.keys, self.profile,
                                   machine or _machine(settings, self.profile))
        return place(self.graph, self.keys, self.description, profile=self.profile,
                     min_speedup=settings.min_speedup, device=device,
                     device_memory_bytes=_device_memory_bytes(
                         settings, settings.device, self.profile.gpu.memory_bytes),
                     gpu_tasks_per_device=_gpu_tasks_per_device(settings, self.profile),
                     cold=_cold_start(device, self.profile),
                     dual_from=settings.dual_from if settings.dispatch == "dual" else None,
                     shares=shares)


#: ``eugo.dispatch: balanced`` places the layers of graphs up to this many described tasks by
#: the bound's split (its groups are few whatever the size; the walk over the tasks that makes
#: them is what grows)
BALANCED_MAX_GROUPS = 2_000


def _layer_shares(description: GraphDescription, keys: Key | NestedKeys, profile: Profile,
                  machine: Machine) -> list[float | None] | None:
    """For each described task, its layer's share on the devices in the split of least work
    that reaches the makespan bound on ``machine`` (:func:`~eugo_dask.schedule.balanced_shares`
    over :func:`~eugo_dask.schedule.work_by_group`); None where no split is found (no SciPy,
    too many groups): the margin places every task."""
    groups, of_task = work_by_group(description, keys, cpu_threads=profile.cpu.threads)
    if len(groups) > BALANCED_MAX_GROUPS:
        return None
    found = balanced_shares(groups, machine)
    if found is None:
        return None
    shares = found[1]
    return [shares.get(g) for g in of_task]


def _machine(settings: Settings, profile: Profile,
             workers: list[WorkerShape] | None = None) -> Machine:
    """The machine a graph runs on, for ``eugo.dispatch: balanced`` and the schedule's
    figures: with GPU workers (those of ``workers``; by default, on a distributed scheduler, its
    own), the threads that run host tasks there (:func:`~eugo_dask.context.cpu_task_threads`)
    and a device per GPU worker and device its process drives; elsewhere the profile's machine
    (its threads and GPUs). The links are the profile's."""
    if workers is None and current_submission() is not None:
        workers = scheduler_workers(running_scheduler())
    slots = gpu_task_slots(workers or [], settings.resource)
    if slots:
        devices = _devices_per_process(settings, profile)
        return Machine.from_profile(
            profile, cpu_threads=max(cpu_task_threads(workers or [], settings.resource), 1),
            gpus=sum(min(devices, max(int(units), 1)) for units, _ in slots),
            name="the cluster's workers")
    return Machine.from_profile(profile, gpus=max(int(profile.gpu.count), 1))


def _gpu_tasks_per_device(settings: Settings, profile: Profile) -> int:
    """How many GPU tasks may run on one device at once where this graph runs (each needs its
    working set there at the same time).

    A local threaded scheduler: its threads over the devices a process drives; the processes
    scheduler: every pool process, each on its one device. A graph the pass plans on a
    scheduler: for each GPU worker the tasks its resource lets run at once (its units of
    ``eugo.resource``, at most its threads) over the GPUs a process drives, the most of any
    worker. Where none of these is known (a client planning for a cluster it cannot see): 1.
    The devices a process drives are what this process's config says (``eugo.gpus-per-process``,
    ``eugo.emulated.devices``), which a cluster's workers are assumed to share."""
    devices = _devices_per_process(settings, profile)
    if current_submission() is not None:
        slots = gpu_task_slots(scheduler_workers(running_scheduler()), settings.resource)
        return max((math.ceil(min(units, threads) / min(devices, max(int(units), 1)))
                    for units, threads in slots), default=1)
    local = local_scheduler()
    if local is None:
        return 1
    kind, workers = local
    return max(math.ceil(workers / (devices if kind == "threads" else 1)), 1)


def _read_window(settings: Settings) -> tuple[int, int] | None:
    """How many reads may run ahead of the device tasks consuming their blocks
    (:mod:`eugo_dask.pace`), and how many device tasks' copies to the device may run ahead of
    the device (:func:`~eugo_dask.pace.copies_ahead`, :meth:`~eugo_dask.gates.Gates.pace`);
    None where neither is paced.

    Paced only on a distributed scheduler with GPU workers (a local scheduler's pool is the
    bound) and with ``eugo.read-ahead`` not null: the reads the workers take at once under
    distributed's queuing (:func:`~eugo_dask.context.read_slots`), so the CPU threads keep
    reading, plus ``eugo.read-ahead`` blocks for each GPU slot (a kernel per unit of the
    resource, at most the worker's threads), so the device never waits for a read; the copies
    of ``eugo.read-ahead`` device tasks per GPU slot beyond the one each slot runs."""
    if settings.read_ahead is None or current_submission() is None:
        return None
    scheduler = running_scheduler()
    slots = sum(min(int(units), threads)
                for units, threads in gpu_task_slots(scheduler_workers(scheduler),
                                                     settings.resource))
    if not slots:
        return None
    return (read_slots(scheduler) + settings.read_ahead * slots,
            copies_ahead(settings.read_ahead, slots))


def _devices_per_process(settings: Settings, profile: Profile) -> int:
    """The devices one process drives under this process's config."""
    try:
        if settings.device == "emulated":
            return emulated_device_count()
        every_gpu = device_settings().gpus == "all"
    except ValueError:  # the device path says what is wrong
        return 1
    return max(int(profile.gpu.count), 1) if every_gpu else 1


def _cold_start(device: str | None, profile: Profile) -> ColdStart | None:
    """What starting ``device`` would cost a graph computed from this process (the profile's
    measured first-use costs; presets have none), or None where nothing is to pay.

    The local threaded and synchronous schedulers run device work in this process: its first
    use (context, module load, first kernel compile) until it is paid (for CuPy, the probe
    that resolving the device runs pays it), and each thread's setup until tasks have run
    here (the scheduler's thread pool lives on). The processes scheduler's pool processes each
    start their own. A graph submitted to a cluster runs on workers that start their device
    once in their life: none, as for a graph explained while a distributed client is the
    default scheduler."""
    gpu = profile.gpu
    first_use, thread_setup = gpu.first_use_s or 0.0, gpu.thread_setup_s or 0.0
    if device is None or current_submission() is not None or not (first_use or thread_setup):
        return None
    local = local_scheduler()
    if local is None:
        return None
    kind, workers = local
    if kind == "processes":
        return ColdStart(0.0, first_use + thread_setup, workers)
    if device_started(device):
        return None
    return ColdStart(0.0 if device_first_use_paid(device) else first_use, thread_setup, workers)


def _profile(settings: Settings) -> Profile:
    """The profile ``settings`` name, loaded (a bad one raises :class:`ProfileError`)."""
    return load_profile(resolve_profile(settings.profile, settings.device))


def _split_and_describe(graph: dict[Key, GraphNode], keys: Key | NestedKeys, chunks: ChunkInfo,
                        settings: Settings, profile: Profile) -> _Described:
    """The pass's first steps on ``graph`` (task-spec nodes already optimized by Dask): split
    fused tasks that mix device and host work, then describe every task."""
    graph = split_mixed_tasks(graph, chunks)
    history = get_history(settings.history) if settings.learn else None
    return _Described(graph, keys, describe_graph(graph, chunks, profile, history), profile)


def _expect_timings(plan: Plan, settings: Settings, executed: dict[Key, Key]) -> None:
    """With eugo.learn on: have the tasks of ``plan`` timed when they run (under the keys
    they run as, ``executed``)."""
    history = get_history(settings.history)
    ensure_local_timing(history)
    expect({executed.get(d.key, d.key): (d.op, d.device, d.bytes, history) for d in plan})


def _token(settings: Settings, profile: Profile, machine: Machine | None = None) -> str:
    """Eight hex digits naming everything a plan depends on besides the graph itself: the
    settings, the profile, with learning on the learned durations, and under
    ``eugo.dispatch: balanced`` the ``machine`` it was placed for. They go into every key eugo
    writes or renames, so a key means one thing whoever computes it."""
    learned = get_history(settings.history).digest() if settings.learn else None
    if machine is not None:  # (the machine's shape: what the placement reads of it)
        learned = f"{learned}/{machine.cpu_threads}c+{machine.gpus}g"
    # the same settings and profile on every pass: tokenizing a profile costs more than
    # describing a small graph. The settings' repr tells apart what tokenize tells apart
    # (2 from 2.0 and from numpy's 2.0); the profile object is kept with its token
    # (load_profile hands out one object per profile and file version), so its id cannot
    # stand for another one.
    key = (repr(vars(settings)), id(profile), learned)
    known = _tokens.get(key)
    if known is not None and known[0] is profile:
        return known[1]
    token = tokenize(settings.to_dict(), profile, learned, __version__)[:8]
    if len(_tokens) >= 64:
        _tokens.clear()
    _tokens[key] = (profile, token)
    return token


_tokens: dict[tuple[str, int, str | None], tuple[Profile, str]] = {}


def _user_annotations(dsk: Any) -> dict[str, dict[Key, Any]]:
    """Per-key annotations the user put on a HighLevelGraph's layers (Dask's fusion drops
    them, but ``optimization.fuse.active: False`` keeps them), to be carried to the tasks eugo
    writes in their place."""
    carried: dict[str, dict[Key, Any]] = {}
    for layer in getattr(dsk, "layers", {}).values():
        for kind, value in (getattr(layer, "annotations", None) or {}).items():
            by_key = carried.setdefault(kind, {})
            for key in layer:
                by_key[key] = value(key) if callable(value) else value
    return carried


def eugo(dsk: Any, keys: Key | NestedKeys, *, chunk_info: ChunkInfo | None = None, **kwargs: Any) -> Any:
    """Place the chunk tasks of an array graph on the GPU where it pays, and rewrite the graph.

    Use it as ``dask.config.set(optimizations=[eugo])``, or directly as a graph pass.

    Parameters
    ----------
    dsk
        A graph: a HighLevelGraph or a mapping of keys to tasks.
    keys
        Its output keys; they hold NumPy in the rewritten graph as in the original.
    chunk_info
        Chunk shapes and dtypes per key, read from the collection's HighLevelGraph before Dask's
        optimization dropped them. Read from ``dsk`` itself when it is a HighLevelGraph.

    Returns
    -------
    The graph unchanged where no device is usable (``eugo.device``) or nothing pays; otherwise a
    HighLevelGraph whose GPU and transfer tasks carry a ``resources`` annotation.
    """
    # bad settings raise: the user must hear of them
    settings = _current_settings()
    if settings.device == "none":
        return dsk
    profile = _profile(settings)
    try:
        chunks = ChunkInfo.from_graph(dsk)
        if chunk_info is not None:
            chunks = chunk_info.merge(chunks)
        graph = task_spec_dict(dsk)
        if may_be_ours([graph]):
            # Already placed (dask.optimize() ran the pass, then compute ran it again): keep the
            # placement, restore the annotations Dask's fusion dropped.
            return annotated_graph(graph, roles_of_rewritten(graph, _resource_asked(settings)))
        with _gc_paused():
            out = _plan_and_rewrite(dsk, graph, keys, chunks, settings, profile)
    except Exception:
        # placement is a performance decision: a failure to make one runs the graph unchanged
        if record_failure():
            logger.exception("eugo: the pass failed; this graph runs unchanged on the CPU "
                             "(later failures are counted, not logged)")
        return dsk
    record_outcome(rewritten=out is not dsk)
    return out


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates an object or two per task and frees none of them in cycles; the
    cyclic collector's passes over a growing heap only cost time (16% at 150k tasks).

    Re-enabled as it was, the collector would at once traverse every object allocated meanwhile
    (8% of the pass at 90k tasks): they are the new graph's, which lives as long as the
    computation does. They join the oldest generation instead (``gc.freeze`` then
    ``gc.unfreeze``: two list moves), as if they had survived the young collections, and are
    looked at by the next full collection. The young generations are collected before the pass
    (milliseconds), so that only its objects move, not garbage made before it. Not where the
    process froze objects of its own (``gc.get_freeze_count()``): unfreezing would hand those
    back to the collector."""
    enabled = gc.isenabled()
    if enabled and not gc.get_freeze_count():
        gc.collect(1)  # the young garbage of before the pass is not the graph's: not moved
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _plan_and_rewrite(dsk: Any, graph: dict[Key, GraphNode], keys: Key | NestedKeys, chunks: ChunkInfo,
                      settings: Settings, profile: Profile) -> Any:
    """split -> describe -> place -> rewrite; ``dsk`` itself where nothing goes to the GPU."""
    original = graph
    described = _split_and_describe(graph, keys, chunks, settings, profile)
    resource = _resource_asked(settings)
    if resource is not None and settings.dispatch == "dual":
        # no eugo plugin here to place dual tasks as they become ready: they would all run
        # their CPU path, as the static plan places them
        settings = Settings(**{**settings.to_dict(), "dispatch": "static"})
    # (balanced: placed for the machine it runs on, which names its keys as the settings do)
    machine = _machine(settings, profile) if settings.dispatch == "balanced" else None
    plan = described.place(settings, machine=machine)
    gpu_keys = plan.gpu_keys  # (a pass over every decision: once)
    dual_keys = plan.dual_keys
    graph = described.graph
    plan_id = record_plan({
        "time": time.time(), "profile": plan.profile_name, "tasks": len(plan),
        "gpu_tasks": len(gpu_keys), "dual_tasks": len(dual_keys),
        **{k: plan.totals[k] for k in ("all_cpu", "all_gpu", "as_chosen")},
        # the work, for the bound on the machine it runs on (the scheduler plugin's)
        "work": work_groups(described.description, profile.cpu.threads)})
    if not gpu_keys and not dual_keys:
        if settings.learn:
            _expect_timings(plan, settings, {})
        return dsk
    logger.debug("eugo: %d of %d tasks on the GPU", len(gpu_keys), len(plan))
    submission = current_submission()
    # planned for a local scheduler, the tasks carry the settings: a processes scheduler's pool
    # processes have Dask's defaults (a cluster's workers use their own)
    device = settings.device if submission else PlannedDevice.here(settings.device)
    windows = _read_window(settings)
    # where eugo's plugin runs it paces reads and copies on the scheduler (eugo_dask.gates);
    # elsewhere the graph paces its reads with tokens (eugo_dask.pace)
    on_scheduler = windows is not None and resource is None
    how = Rewrite(device, resource, _token(settings, profile, machine),
                  _user_annotations(dsk),
                  dict(submission.annotations.get("resources") or {}) if submission else {},
                  plan_id, settings.resource,
                  windows[0] if windows is not None and not on_scheduler else None,
                  windows if on_scheduler else None)
    rewritten = rewrite_graph(graph, plan, described.description, original,
                              flatten_keys(keys), how)
    if settings.learn:
        _expect_timings(plan, settings, rewritten.executed)
    return rewritten.graph


eugo._eugo_pass = True  # type: ignore[attr-defined]


def _is_array_expression(collection: Any) -> bool:
    from dask._expr import Expr

    return isinstance(getattr(collection, "expr", None), Expr)


def explain(*collections: Any, machine: Machine | None = None, **settings: Any) -> Plan:
    """The placement eugo would make for the tasks of ``collections``, with reasons and
    estimates.

    Several collections are planned as ``dask.compute(*collections)`` runs them: as one graph
    (their graphs merged, each one's keys an output), where the tasks they share run once and a
    chunk copied to the device serves every consumer. ``explain(x)`` plans ``x`` alone.

    Works without a GPU: with ``eugo.device`` ``none`` or ``auto`` on a machine without one, the
    plan shows what would go where under ``eugo.profile`` (the graph itself would run unchanged).
    Array expressions (``array.query-planning: True``) are planned as their optimized
    expression's graph, which is what eugo rewrites there (:mod:`eugo_dask.array_expressions`);
    on a Dask outside the versions that hook was tested with, the plan shows what eugo would do
    with device ``none``.

    Parameters
    ----------
    *collections
        Dask arrays (or any collections with an array graph).
    machine
        The machine to hold the plan against (:class:`~eugo_dask.schedule.Machine`: CPU
        threads, GPUs, links): its predicted makespan and lower bound, and under
        ``eugo.dispatch: balanced`` the split that places the layers. None: the machine the
        graph would run on: where ``compute`` would run on a distributed client's cluster with
        GPU workers, its threads and devices as the scheduler plans for them
        (:func:`_machine`); elsewhere the profile's machine (its threads and GPUs).
    **settings
        ``eugo.*`` settings for this call, with underscores: ``min_speedup=0``,
        ``profile="t4"``, ``device="emulated"``.

    Returns
    -------
    Plan
        Iterate for one record per task; ``print`` for a table by task prefix; ``to_json()``;
        ``totals`` holds the what-if task-seconds all-CPU, all-GPU and as chosen.
    """
    if not collections:
        raise TypeError("explain() takes a Dask collection with an array graph (a dask.array "
                        "Array), or several as dask.compute takes them; got none")
    for collection in collections:
        if not (is_dask_collection(collection) and hasattr(collection, "__dask_keys__")):
            raise TypeError("explain() takes a Dask collection with an array graph (a dask.array "
                            f"Array); got {type(collection).__name__}")
    overrides = keyword_settings(settings, "explain()")
    with dask.config.set(overrides):
        current = read_settings()
        device = current.device
        if device in ("auto", "cupy"):
            device = current.resolved().device
        current = Settings(**{**current.to_dict(), "device": device})
    if any(map(_is_array_expression, collections)):
        # the optimized expression's graph, as Dask left it (it fuses nothing at this level)
        graph, keys, chunks = expression_graph(collections)
        optimized = task_spec_dict(graph)
        if not hook_installed():  # what eugo would do; the graph itself runs unchanged
            current = Settings(**{**current.to_dict(), "device": "none"})
    else:
        graph, keys = _joint_graph(collections)
        chunks = ChunkInfo.from_graph(graph)
        optimized = task_spec_dict(dask_array_optimize(graph, keys))
    described = _split_and_describe(optimized, keys, chunks, current, _profile(current))
    if machine is not None and not isinstance(machine, Machine):
        raise TypeError("explain()'s machine must be an eugo_dask.schedule.Machine; got "
                        f"{type(machine).__name__}")
    if machine is None:
        workers = client_workers()
        if workers:
            machine = _machine(current, described.profile, workers)
    plan = described.place(current, machine=machine)
    all_gpu = described.place(Settings(**{**current.to_dict(), "min_speedup": 0.0}))
    plan.totals["all_gpu"] = all_gpu.totals["as_chosen"]
    plan.schedule = summarize(described.graph, keys, described.description, plan,
                              described.profile, machine=machine,
                              read_ahead=current.read_ahead)
    return plan


def _joint_graph(collections: tuple[Any, ...]) -> tuple[Any, Any]:
    """The graph and output keys ``dask.compute(*collections)`` optimizes: one collection's
    own, or their HighLevelGraphs merged with a list of each one's keys (what Dask hands the
    array optimizer for several arrays)."""
    if len(collections) == 1:
        return collections[0].__dask_graph__(), collections[0].__dask_keys__()
    graphs = [c.__dask_graph__() for c in collections]
    return HighLevelGraph.merge(*graphs), [c.__dask_keys__() for c in collections]
