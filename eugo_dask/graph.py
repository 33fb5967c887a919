"""The one adapter to Dask's task-spec internals: chunk specs, fused tasks, graph walks.

Dask's array optimization hands the pass a dict of ``dask._task_spec`` nodes after blockwise
fusion, culling and linear fusion. Fused work is ``Task(_execute_subgraph, inner, outkey,
inkeys, *deps)``; linear fusion renames keys and leaves ``Alias(original -> fused)``. Every
positional read of those arguments lives here (:class:`Fused`), so a change in Dask's layout is
a change in this module only.

Also here: :class:`ArraySpec` (one chunk's shape and dtype), :class:`ChunkInfo` (chunk specs per
key, read from a HighLevelGraph before Dask's optimization drops them), dependency order, alias
targets and output-key flattening.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeGuard

import numpy as np
from dask._task_spec import (
    Alias,
    GraphNode,
    Task,
    TaskRef,
    _execute_subgraph,
    _extra_args,
    convert_legacy_graph,
)
from dask.typing import Key, NestedKeys  # Key: a str, int, float or a tuple ("name", i, j, ...)
from dask.utils import ensure_dict

Graph = Mapping[Key, GraphNode]


class ArraySpec(NamedTuple):
    """Shape and dtype of one chunk (a tuple: cheap to make, hash and compare by the
    hundred thousand)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def key_name(key: Key) -> Any:
    """The layer name of a key: ``("x-abc", 0, 1)`` -> ``"x-abc"`` (``()``: itself)."""
    return key[0] if type(key) is tuple and key else key


# ---------------------------------------------------------------------------------------------
# Chunk shapes and dtypes
# ---------------------------------------------------------------------------------------------
#: Chunk types (``collection_annotations["chunk_type"]``) a device array can stand in for.
_PLAIN_CHUNK_TYPES = frozenset({"numpy.ndarray", "cupy.ndarray", "cupy._core.core.ndarray"})


def _note_chunk_type(chunk_types: dict[str, str], name: str, chunk_type: Any) -> None:
    """Keep layer ``name``'s chunk type in ``chunk_types`` where it is not a plain array."""
    if isinstance(chunk_type, str) and chunk_type not in _PLAIN_CHUNK_TYPES:
        chunk_types[name] = chunk_type


class ChunkInfo:
    """Chunk shape and dtype per key, read from a HighLevelGraph's array layers before Dask's
    optimization drops them (``layer.collection_annotations``)."""

    def __init__(self, layers: Mapping[str, tuple[tuple[tuple[float, ...], ...], np.dtype[Any]]],
                 chunk_types: Mapping[str, str] | None = None):
        self._layers = dict(layers)
        self._chunk_types = dict(chunk_types or {})
        # one object per distinct spec: the chunks of a layer share it (see describe_graph)
        self._interned: dict[ArraySpec, ArraySpec] = {}
        self._specs: dict[tuple[Any, tuple[Any, ...]], ArraySpec | None] = {}  # (layer, shape)

    @classmethod
    def from_graph(cls, graph: Any) -> ChunkInfo:
        layers = {}
        chunk_types: dict[str, str] = {}
        for name, layer in getattr(graph, "layers", {}).items():
            annotations = getattr(layer, "collection_annotations", None) or {}
            chunks, dtype = annotations.get("chunks"), annotations.get("dtype")
            if chunks is not None and dtype is not None:
                try:
                    layers[name] = (tuple(tuple(c) for c in chunks), np.dtype(dtype))
                except TypeError:
                    continue
                _note_chunk_type(chunk_types, name, annotations.get("chunk_type"))
        return cls(layers, chunk_types)

    @classmethod
    def from_expression(cls, expr: Any) -> ChunkInfo:
        """Chunk specs of an array expression's layers (``array.query-planning: True``), read
        from its lowered nodes (their ``_name``, ``chunks`` and ``dtype``, and the type of
        their ``_meta``: what legacy mode's ``chunk_type`` annotation says)."""
        from dask.utils import typename

        layers: dict[str, tuple[tuple[tuple[float, ...], ...], np.dtype[Any]]] = {}
        chunk_types: dict[str, str] = {}
        for node in expr.lower_completely().walk():
            try:
                layers[node._name] = (tuple(tuple(c) for c in node.chunks), np.dtype(node.dtype))
                meta = node._meta
            except (AttributeError, TypeError, NotImplementedError, ValueError):
                continue
            if not isinstance(meta, np.generic):  # (a 0-d reduction's: a NumPy scalar)
                _note_chunk_type(chunk_types, node._name, typename(type(meta)))
        return cls(layers, chunk_types)

    def merge(self, other: ChunkInfo) -> ChunkInfo:
        return ChunkInfo({**self._layers, **other._layers},
                         {**self._chunk_types, **other._chunk_types})

    def special_chunk_type(self, key: Key) -> str | None:
        """The chunk type of ``key``'s layer where it is not a plain array (a masked array, a
        sparse matrix: no device holds those), else None."""
        if not self._chunk_types:
            return None
        # (a layer's name, or a key of any other type: looked up as it is, found or not)
        name: Any = key[0] if type(key) is tuple else key
        return self._chunk_types.get(name)

    def block_of(self, name: str, index: tuple[slice, ...]) -> tuple[int, ...] | None:
        """Block coordinates of the chunk of layer ``name`` that ``index`` selects exactly."""
        info = self._layers.get(name)
        if info is None or len(index) != len(info[0]):
            return None
        block = []
        for dim, sl in zip(info[0], index):
            start, offset = sl.start or 0, 0.0
            for i, size in enumerate(dim):
                if offset == start and (sl.stop is None or sl.stop == offset + size) and sl.step in (None, 1):
                    block.append(i)
                    break
                offset += size
            else:
                return None
        return tuple(block)

    def spec(self, key: Key) -> ArraySpec | None:
        name: Any  # (a layer's name, or a key of any other type: looked up as it is)
        if type(key) is tuple and key:
            name = key[0]
            info = self._layers.get(name)
            index = key[1:]
        else:
            name = key
            info = self._layers.get(name)
            if info is None or any(len(c) != 1 for c in info[0]):
                return None
            index = (0,) * len(info[0])
        if info is None:
            return None
        chunks, dtype = info
        if len(index) != len(chunks):
            return None
        try:
            shape = tuple(map(operator.getitem, chunks, index))  # (once per task: no bytecode loop)
        except (IndexError, TypeError):
            return None
        try:
            return self._specs[(name, shape)]
        except KeyError:  # (once per layer and chunk shape; None too is kept)
            spec = self._specs[(name, shape)] = self._new_spec(shape, dtype)
            return spec

    def _new_spec(self, shape: tuple[Any, ...], dtype: np.dtype[Any]) -> ArraySpec | None:
        if any(type(s) is not int for s in shape):  # rare: NumPy ints, floats, NaN
            if any(isinstance(s, float) and math.isnan(s) for s in shape):
                return None  # unknown chunk sizes (boolean indexing): size unknown
            shape = tuple(int(s) for s in shape)
        spec = ArraySpec(shape, dtype)
        return self._interned.setdefault(spec, spec)


# ---------------------------------------------------------------------------------------------
# Fused tasks
# ---------------------------------------------------------------------------------------------
class Fused(NamedTuple):
    """The parts of a fused task ``Task(_execute_subgraph, inner, outkey, inkeys, *deps)``:
    ``inkeys[i]`` is the name the inner graph uses for the value of ``deps[i]``."""

    inner: dict[Key, GraphNode]
    outkey: Key
    inkeys: tuple[Key, ...]
    deps: tuple[Any, ...]

    def task(self, key: Key) -> Task:
        """A fused task from these parts."""
        return Task(key, _execute_subgraph, self.inner, self.outkey, tuple(self.inkeys),
                    *self.deps)

    @property
    def is_blockwise(self) -> bool:
        """Blockwise fusion (inputs named ``__dask_blockwise__N``), not linear fusion."""
        return any(isinstance(k, str) and k.startswith("__dask_blockwise__") for k in self.inkeys)

    def bound_inputs(self) -> dict[Key, Key]:
        """Inner input name -> the outer key it reads."""
        return {p: (d.key if type(d) is TaskRef else d) for p, d in zip(self.inkeys, self.deps)}


#: The attributes a Task holds (Dask 2026.8); where they match, :func:`new_task` fills them in
#: itself rather than have ``Task.__init__`` work the dependencies out again.
_TASK_SLOTS = ("key", "_dependencies", "func", "args", "kwargs", "_data_producer", "_token",
               "_is_coro", "_repr")


def _slots(cls: type) -> list[str]:
    return sorted(slot for base in cls.__mro__ for slot in getattr(base, "__slots__", ()))


_TASK_SLOTS_MATCH = sorted(_TASK_SLOTS) == _slots(Task)


def new_task(key: Key, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             dependencies: frozenset[Key], data_producer: bool = False) -> Task:
    """``Task(key, func, *args, _data_producer=data_producer, **kwargs)`` whose
    ``dependencies`` (the keys its arguments reference) the caller already knows: made for
    every rewritten task of graphs a million tasks large, where ``Task.__init__``'s walk over
    the arguments is a good part of the cost."""
    if not _TASK_SLOTS_MATCH:  # another Dask: its own constructor
        return Task(key, func, *args, _data_producer=data_producer, **kwargs)
    task = _new_object(Task)
    task.key, task._dependencies, task.func = key, dependencies or _NO_DEPENDENCIES, func
    task.args, task.kwargs, task._data_producer = args, kwargs, data_producer
    task._token = task._is_coro = task._repr = None
    return task



def substitute_keys(node: GraphNode, subs: Mapping[Key, Key], key: Key | None = None) -> GraphNode:
    """``node.substitute(subs, key)``: ``node`` reading ``subs[k]`` for each key ``k`` it reads
    in ``subs``. Dask types ``subs`` as a ``dict`` of keys or nodes (invariant in its values,
    so none of eugo's renames, keys to keys, is one); it takes any such mapping."""
    return node.substitute(subs, key)  # type: ignore[arg-type]

_new_object = object.__new__
#: The keyword arguments of the tasks eugo writes without any: one empty dict, shared (Dask
#: reads a task's ``kwargs`` and never changes them; a dict each was an allocation for each
#: of a million tasks).
NO_KWARGS: dict[str, Any] = {}
_NO_DEPENDENCIES = Task("eugo-no-dependencies", int).dependencies
#: For the pass's loops over every task, which read a fused task's arguments in place rather
#: than make a :class:`Fused` per task: its function, and where in ``Task.args`` its inner
#: graph, output key, input names and first dependency sit (the layout ``Fused`` names).
FUSED_FUNC = _execute_subgraph
FUSED_INNER, FUSED_OUTKEY, FUSED_INKEYS, FUSED_DEPS = 0, 1, 2, 3


def is_fused(node: GraphNode) -> bool:
    return type(node) is Task and node.func is _execute_subgraph


def fused(node: GraphNode) -> Fused | None:
    """The parts of a fused task, or None for any other node (called once per task on the
    pass's hot paths: kept to one type check and one tuple)."""
    if type(node) is not Task or node.func is not _execute_subgraph:
        return None
    args = node.args
    # tuple.__new__ directly: a NamedTuple's own __new__ is a Python function
    return _new_tuple(Fused, (args[FUSED_INNER], args[FUSED_OUTKEY], args[FUSED_INKEYS],
                              args[FUSED_DEPS:]))


_new_tuple = tuple.__new__

#: Key prefixes of the tasks eugo adds: device compute, and the copies each way.
GPU_PREFIX, H2D_PREFIX, D2H_PREFIX = "eugo-gpu", "eugo-todevice", "eugo-tohost"
#: a dual task's (``eugo.dispatch: dual``): its value is on the host wherever it ran
DUAL_PREFIX = "eugo-dual"
EUGO_PREFIXES = (GPU_PREFIX, H2D_PREFIX, D2H_PREFIX, DUAL_PREFIX)
_DEVICE_VALUE_PREFIXES = (GPU_PREFIX + "-", H2D_PREFIX + "-")


def holds_eugo_device_value(key: Key) -> bool:
    """Whether ``key`` may name one of eugo's own values that live on a device: the result of
    a device task or of a copy to the device (:func:`eugo_dask.rewrite.prefixed_key`), also
    under a name Dask's linear fusion made of it and others (``array-eugo-todevice-...``,
    where the bag and delayed optimizers fuse a rewritten graph). A user's own device arrays
    (a ``map_blocks(cupy.asarray)``) are not eugo's to move."""
    name = key[0] if isinstance(key, tuple) and key else key
    return isinstance(name, str) and any(p in name for p in _DEVICE_VALUE_PREFIXES)


def keeps_its_name(node: GraphNode) -> TypeGuard[Task]:
    """Whether ``node``'s key cannot take just any new name in the rewrite: a P2P shuffle's
    barrier (``distributed.shuffle``'s ``P2PBarrierTask``), which the shuffle's scheduler and
    worker plugins look up by the name ``shuffle-barrier-<shuffle id>`` (:func:`barrier_key`).
    Named otherwise, the shuffle fails with ``P2PConsistencyError``; a new shuffle id is the
    way to a new name (:func:`with_shuffle_id`)."""
    if type(node) is Task or not isinstance(node, Task):  # (the common case: one check)
        return False
    core = sys.modules.get("distributed.shuffle._core")  # loaded wherever a barrier exists
    barrier = getattr(core, "P2PBarrierTask", None)
    return barrier is not None and isinstance(node, barrier)


def shuffle_id_of(barrier: Task) -> str:
    """The shuffle id of a P2P barrier (its spec's)."""
    return str(barrier.spec.id)  # type: ignore[attr-defined]


def barrier_key(shuffle_id: str) -> str:
    """The key of the barrier of shuffle ``shuffle_id``, as distributed names it (its module is
    loaded wherever a barrier exists: nothing here imports distributed)."""
    return str(sys.modules["distributed.shuffle._core"].barrier_key(shuffle_id))


def with_shuffle_id(node: GraphNode, old: str, new: str) -> GraphNode:
    """``node`` as a task of shuffle ``new`` rather than ``old``: the id among its arguments
    (a transfer's, an unpack's, the barrier's, also inside a task linear fusion glued them
    into) and in a barrier's spec. Nothing else changes."""
    if type(node) is not Task and not keeps_its_name(node):
        return node

    def swap(arg: Any) -> Any:
        if type(arg) is str:
            return new if arg == old else arg
        if type(arg) is Task:  # (a shuffle's own tasks are plain; containers hold no id)
            return with_shuffle_id(arg, old, new)
        if type(arg) is dict:  # a fused task's inner graph
            return {k: swap(v) for k, v in arg.items()}
        return arg

    args = tuple([swap(a) for a in node.args])
    kwargs = {k: swap(v) for k, v in node.kwargs.items()}
    if type(node) is Task:
        return new_task(node.key, node.func, args, kwargs, node.dependencies, node.data_producer)
    names = _extra_args(type(node))  # type: ignore[arg-type]
    extras = {name: getattr(node, name) for name in names - {"key", "func"}}
    spec = extras.get("spec")
    if dataclasses.is_dataclass(spec) and getattr(spec, "id", None) == old:
        extras["spec"] = dataclasses.replace(spec, id=new)  # type: ignore[type-var]
    return type(node)(node.key, node.func, *args, **kwargs, **extras)


def fused_output(node: GraphNode) -> GraphNode | None:
    """The node that makes a (possibly nested) fused task's result; the node itself for an
    unfused task."""
    out: GraphNode | None = node
    while out is not None and (parts := fused(out)) is not None:
        out = parts.inner.get(parts.outkey)
    return out


def execution_order(inner: Mapping[Key, GraphNode]) -> list[GraphNode]:
    """The nodes of a fused task's inner graph, each after its inner dependencies."""
    order: list[GraphNode] = []
    done: set[Key] = set()
    for root in inner:
        stack = [(root, False)]
        while stack:
            key, expanded = stack.pop()
            if key in done:
                continue
            if expanded:
                done.add(key)
                order.append(inner[key])
                continue
            stack.append((key, True))
            # in a fixed order (a frozenset's order follows string hashing, which varies
            # between processes): plans and their labels are the same in every process
            deps = [d for d in inner[key].dependencies if d in inner and d not in done]
            stack.extend((d, False) for d in sorted(deps, key=repr, reverse=True))
    return order


# ---------------------------------------------------------------------------------------------
# Whole graphs
# ---------------------------------------------------------------------------------------------
def task_spec_dict(dsk: Any) -> dict[Key, GraphNode]:
    """``dsk`` (a HighLevelGraph, a dict of task-spec nodes or a legacy dict) as a dict of
    task-spec nodes."""
    graph = ensure_dict(dsk)
    if all(isinstance(v, GraphNode) for v in graph.values()):
        return graph
    return convert_legacy_graph(graph)


def optimize_without_linear_fusion(dsk: Any, keys: Key | NestedKeys) -> Any:
    """Dask's array optimization up to its linear fusion (``dask.array.optimization.optimize``
    with ``optimization.fuse.active: False``, without setting that for the whole process):
    blockwise fusion, root fusion and culling."""
    from dask.blockwise import fuse_roots, optimize_blockwise
    from dask.highlevelgraph import HighLevelGraph

    keys = list(flatten_keys(keys))
    if not isinstance(dsk, HighLevelGraph):
        dsk = HighLevelGraph.from_collections(str(id(dsk)), dsk, dependencies=())
    dsk = optimize_blockwise(dsk, keys=keys)
    dsk = fuse_roots(dsk, keys=keys)
    return dsk.cull(set(keys))


def culled(dsk: Any, keys: Key | NestedKeys) -> dict[Key, GraphNode]:
    """``dsk`` as task-spec nodes, less what ``keys`` do not need (what Dask's array optimize
    does before the pass in legacy mode; an array expression's graph comes uncalled: a slice
    of a large expression materializes every chunk)."""
    from dask._task_spec import cull

    return cull(task_spec_dict(dsk), list(flatten_keys(keys)))


def materialized_layers(dsk: Any) -> Iterator[Mapping[Key, Any]]:
    """``dsk``'s layers that are materialized already (a plain dict: itself), without
    materializing the others (a collection's new Blockwise layers)."""
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    if not isinstance(dsk, HighLevelGraph):
        yield dsk
        return
    for layer in dsk.layers.values():
        if isinstance(layer, MaterializedLayer):
            yield layer.mapping


def alias_targets(dsk: Graph) -> dict[Key, Key]:
    """Each alias key of ``dsk`` -> the key it finally stands for (chains followed)."""
    aliases = {k: v.target for k, v in dsk.items() if isinstance(v, Alias)}

    def follow(k: Key) -> Key:
        seen = 0
        while k in aliases and seen < 1000:
            k, seen = aliases[k], seen + 1
        return k

    return {a: follow(a) for a in aliases}


def dependency_order(dsk: Graph) -> list[tuple[Key, GraphNode]]:
    """Every key of ``dsk`` with its node, each after its dependencies.

    Once per key of graphs a million keys large, where a lookup in a dict that size is what
    costs. A Dask graph is layers of chunk tasks named by their layer (``("name", i, j)``), a
    layer reading others but not itself: the layers are ordered (a walk over a few dozen names)
    and each one's keys follow in the graph's order, with no lookup by key at all. Where a layer
    reads its own keys (``cumsum``'s running totals) or layers read each other, key by key."""
    by_layer = _layer_order(dsk)
    return by_layer if by_layer is not None else _key_order(dsk)


def _layer_order(dsk: Graph) -> list[tuple[Key, GraphNode]] | None:
    """:func:`dependency_order` layer by layer; None where a layer reads itself, or layers read
    each other."""
    layers: dict[Any, list[tuple[Key, GraphNode]]] = {}
    reads: dict[Any, set[Any]] = {}  # a layer -> the layers (or keys from outside) it reads
    for item in dsk.items():
        key = item[0]
        name = key[0] if type(key) is tuple and key else key  # (key_name, inline: per key)
        members = layers.get(name)
        if members is None:
            members, read = layers[name], reads[name] = [], set()
        else:
            read = reads[name]
        members.append(item)
        deps = item[1].dependencies
        if deps:
            read.update([d[0] if type(d) is tuple and d else d for d in deps])
    waiting = {}  # a layer -> how many layers it reads are not ordered yet
    readers: dict[Any, list[Any]] = {name: [] for name in layers}
    for name, read in reads.items():
        if name in read:
            return None
        inside = [r for r in read if r in layers]
        if len(inside) < len(read) and any(r in dsk for r in read if r not in layers):
            return None  # a key of the graph read as a name (a tuple of another type): key by key
        waiting[name] = len(inside)
        for r in inside:
            readers[r].append(name)
    ready = [name for name, n in waiting.items() if not n]
    order: list[tuple[Key, GraphNode]] = []
    while ready:
        name = ready.pop()
        order += layers[name]
        for reader in readers[name]:
            waiting[reader] -= 1
            if not waiting[reader]:
                ready.append(reader)
    return order if len(order) == len(dsk) else None


def _key_order(dsk: Graph) -> list[tuple[Key, GraphNode]]:
    """:func:`dependency_order` key by key (Kahn's algorithm, last ready first): one lookup
    per edge, none per key ordered (a cell ``[deps not yet ordered, key, node, dependents]``
    lists its dependents' cells)."""
    cells: dict[Key, list[Any]] = {k: [0, k, node, []] for k, node in dsk.items()}
    cell_of = cells.get
    for cell in cells.values():
        for d in cell[2].dependencies:
            dep = cell_of(d)
            if dep is not None:  # (a key from outside the graph: nothing to wait for)
                dep[3].append(cell)
                cell[0] += 1
    ready = [cell for cell in cells.values() if not cell[0]]
    order: list[tuple[Key, GraphNode]] = []
    while ready:
        cell = ready.pop()
        order.append((cell[1], cell[2]))
        for dependent in cell[3]:
            dependent[0] -= 1
            if not dependent[0]:
                ready.append(dependent)
    if len(order) != len(cells):
        raise ValueError("eugo: the graph has a cycle; it cannot be planned")
    return order


def flatten_keys(keys: Key | NestedKeys) -> set[Key]:
    """The keys of a collection's (nested lists of) output keys."""
    out: set[Key] = set()
    stack: list[Any] = [keys]
    while stack:
        k = stack.pop()
        if isinstance(k, list):
            stack.extend(k)
        else:
            out.add(k)
    return out

