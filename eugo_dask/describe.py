"""What each task of a graph is and costs: op families, chunk specs, estimates.

:func:`describe_graph` walks a graph (after :mod:`eugo_dask.unfuse`) in dependency order and, for
every task eugo can reason about, infers its output chunk's shape and dtype from its inputs and
the collection's chunk annotations, and asks the cost model for an :class:`Estimate`. Work is
shared across the chunks of a layer (same functions and shapes: same estimate). With a
:class:`~eugo_dask.history.RuntimeHistory`, observed durations replace the profile's estimates.

Nothing here decides where a task runs: that is :mod:`eugo_dask.plan`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, Task

from eugo_dask.cost_model import Estimate, Op, estimate_task
from eugo_dask.graph import (
    ArraySpec,
    ChunkInfo,
    Fused,
    Graph,
    Key,
    alias_targets,
    execution_order,
    fused,
    fused_output,
    toposort,
)
from eugo_dask.history import RuntimeHistory
from eugo_dask.ops import (
    CPU,
    CREATION,
    CUMULATIVE,
    DATA,
    GPU,
    MOVEMENT,
    REDUCTION,
    classify_func,
)
from eugo_dask.profile import Profile
from eugo_dask.runtime import is_eugo_callable


def _inner_ops(inner: Mapping[Key, GraphNode], embedded: list[ArraySpec]) -> list[Op]:
    ops: list[Op] = []
    for node in execution_order(inner):
        parts = fused(node)
        if isinstance(node, DataNode):
            if isinstance(node.value, np.ndarray):
                ops.append(Op(DATA, "array"))
                embedded.append(ArraySpec(node.value.shape, node.value.dtype))
        elif parts is not None:
            ops.extend(_inner_ops(parts.inner, embedded))
        elif type(node) is Task:
            family, name = classify_func(node.func)
            ops.append(Op(family, name, max(1, len(node.dependencies))))
    return ops


def _getitem_shape(node: Task, source: ArraySpec | None) -> ArraySpec | None:
    if source is None or len(node.args) != 2 or isinstance(node.args[1], GraphNode):
        return None
    try:  # index a zero-size stand-in of the chunk: NumPy works out the result's shape
        view = np.broadcast_to(np.empty((), dtype=bool), source.shape)[node.args[1]]
    except (IndexError, TypeError, ValueError):  # an index this stand-in cannot take
        return None
    return ArraySpec(view.shape, source.dtype)


def _reduction_axes(node: Task) -> tuple[int, ...] | None:
    for container in (node.kwargs, *(a for a in node.args if isinstance(a, Mapping))):
        axis = container.get("axis") if isinstance(container, Mapping) else None
        if isinstance(axis, int):
            return (axis,)
        if isinstance(axis, tuple) and all(isinstance(a, int) for a in axis):
            return axis
    return None


def _reduced_spec(node: Task, source: ArraySpec | None, out: ArraySpec | None) -> ArraySpec | None:
    """The result of a reduction step over ``source``: one element along each reduced axis (all
    of them where the axes cannot be read), dropped unless ``keepdims``."""
    if source is None:
        return out
    axes = _reduction_axes(node)
    ndim = len(source.shape)
    reduced = set(range(ndim)) if axes is None else {a % ndim for a in axes if ndim}
    keepdims = node.kwargs.get("keepdims", True) is not False
    shape = tuple(1 if d in reduced else n for d, n in enumerate(source.shape)
                  if keepdims or d not in reduced)
    return ArraySpec(shape, out.dtype if out is not None else source.dtype)


def _is_combine_step(key: Key) -> bool:
    """Whether ``key`` belongs to the combine/aggregate layers of a Dask reduction, whose chunk
    annotations are right (unlike the chunk step's, which repeat the input's chunks)."""
    name = key[0] if type(key) is tuple else key
    return isinstance(name, str) and ("-aggregate-" in name or "-partial-" in name)


class _Structure:
    """What a task's function(s) are, independent of its chunk: shared by every chunk of a
    blockwise-fused layer (they share one inner graph)."""

    __slots__ = ("ops", "embedded", "out_node", "reduction")

    def __init__(self, node: Task, n_inputs: int) -> None:
        embedded: list[ArraySpec] = []
        parts = fused(node)
        if parts is not None:
            ops = _inner_ops(parts.inner, embedded)
        else:
            family, name = classify_func(node.func)
            ops = [Op(family, name, max(1, n_inputs))]
        self.ops = tuple(ops) or (Op(MOVEMENT, "identity"),)
        self.embedded = tuple(embedded)
        out_node = fused_output(node)
        self.out_node = out_node if type(out_node) is Task else None
        self.reduction = False
        if self.out_node is not None:
            family, name = classify_func(self.out_node.func)
            self.reduction = family == REDUCTION and name not in CUMULATIVE


def _learned(estimate: Estimate, history: RuntimeHistory) -> Estimate:
    """``estimate`` with observed medians in place of the profile's numbers, where known."""
    nbytes = estimate.in_bytes + estimate.out_bytes
    cpu = history.estimate(estimate.family, CPU, nbytes)
    gpu = history.estimate(estimate.family, GPU, nbytes) if estimate.gpu_capable else None
    if cpu is None and gpu is None:
        return estimate
    return replace(
        estimate,
        cpu_s=cpu if cpu is not None else estimate.cpu_s,
        gpu_s=gpu if gpu is not None else estimate.gpu_s,
        cpu_model_s=estimate.cpu_s if cpu is not None else None,
        gpu_model_s=estimate.gpu_s if gpu is not None else None,
    )


class TaskDescriber:
    """Estimates tasks and infers their output chunks, reusing work across the chunks of a
    layer (same functions, same shapes: same estimate)."""

    def __init__(self, chunks: ChunkInfo, profile: Profile,
                 history: RuntimeHistory | None = None) -> None:
        self.chunks, self.profile, self.history = chunks, profile, history
        self._structures: dict[tuple[int, ...], _Structure] = {}
        self._estimates: dict[tuple[Any, ...], Estimate] = {}
        self._reduced: dict[tuple[Any, ...], ArraySpec | None] = {}

    def _structure(self, node: Task, parts: Fused | None, n_inputs: int) -> _Structure:
        # Chunks of one layer share their function (or fused inner graph): describe it once.
        # The graph keeps these objects alive while we plan, so ids are not reused.
        if parts is not None:
            cache_key: tuple[int, ...] = (id(parts.inner),)
        else:
            cache_key = (id(node.func), n_inputs)
        cached = self._structures.get(cache_key)
        if cached is None:
            cached = self._structures[cache_key] = _Structure(node, n_inputs)
        return cached

    def describe(
        self, key: Key, node: Task, input_specs: list[ArraySpec | None]
    ) -> tuple[Estimate, ArraySpec | None]:
        """Estimate one task and infer its output chunk's spec."""
        chunks = self.chunks
        parts = fused(node)
        structure = self._structure(node, parts, len(input_specs))
        ops = structure.ops
        embedded = list(structure.embedded)
        known = [s for s in input_specs if s is not None]
        if parts is not None:
            # blockwise fusion keeps the output layer's name in the key; linear fusion renames
            # the key and keeps the original as the inner output key
            out = chunks.spec(parts.outkey) if type(parts.outkey) is tuple else None
            out = out or chunks.spec(key)
            if out is not None:
                # a chunk created inside a GPU task (ones, arange, random) is made on the host
                # and copied: price it like an embedded chunk of the result's size
                embedded += [out for op in ops if op.family == CREATION]
        else:
            out = chunks.spec(key)
            if out is None and ops[0].name == "getitem" and ops[0].family == MOVEMENT:
                out = _getitem_shape(node, known[0] if len(input_specs) == 1 and known else None)
        if (structure.reduction and structure.out_node is not None
                and not _is_combine_step(parts.outkey if parts is not None else key)):
            # Dask annotates a reduction's chunk step with its input's chunks
            source = out or max(known + embedded, key=lambda s: s.size, default=None)
            reduced_key = (id(structure.out_node), source, out)
            if reduced_key not in self._reduced:
                self._reduced[reduced_key] = _reduced_spec(structure.out_node, source, out)
            out = self._reduced[reduced_key]
        arrays = tuple(known + embedded)
        cache_key = (ops, arrays, out, len(known) < len(input_specs))
        estimate = self._estimates.get(cache_key)
        if estimate is None:
            estimate = estimate_task(list(ops), list(arrays), out, self.profile)
            if len(known) < len(input_specs) and estimate.gpu_capable:
                estimate = replace(estimate, gpu_capable=False, gpu_s=math.inf,
                                   why_cpu="an input chunk's size is unknown")
            if self.history is not None:
                estimate = _learned(estimate, self.history)
            self._estimates[cache_key] = estimate
        return estimate, out


@dataclass
class GraphDescription:
    """What :func:`describe_graph` found: every key in dependency order, each alias's final
    target, and the output spec and estimate of every task eugo can reason about."""

    order: list[Key]
    targets: dict[Key, Key]
    specs: dict[Key, ArraySpec | None]
    estimates: dict[Key, Estimate]

    def resolve(self, key: Key) -> Key:
        """The key an alias finally stands for (the key itself for anything else)."""
        return self.targets.get(key, key)


def describe_graph(dsk: Graph, chunks: ChunkInfo, profile: Profile,
                   history: RuntimeHistory | None = None) -> GraphDescription:
    """Describe every task of ``dsk`` (task-spec nodes, after Dask's optimization), inputs'
    specs feeding outputs'."""
    targets = alias_targets(dsk)
    resolve = targets.get  # an alias's final target, in one dict access on the hot path
    order = toposort(dsk)
    describer = TaskDescriber(chunks, profile, history)
    specs: dict[Key, ArraySpec | None] = {}
    estimates: dict[Key, Estimate] = {}
    for k in order:
        node = dsk[k]
        if isinstance(node, DataNode):
            v = node.value
            specs[k] = ArraySpec(v.shape, v.dtype) if isinstance(v, np.ndarray) else None
        elif isinstance(node, Alias):
            specs[k] = specs.get(resolve(k, k))
        elif type(node) is Task and not is_eugo_callable(node.func):
            inputs = [specs.get(resolve(d, d)) for d in node.dependencies]
            estimates[k], specs[k] = describer.describe(k, node, inputs)
        else:
            specs[k] = None
    return GraphDescription(order, targets, specs, estimates)
