"""The bridge that makes ``dask.config.set(optimizations=[eugo])`` work on Dask 2026.8, and the
freezing of the client's settings when it submits a graph.

Dask stopped reading the ``optimizations`` config key in 2025.4. What it still honours is the
``array_optimize`` key (this module is named after it): the value stored there replaces the
array optimizer (``Array.__dask_optimize__`` is a ``globalmethod``). ``import eugo_dask``
registers :data:`bridge` there as a *default*; it runs Dask's own array optimization and then
every pass in the ``optimizations`` list, so with the list empty nothing changes.

With distributed, the graph is optimized on the scheduler, whose config is not the client's. The
bridge is pickled with the graph on the client, and pickling freezes the client's
``optimizations`` list and its validated ``eugo.*`` settings (device and profile resolved on the
client) into a :class:`SubmittedOptimizations`; the scheduler runs exactly those, and the pass
(:mod:`eugo_dask.optimization`) reads what was frozen with :func:`current_submission`.

A pass is eugo's where it carries ``_eugo_pass``: it is then handed the chunk shapes read before
Dask's optimization dropped them (``chunk_info=``). This module does not import the pass.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import dask
from dask._task_spec import Alias
from dask.array.optimization import optimize as dask_array_optimize

from eugo_dask.config import Settings, read_settings
from eugo_dask.graph import (
    EUGO_PREFIXES,
    ChunkInfo,
    Key,
    materialized_layers,
    optimize_without_linear_fusion,
)
from eugo_dask.rewrite import written_by_eugo


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


def current_submission() -> Submission | None:
    """What the client froze when it submitted the graph being optimized, or None where the
    graph is optimized where it was made (a local scheduler)."""
    return _submitted.get()


def may_be_ours(layers: Iterable[Mapping[Key, Any]]) -> bool:
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


def is_eugo_pass(opt: Callable[..., Any]) -> bool:
    """Whether ``opt`` is eugo's pass (it is handed chunk shapes)."""
    return getattr(opt, "_eugo_pass", False)


def run_optimizations(
    dsk: Any, keys: Any, passes: tuple[Callable[..., Any], ...], submission: Submission | None,
    **kwargs: Any,
) -> Any:
    """Dask's array optimization, then each of ``passes`` in order."""
    chunk_info = ChunkInfo.from_graph(dsk) if any(map(is_eugo_pass, passes)) else None
    if chunk_info is not None and may_be_ours(materialized_layers(dsk)):
        # optimized with eugo before (dask.optimize, then compute): Dask's linear fusion would
        # glue eugo's copies to the reads and host tasks beside them; blockwise fusion of the
        # layers added since and culling still run
        dsk = optimize_without_linear_fusion(dsk, keys)
    else:
        dsk = dask_array_optimize(dsk, keys, **kwargs)
    return run_passes(dsk, keys, passes, submission, chunk_info)


def run_passes(
    dsk: Any, keys: Any, passes: tuple[Callable[..., Any], ...], submission: Submission | None,
    chunk_info: ChunkInfo | None,
) -> Any:
    """Each of ``passes`` in order over ``dsk`` (optimized already), with what the client froze
    (``submission``) in force; eugo's pass is handed ``chunk_info``."""
    token = _submitted.set(submission)
    try:
        for opt in passes:
            dsk = opt(dsk, keys, chunk_info=chunk_info) if is_eugo_pass(opt) else opt(dsk, keys)
    finally:
        _submitted.reset(token)
    return dsk


def configured_passes() -> tuple[Callable[..., Any], ...]:
    """The ``optimizations`` config list in force, checked."""
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
        passes = configured_passes()
        return run_optimizations(dsk, keys, passes, None, **kwargs)

    def run_passes(self, dsk: Any, keys: Any, chunk_info: ChunkInfo) -> Any:
        """The ``optimizations`` list over a graph Dask optimized already (an array
        expression's: :mod:`eugo_dask.array_expressions`)."""
        return run_passes(dsk, keys, configured_passes(), None, chunk_info)

    def __bool__(self) -> bool:
        # Dask asks whether the configured optimizer is set (``GlobalMethod.__get__``) when a
        # collection is turned into a graph on the client, before anything is submitted:
        # the one moment a bad setting can be reported as itself, naming its key, rather than
        # from inside the serialization of the graph.
        passes = configured_passes()
        if any(map(is_eugo_pass, passes)):
            read_settings()
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        passes = configured_passes()
        # validated now (errors reach the user), resolved where the plan is made: "auto"
        # means the cluster's devices, not this client's
        settings = read_settings() if any(map(is_eugo_pass, passes)) else None
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
        return run_optimizations(dsk, keys, self.passes, self._submission(), **kwargs)

    def run_passes(self, dsk: Any, keys: Any, chunk_info: ChunkInfo) -> Any:
        """The frozen passes over a graph Dask optimized already (an array expression's)."""
        return run_passes(dsk, keys, self.passes, self._submission(), chunk_info)

    def _submission(self) -> Submission | None:
        return Submission(self.settings, self.annotations) if self.settings else None

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

