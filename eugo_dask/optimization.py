"""The ``eugo`` graph pass, the bridge that makes ``dask.config.set(optimizations=[eugo])`` work
on Dask 2026.8, and :func:`explain`.

Dask stopped reading the ``optimizations`` config key in 2025.4. What it still honours is the
``array_optimize`` key: the value stored there replaces the array optimizer
(``Array.__dask_optimize__`` is a ``globalmethod``). ``import eugo_dask`` registers
:data:`bridge` there as a *default*; it runs Dask's own array optimization and then every pass
in the ``optimizations`` list, so with the list empty nothing changes.

With distributed, the graph is optimized on the scheduler, whose config is not the client's. The
bridge is pickled with the graph on the client, and pickling freezes the client's
``optimizations`` list and its validated ``eugo.*`` settings (device and profile resolved on the
client); the scheduler runs exactly those.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import json
import logging
import pickle
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import dask
from dask._task_spec import Alias, GraphNode
from dask.array.optimization import optimize as dask_array_optimize
from dask.base import is_dask_collection, tokenize
from dask.highlevelgraph import HighLevelGraph

from eugo_dask._version import __version__
from eugo_dask.config import (
    Settings,
    cluster_profile,
    history_path,
    keyword_settings,
    read_settings,
    resolve_profile,
)
from eugo_dask.describe import GraphDescription, describe_graph
from eugo_dask.graph import (
    EUGO_PREFIXES,
    ChunkInfo,
    Key,
    flatten_keys,
    materialized_layers,
    optimize_without_linear_fusion,
    task_spec_dict,
)
from eugo_dask.history import ensure_local_timing, expect, get_history
from eugo_dask.plan import ColdStart, Plan, place
from eugo_dask.profile import Profile, load_profile
from eugo_dask.rewrite import (
    Rewrite,
    annotated_graph,
    rewrite_graph,
    roles_of_rewritten,
    written_by_eugo,
)
from eugo_dask.runtime import EVENT_TOPIC, PlannedDevice, device_first_use_paid, device_started
from eugo_dask.schedule import summarize
from eugo_dask.unfuse import split_mixed_tasks
from eugo_dask.worker import running_schedulers

logger = logging.getLogger(__name__)

#: What-if totals of the plans made in this process, newest last (the dashboard shows them).
recent_plans: deque[dict[str, Any]] = deque(maxlen=100)

class Submission(NamedTuple):
    """What the client froze when it submitted a graph: its validated ``eugo.*`` settings and
    the annotations in force (``dask.annotate`` around ``compute``), which the scheduler applies
    to every task and eugo merges into the resources its GPU tasks ask for."""

    settings: Settings
    annotations: dict[str, Any]


# What the client froze at submission, in force while the scheduler runs the passes.
_submitted: contextvars.ContextVar[Submission | None] = contextvars.ContextVar(
    "eugo_submission", default=None
)


def _current_settings() -> Settings:
    submission = _submitted.get()
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
    scheduler = _running_scheduler()
    if scheduler is None:
        return frozen.resolved()
    workers = list(scheduler.workers.values())
    if not any(ws.resources.get(frozen.resource) for ws in workers):
        if frozen.device != "none":
            # a resource request nothing can satisfy would wait forever in no-worker
            advertised = sorted({r for ws in workers for r in ws.resources})
            # a cluster without GPU workers is no mistake (unsupported work stays on the CPU
            # silently); workers that advertise other resources suggest a misspelt one, which
            # the client hears of too
            _tell_scheduler(scheduler, (
                f"eugo: no worker advertises the resource {frozen.resource!r} (workers "
                f"advertise: {advertised or 'none'}); this graph runs unchanged on the CPU"),
                client=bool(advertised))
        return Settings(**{**frozen.to_dict(), "device": "none"})
    return frozen.resolved(gpu_workers=True)


def _running_scheduler() -> Any:
    """The distributed scheduler this pass runs in, or None (a client, a local scheduler, or
    several schedulers in one process of which none is receiving a graph)."""
    candidates = running_schedulers()
    if len(candidates) > 1:  # several in one process (tests): the one receiving a graph
        candidates = [s for s in candidates if getattr(s, "_active_graph_updates", 0)]
    return candidates[0] if len(candidates) == 1 else None


def _resource_asked(settings: Settings) -> str | None:
    """The resource the pass asks for on each device task (``eugo.resource``), or None where
    the scheduler it runs in has eugo's plugin for that resource: the plugin asks for it after
    the scheduler applied the restrictions the user gave the whole submission
    (``client.compute(..., resources=..., workers=...)``, which the pass does not see), where a
    per-key ``resources`` annotation would replace the user's."""
    scheduler = _running_scheduler()
    plugin = scheduler.plugins.get("eugo") if scheduler is not None else None  # (its name)
    return None if getattr(plugin, "resource", None) == settings.resource else settings.resource


def _tell_scheduler(scheduler: Any, warning: str, *, client: bool) -> None:
    """Log a warning and hand it to the scheduler's event log (the eugo plugin shows it), from
    the thread Dask materializes graphs in; with ``client``, to the clients too (distributed's
    "warn" topic, which ``worker.warn`` uses: a client shows it as a ``RuntimeWarning``)."""
    logger.warning(warning)
    scheduler.loop.add_callback(scheduler.log_event, EVENT_TOPIC, {"warning": warning})
    if client:
        scheduler.loop.add_callback(scheduler.log_event, "warn", {
            "message": pickle.dumps(warning), "category": pickle.dumps(RuntimeWarning)})


def _may_be_ours(layers: Iterable[Mapping[Key, Any]]) -> bool:
    """Whether a graph (``layers``: its materialized layers) holds tasks eugo wrote: it was
    optimized with eugo before (``dask.optimize``, then ``compute``).

    Told by what a task is (:func:`~eugo_dask.rewrite.written_by_eugo`: its function), not by
    its name, which anyone can choose (``teugo-gpu-survey``). One task per layer name is looked
    at (a layer's tasks share their function), and only under names that carry one of eugo's
    key prefixes (as the names Dask's fusion makes from eugo's keys do too): on other graphs,
    the work per task is collecting layer names."""
    for mapping in layers:
        names = {key[0] if type(key) is tuple else key for key in mapping}
        candidates = {name for name in names
                      if isinstance(name, str) and any(p in name for p in EUGO_PREFIXES)}
        if not candidates:  # (the common case: no such name)
            continue
        for key in mapping:  # a task of each candidate's
            name = key[0] if type(key) is tuple else key
            if name in candidates:
                if written_by_eugo(_resolved(mapping, key)):
                    return True
                candidates.discard(name)
                if not candidates:
                    break
    return False




def _resolved(mapping: Mapping[Key, Any], key: Key) -> Any:
    """The node of ``key``, or where it is an alias (Dask's fusion leaves one under each key
    it renamed) the node it stands for, within ``mapping``."""
    node = mapping[key]
    for _ in range(len(mapping)):
        if not isinstance(node, Alias) or node.target not in mapping:
            break
        node = mapping[node.target]
    return node


def _device_memory_bytes(settings: Settings, device: str, profile_memory: float) -> float:
    limit = profile_memory
    if device == "emulated":
        limit = min(limit, settings.emulated_memory_limit)
    return limit * settings.device_memory_fraction


class _Described(NamedTuple):
    """A graph split and described, ready to be placed (under one or several settings)."""

    graph: dict[Key, GraphNode]
    keys: Any
    description: GraphDescription
    profile: Profile

    def place(self, settings: Settings) -> Plan:
        device = None if settings.device == "none" else settings.device
        return place(self.graph, self.keys, self.description, profile=self.profile,
                     min_speedup=settings.min_speedup, device=device,
                     device_memory_bytes=_device_memory_bytes(
                         settings, settings.device, self.profile.gpu.memory_bytes),
                     cold=_cold_start(device, self.profile))


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
    if device is None or _submitted.get() is not None or not (first_use or thread_setup):
        return None
    local = _local_scheduler()
    if local is None:
        return None
    kind, workers = local
    if kind == "processes":
        return ColdStart(0.0, first_use + thread_setup, workers)
    if device_started(device):
        return None
    return ColdStart(0.0 if device_first_use_paid(device) else first_use, thread_setup, workers)


def _local_scheduler() -> tuple[str, int] | None:
    """How a graph computed here runs, as dask.config says (``scheduler``, ``num_workers``, a
    default distributed client): ``("threads" or "processes", how many)``, or None for a
    distributed client or a scheduler of another kind. A ``scheduler=`` argument of
    ``compute`` is not seen by the optimization that calls this."""
    from dask import local, threaded
    from dask.base import get_scheduler
    from dask.system import CPU_COUNT

    named = dask.config.get("scheduler", None) is not None
    scheduler = get_scheduler() if named or "distributed" in sys.modules else None
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


def _profile(settings: Settings) -> Profile:
    """The profile ``settings`` name, loaded (a bad one raises :class:`ProfileError`)."""
    return load_profile(resolve_profile(settings.profile, settings.device))


def _split_and_describe(graph: dict[Key, GraphNode], keys: Any, chunks: ChunkInfo,
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


def _token(settings: Settings, profile: Profile) -> str:
    """Eight hex digits naming everything a plan depends on besides the graph itself: the
    settings, the profile and, with learning on, the learned durations. They go into every key
    eugo writes or renames, so a key means one thing whoever computes it."""
    learned = get_history(settings.history).digest() if settings.learn else None
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


def eugo(dsk: Any, keys: Any, *, chunk_info: ChunkInfo | None = None, **kwargs: Any) -> Any:
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
        if _may_be_ours([graph]):
            # Already placed (dask.optimize() ran the pass, then compute ran it again): keep the
            # placement, restore the annotations Dask's fusion dropped.
            return annotated_graph(graph, roles_of_rewritten(graph, _resource_asked(settings)))
        with _gc_paused():
            out = _plan_and_rewrite(dsk, graph, keys, chunks, settings, profile)
    except Exception:
        # placement is a performance decision: a failure to make one runs the graph unchanged
        _pass_stats["pass_errors"] += 1
        if not _pass_stats["errors_logged"]:
            logger.exception("eugo: the pass failed; this graph runs unchanged on the CPU "
                             "(later failures are counted, not logged)")
        _pass_stats["errors_logged"] += 1
        return dsk
    _pass_stats["graphs_planned"] += 1
    if out is not dsk:
        _pass_stats["graphs_rewritten"] += 1
    return out


_pass_stats = {"graphs_planned": 0, "graphs_rewritten": 0, "pass_errors": 0, "errors_logged": 0}


def pass_stats() -> dict[str, int]:
    """Counters of the pass in this process: graphs planned, graphs rewritten, and failures
    of the pass (each of which ran its graph unchanged)."""
    return {k: v for k, v in _pass_stats.items() if k != "errors_logged"}


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


def _plan_and_rewrite(dsk: Any, graph: dict[Key, GraphNode], keys: Any, chunks: ChunkInfo,
                      settings: Settings, profile: Profile) -> Any:
    """split -> describe -> place -> rewrite; ``dsk`` itself where nothing goes to the GPU."""
    original = graph
    described = _split_and_describe(graph, keys, chunks, settings, profile)
    plan = described.place(settings)
    gpu_keys = plan.gpu_keys  # (a pass over every decision: once)
    graph = described.graph
    recent_plans.append({"time": time.time(), "profile": plan.profile_name,
                         "tasks": len(plan), "gpu_tasks": len(gpu_keys),
                         **{k: plan.totals[k] for k in ("all_cpu", "all_gpu", "as_chosen")}})
    if not gpu_keys:
        if settings.learn:
            _expect_timings(plan, settings, {})
        return dsk
    logger.debug("eugo: %d of %d tasks on the GPU", len(gpu_keys), len(plan))
    submission = _submitted.get()
    # planned for a local scheduler, the tasks carry the settings: a processes scheduler's pool
    # processes have Dask's defaults (a cluster's workers use their own)
    device = settings.device if submission else PlannedDevice.here(settings.device)
    how = Rewrite(device, _resource_asked(settings), _token(settings, profile),
                  _user_annotations(dsk),
                  dict(submission.annotations.get("resources") or {}) if submission else {})
    rewritten = rewrite_graph(graph, plan, described.description, original,
                              flatten_keys(keys), how)
    if settings.learn:
        _expect_timings(plan, settings, rewritten.executed)
    return rewritten.graph


eugo._eugo_pass = True  # type: ignore[attr-defined]


def _is_eugo_pass(opt: Callable[..., Any]) -> bool:
    return getattr(opt, "_eugo_pass", False)


def run_optimizations(
    dsk: Any, keys: Any, passes: tuple[Callable[..., Any], ...], submission: Submission | None,
    **kwargs: Any,
) -> Any:
    """Dask's array optimization, then each of ``passes`` in order."""
    chunk_info = ChunkInfo.from_graph(dsk) if any(map(_is_eugo_pass, passes)) else None
    if chunk_info is not None and _may_be_ours(materialized_layers(dsk)):
        # optimized with eugo before (dask.optimize, then compute): Dask's linear fusion would
        # glue eugo's copies to the reads and host tasks beside them; blockwise fusion of the
        # layers added since and culling still run
        dsk = optimize_without_linear_fusion(dsk, keys)
    else:
        dsk = dask_array_optimize(dsk, keys, **kwargs)
    token = _submitted.set(submission)
    try:
        for opt in passes:
            dsk = opt(dsk, keys, chunk_info=chunk_info) if _is_eugo_pass(opt) else opt(dsk, keys)
    finally:
        _submitted.reset(token)
    return dsk


def _configured_passes() -> tuple[Callable[..., Any], ...]:
    passes = dask.config.get("optimizations", None) or ()
    if callable(passes):
        passes = (passes,)
    passes = tuple(passes)
    for opt in passes:
        if not callable(opt):
            raise TypeError(f"optimizations must be a list of graph passes f(dsk, keys); got {opt!r}")
    return passes


class OptimizationsBridge:
    """Dask's array optimizer plus the ``optimizations`` config list, read when called.

    Pickling (a graph submitted to a distributed scheduler) freezes the list and the ``eugo.*``
    settings in force at that moment into a :class:`SubmittedOptimizations`. Copying it (as
    ``copy.deepcopy(dask.config.config)`` does, in ``distributed.utils_test`` and in apps that
    save and restore their settings) gives the live bridge back: a copy of the config keeps
    reading the settings in force, whatever they were when it was copied.
    """

    def __call__(self, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        passes = _configured_passes()
        return run_optimizations(dsk, keys, passes, None, **kwargs)

    def __bool__(self) -> bool:
        # Dask asks whether the configured optimizer is set (``GlobalMethod.__get__``) when a
        # collection is turned into a graph on the client, before anything is submitted:
        # the one moment a bad setting can be reported as itself, naming its key, rather than
        # from inside the serialization of the graph.
        passes = _configured_passes()
        if any(map(_is_eugo_pass, passes)):
            read_settings()
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        passes = _configured_passes()
        # validated now (errors reach the user), resolved where the plan is made: "auto"
        # means the cluster's devices, not this client's
        settings = read_settings() if any(map(_is_eugo_pass, passes)) else None
        return (SubmittedOptimizations, (passes, settings, dict(dask.get_annotations())))

    def __copy__(self) -> OptimizationsBridge:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizationsBridge:
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is OptimizationsBridge

    def __hash__(self) -> int:
        return hash(OptimizationsBridge)

    def __repr__(self) -> str:
        return "eugo_dask.bridge"


class SubmittedOptimizations:
    """The client's ``optimizations``, ``eugo.*`` settings and annotations as they were at
    submission."""

    def __init__(self, passes: tuple[Callable[..., Any], ...], settings: Settings | None,
                 annotations: dict[str, Any] | None = None) -> None:
        self.passes = tuple(passes)
        self.settings = settings
        self.annotations = annotations or {}

    def __call__(self, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        submission = Submission(self.settings, self.annotations) if self.settings else None
        return run_optimizations(dsk, keys, self.passes, submission, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SubmittedOptimizations, (self.passes, self.settings, self.annotations))

    def _identity(self) -> tuple[Any, ...]:
        settings = (json.dumps(self.settings.to_dict(), sort_keys=True, default=str)
                    if self.settings else None)
        return (tuple(map(id, self.passes)), settings,
                json.dumps(self.annotations, sort_keys=True, default=str))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SubmittedOptimizations) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())


#: The object ``import eugo_dask`` registers as Dask's ``array_optimize``.
bridge = OptimizationsBridge()


def install_bridge() -> None:
    dask.config.update_defaults({"array_optimize": bridge})


def _is_array_expression(collection: Any) -> bool:
    from dask._expr import Expr

    return isinstance(getattr(collection, "expr", None), Expr)


_ARRAY_EXPRESSIONS_OFF = (
    "eugo-dask: dask.array runs in array-expression mode (array.query-planning: True), where "
    "Dask 2026.8 applies no graph optimizer that eugo could hook into: with "
    "optimizations=[eugo] these graphs run unchanged on the CPU. eugo_dask.explain() still "
    "shows what eugo would do; set array.query-planning: False (the default) before importing "
    "dask.array to use it.")


def warn_if_array_expressions() -> bool:
    """Warn, once per process, where dask.array runs in array-expression mode (eugo cannot
    place those graphs). Returns whether it warned."""
    import dask.array as da

    enabled = getattr(da, "_array_expr_enabled", lambda: False)
    if not enabled():
        return False
    warnings.warn(_ARRAY_EXPRESSIONS_OFF, RuntimeWarning, stacklevel=3)
    return True


def explain(*collections: Any, **settings: Any) -> Plan:
    """The placement eugo would make for the tasks of ``collections``, with reasons and
    estimates.

    Several collections are planned as ``dask.compute(*collections)`` runs them: as one graph
    (their graphs merged, each one's keys an output), where the tasks they share run once and a
    chunk copied to the device serves every consumer. ``explain(x)`` plans ``x`` alone.

    Works without a GPU: with ``eugo.device`` ``none`` or ``auto`` on a machine without one, the
    plan shows what would go where under ``eugo.profile`` (the graph itself would run unchanged).
    So it does for an array expression (``array.query-planning: True``), which eugo cannot
    rewrite.

    Parameters
    ----------
    *collections
        Dask arrays (or any collections with an array graph).
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
    graph, keys = _joint_graph(collections)
    if any(map(_is_array_expression, collections)):
        # what eugo would do; the graph itself runs unchanged (see module docs)
        chunks = functools.reduce(ChunkInfo.merge, [
            ChunkInfo.from_expression(c.expr) if _is_array_expression(c)
            else ChunkInfo.from_graph(c.__dask_graph__()) for c in collections])
        current = Settings(**{**current.to_dict(), "device": "none"})
    else:
        chunks = ChunkInfo.from_graph(graph)
    optimized = task_spec_dict(dask_array_optimize(graph, keys))
    described = _split_and_describe(optimized, keys, chunks, current, _profile(current))
    plan = described.place(current)
    all_gpu = described.place(Settings(**{**current.to_dict(), "min_speedup": 0.0}))
    plan.totals["all_gpu"] = all_gpu.totals["as_chosen"]
    plan.schedule = summarize(described.graph, keys, described.description, plan,
                              described.profile)
    return plan


def _joint_graph(collections: tuple[Any, ...]) -> tuple[Any, Any]:
    """The graph and output keys ``dask.compute(*collections)`` optimizes: one collection's
    own, or their HighLevelGraphs merged with a list of each one's keys (what Dask hands the
    array optimizer for several arrays)."""
    if len(collections) == 1:
        return collections[0].__dask_graph__(), collections[0].__dask_keys__()
    graphs = [c.__dask_graph__() for c in collections]
    return HighLevelGraph.merge(*graphs), [c.__dask_keys__() for c in collections]
