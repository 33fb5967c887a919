"""Plan -> graph: GPU tasks, transfer tasks and resource annotations.

For every task the plan puts on the GPU, with key ``K`` (``("name", i, j)``):

- ``("eugo-gpu-<prefix>-name", i, j)`` runs the original function through
  :class:`~eugo_dask.runtime.DeviceCall` on device inputs and leaves its result on the device;
- each input produced on the host gets one ``("eugo-todevice-<prefix>-name", ...)`` copy task, shared by all of
  its GPU consumers;
- ``K`` itself becomes the device->host copy where an output or a CPU consumer needs NumPy, and
  disappears otherwise (its GPU consumers read the device copy).

Output keys, culling and persist keep working because every key a CPU consumer or the caller can
see still exists and still holds NumPy. GPU and transfer tasks are annotated with the worker
resource (``eugo.resource``) so a distributed scheduler can pin them; key prefixes start with
``eugo-gpu``/``eugo-todevice`` so the dashboard tells them apart.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, Task, TaskRef, _execute_subgraph
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.utils import key_split

from eugo_dask.cost_model import (
    AGGREGATE,
    GPU_FAMILIES,
    IO,
    SOURCE_FAMILIES,
    UNKNOWN,
    classify_func,
)
from eugo_dask.devices import device_dtype_ok
from eugo_dask.planner import Plan
from eugo_dask.runtime import DeviceCall, sources_on_device, to_device, to_host

#: Key prefixes of the tasks eugo adds: device compute, and host->device copies.
GPU_PREFIX, H2D_PREFIX = "eugo-gpu", "eugo-todevice"


def _alphabetic_words(name: str) -> list[str]:
    # key_split keeps only alphabetic words, and stops at an 8-letter word starting a-f (it
    # takes that for a hex token): split "chunk_sum" into "chunk", "sum"; pad such words.
    words = []
    for part in name.replace("_", "-").split("-"):
        word = "".join(filter(str.isalpha, part))
        if len(word) == 8 and word[0] in "abcdef":
            word += "s"
        if word:
            words.append(word)
    return words


@functools.lru_cache(maxsize=4096)
def _prefixed_name(name: str, prefix: str) -> str:
    return "-".join([prefix, *_alphabetic_words(key_split(name))]) + "-" + name


def prefixed_key(key: Any, prefix: str) -> Any:
    """``("chunk_sum-abc", 0, 1)`` -> ``("eugo-gpu-chunk-sum-chunk_sum-abc", 0, 1)``.

    The original name is kept whole (keys stay unique) after a copy of its task prefix in
    alphabetic words, so the dashboard's prefix (``key_split``) reads ``eugo-gpu-chunk-sum``.
    """
    if isinstance(key, tuple):
        return (_prefixed_name(str(key[0]), prefix), *key[1:])
    return _prefixed_name(str(key), prefix)


class ResourceAnnotation:
    """Per-key ``resources`` annotation: ``{resource: 1}`` for GPU keys, None for the rest
    (the scheduler ignores None)."""

    def __init__(self, keys: frozenset, resource: str) -> None:
        self.keys = keys
        self.resource = resource

    def __call__(self, key: Any) -> dict[str, int] | None:
        return {self.resource: 1} if key in self.keys else None

    def __reduce__(self):
        return (ResourceAnnotation, (self.keys, self.resource))


def annotated_graph(dsk: Mapping[Any, GraphNode], gpu_keys: frozenset, resource: str) -> HighLevelGraph:
    """One-layer HighLevelGraph whose GPU keys request ``resource``."""
    name = f"eugo-{uuid.uuid4().hex}"
    layer = MaterializedLayer(
        dict(dsk), annotations={"resources": ResourceAnnotation(gpu_keys, resource)}
    )
    return HighLevelGraph({name: layer}, {name: set()})


def is_inner_source(node: GraphNode) -> bool:
    """A node inside a fused task whose result starts on the host: an embedded chunk, or a
    creation function (ones, arange, random...)."""
    if isinstance(node, DataNode):
        value = node.value
        return isinstance(value, np.ndarray) and value.ndim > 0 and device_dtype_ok(value.dtype)
    return classify_func(node.func)[0] in SOURCE_FAMILIES


_CPU_ONLY = frozenset({AGGREGATE, IO, UNKNOWN})


def _families(node: GraphNode) -> set[str]:
    if type(node) is not Task:
        return set()
    if node.func is _execute_subgraph:
        return set().union(*map(_families, node.args[0].values()))
    return {classify_func(node.func)[0]}


def _is_linear_fusion(node: Task) -> bool:
    inkeys = node.args[2]
    return not any(isinstance(k, str) and k.startswith("__dask_blockwise__") for k in inkeys)


def split_mixed_tasks(dsk: Mapping[Any, GraphNode]) -> dict[Any, GraphNode]:
    """Undo Dask's linear fusion where it joined device work with CPU-only work (an I/O read
    before it, ``finalize`` or an aggregate after it), so each part can be placed on its own.

    The fused chain's nodes become top-level tasks again under their original keys; the fused
    key becomes an alias of the chain's last node.
    """
    out: dict[Any, GraphNode] | None = None
    for key, node in dsk.items():
        if not (type(node) is Task and node.func is _execute_subgraph and _is_linear_fusion(node)):
            continue
        families = _families(node)
        if not (families & GPU_FAMILIES and families & _CPU_ONLY):
            continue
        if out is None:
            out = dict(dsk)
        inner, top = node.args[0], node.args[1]
        out.update(inner)
        if key != top:
            out[key] = Alias(key, top)
    return dsk if out is None else out


def _substituted(arg: Any, subs: dict) -> Any:
    if type(arg) is TaskRef:
        return TaskRef(subs[arg.key]) if arg.key in subs else arg
    if isinstance(arg, GraphNode):
        return arg.substitute(subs)
    return arg


def rewrite_graph(
    dsk: Mapping[Any, GraphNode], plan: Plan, *, device: str, resource: str
) -> HighLevelGraph:
    """Apply ``plan`` to ``dsk`` (task-spec nodes): see the module docstring."""
    out = dict(dsk)
    gpu = set(plan.gpu_keys)
    aliases = {k: v.target for k, v in dsk.items() if isinstance(v, Alias)}

    def resolve(k: Any) -> Any:
        while k in aliases:
            k = aliases[k]
        return k

    annotated: set = set()
    h2d: dict[Any, Any] = {}
    inner_on_device: dict[int, dict] = {}

    def device_input(dep: Any) -> Any:
        source = resolve(dep)
        if source in gpu:
            return prefixed_key(source, GPU_PREFIX)
        if source not in h2d:
            h2d[source] = key = prefixed_key(source, H2D_PREFIX)
            out[key] = Task(key, to_device, TaskRef(source), device)
            annotated.add(key)
        return h2d[source]

    for key in plan.gpu_keys:
        node = dsk[key]
        assert type(node) is Task, node
        subs = {d: device_input(d) for d in node.dependencies}
        args = tuple(_substituted(a, subs) for a in node.args)
        kwargs = {k: _substituted(v, subs) for k, v in node.kwargs.items()}
        if node.func is _execute_subgraph:
            inner = args[0]  # shared by every chunk of a blockwise layer: rewrite it once
            if id(inner) not in inner_on_device:
                inner_on_device[id(inner)] = sources_on_device(inner, is_inner_source, device)
            args = (inner_on_device[id(inner)], *args[1:])
        device_key = prefixed_key(key, GPU_PREFIX)
        out[device_key] = Task(
            device_key, DeviceCall(node.func, device, key_split(key)), *args, **kwargs
        )
        annotated.add(device_key)
        if plan.needs_host(key):
            out[key] = Task(key, to_host, TaskRef(device_key), device)
            annotated.add(key)
        else:
            del out[key]
    # Aliases of results that stay on the device had only GPU consumers, now rewired.
    for key, target in aliases.items():
        source = resolve(target)
        if source in gpu and not plan.needs_host(source):
            del out[key]
    return annotated_graph(out, frozenset(annotated), resource)
