"""Plan -> graph: GPU tasks, transfer tasks and resource annotations.

For every task the plan puts on the GPU, with key ``K`` (``("name", i, j)``):

- ``("eugo-gpu-<prefix>-name", i, j)`` runs the original function through
  :class:`~eugo_dask.runtime.DeviceCall` on device inputs and leaves its result on the device;
- each input produced on the host gets one ``("eugo-todevice-<prefix>-name", ...)`` copy task, shared by all of
  its GPU consumers;
- where an output or a CPU consumer needs NumPy, ``("eugo-tohost-<prefix>-name", i, j)`` copies the
  result back and ``K`` becomes an alias of it; otherwise ``K`` disappears (its GPU consumers read
  the device copy).

Output keys, culling and persist keep working because every key a CPU consumer or the caller can
see still exists and still holds NumPy. GPU and transfer tasks are annotated with the worker
resource (``eugo.resource``) so a distributed scheduler can pin them; key prefixes start with
``eugo-gpu``/``eugo-todevice``/``eugo-tohost`` so the dashboard tells them apart.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, Task, TaskRef, _execute_subgraph
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.base import tokenize
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
from eugo_dask.planner import ChunkInfo, Plan, alias_targets
from eugo_dask.runtime import DeviceCall, sources_on_device, to_device, to_host

#: Key prefixes of the tasks eugo adds: device compute, and the copies each way.
GPU_PREFIX, H2D_PREFIX, D2H_PREFIX = "eugo-gpu", "eugo-todevice", "eugo-tohost"


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


#: Roles of tasks in a rewritten graph, carried to the scheduler in the ``eugo`` annotation.
GPU_ROLE, TODEVICE_ROLE, TOHOST_ROLE, HOST_ROLE, CPU_ROLE = "gpu", "todevice", "tohost", "host", "cpu"
#: Roles that need the GPU resource (device work and the copies on either side of it).
DEVICE_ROLES = frozenset({GPU_ROLE, TODEVICE_ROLE, TOHOST_ROLE})


class TaskRoles:
    """What each task of a rewritten graph is, for the distributed scheduler.

    Two per-key annotations come from it: ``resources`` (``{resource: 1}`` for device work and
    transfers, so only GPU workers run them) and ``eugo`` (``{"role": ..., "cpu_s": ...,
    "est_s": ...}``): ``host`` marks aggregation, ``finalize`` and I/O, which belong on CPU
    workers. Keys with no role get None, which the scheduler ignores.
    """

    def __init__(self, roles: dict[Any, tuple], resource: str) -> None:
        self.roles = roles  # key -> (role, estimated CPU s, estimated chosen s)
        self.resource = resource

    def resources(self, key: Any) -> dict[str, int] | None:
        role = self.roles.get(key)
        return {self.resource: 1} if role is not None and role[0] in DEVICE_ROLES else None

    def eugo(self, key: Any) -> dict[str, Any] | None:
        role = self.roles.get(key)
        if role is None:
            return None
        return {"role": role[0], "cpu_s": role[1], "est_s": role[2]}

    def annotations(self) -> dict[str, Any]:
        return {"resources": _Lookup(self, "resources"), "eugo": _Lookup(self, "eugo")}


class _Lookup:
    """A picklable per-key annotation callable: ``roles.<method>(key)``."""

    def __init__(self, roles: TaskRoles, method: str) -> None:
        self.roles, self.method = roles, method

    def __call__(self, key: Any) -> Any:
        return getattr(self.roles, self.method)(key)

    def __reduce__(self):
        return (_Lookup, (self.roles, self.method))


def annotated_graph(dsk: Mapping[Any, GraphNode], roles: TaskRoles) -> HighLevelGraph:
    """One-layer HighLevelGraph annotated with ``roles``."""
    name = f"eugo-{uuid.uuid4().hex}"
    layer = MaterializedLayer(dict(dsk), annotations=roles.annotations())
    return HighLevelGraph({name: layer}, {name: set()})


def roles_of_rewritten(dsk: Mapping[Any, GraphNode], resource: str) -> TaskRoles:
    """Roles read back from a graph rewritten earlier (its annotations lost to Dask's fusion)."""
    roles: dict[Any, tuple] = {}
    for key, node in dsk.items():
        role = _rewritten_role(node)
        if role is not None:
            roles[key] = (role, None, None)
    return TaskRoles(roles, resource)


def _rewritten_role(node: GraphNode) -> str | None:
    if type(node) is not Task:
        return None
    if isinstance(node.func, DeviceCall):
        return GPU_ROLE
    if node.func is to_device:
        return TODEVICE_ROLE
    if node.func is to_host:
        return TOHOST_ROLE
    if node.func is _execute_subgraph:
        inner = {_rewritten_role(n) for n in node.args[0].values()} - {None}
        if inner:  # fused by Dask after the first pass: device work inside
            return GPU_ROLE
    families = _families(node)
    if families & _HOST_FAMILIES and not families & GPU_FAMILIES:
        return HOST_ROLE
    return None


def is_inner_source(node: GraphNode) -> bool:
    """A node inside a fused task whose result starts on the host: an embedded chunk, or a
    creation function (ones, arange, random...)."""
    if isinstance(node, DataNode):
        value = node.value
        return isinstance(value, np.ndarray) and value.ndim > 0 and device_dtype_ok(value.dtype)
    return classify_func(node.func)[0] in SOURCE_FAMILIES


_CPU_ONLY = frozenset({AGGREGATE, IO, UNKNOWN})
#: Families that belong on CPU workers in a cluster.
_HOST_FAMILIES = frozenset({AGGREGATE, IO})


def _families(node: GraphNode) -> set[str]:
    if type(node) is not Task:
        return set()
    if node.func is _execute_subgraph:
        return set().union(*map(_families, node.args[0].values()))
    return {classify_func(node.func)[0]}


def _is_linear_fusion(node: Task) -> bool:
    inkeys = node.args[2]
    return not any(isinstance(k, str) and k.startswith("__dask_blockwise__") for k in inkeys)


def split_mixed_tasks(dsk: Mapping[Any, GraphNode], chunks: ChunkInfo) -> dict[Any, GraphNode]:
    """Undo Dask's fusion where it joined device work with CPU-only work, so each part can be
    placed on its own.

    - Linear fusion (an I/O read before device work, ``finalize`` or an aggregate after it): the
      chain's nodes become top-level tasks again under their original keys; the fused key becomes
      an alias of the chain's last node.
    - Blockwise fusion of a read into its consumers (``from_array`` of a zarr/h5py-like array
      into a matmul): each read becomes a top-level task again, under the block's original key
      where it can be recovered, so a block read by several consumers is read once.
    """
    out: dict[Any, GraphNode] | None = None
    families_of: dict[int, set[str]] = {}
    templates: dict[int, tuple] = {}
    for key, node in dsk.items():
        if not (type(node) is Task and node.func is _execute_subgraph):
            continue
        inner = node.args[0]
        families = families_of.get(id(inner))
        if families is None:
            families = families_of[id(inner)] = _families(node)
        if not (families & GPU_FAMILIES and families & _CPU_ONLY):
            continue
        if _is_linear_fusion(node):
            if out is None:
                out = dict(dsk)
            top = node.args[1]
            out.update(inner)
            if key != top:
                out[key] = Alias(key, top)
        elif IO in families:
            if id(inner) not in templates:
                templates[id(inner)] = _read_template(node)
            if templates[id(inner)] is not None:
                if out is None:
                    out = dict(dsk)
                out.update(_split_reads(key, node, templates[id(inner)], chunks))
    return dsk if out is None else out


def _read_template(node: Task) -> tuple[list, dict] | None:
    """The reads inside a blockwise-fused task (inner I/O nodes fed only by the task's own
    arguments) and its inner graph without them."""
    inner, inkeys = node.args[0], set(node.args[2])
    reads = [k for k, n in inner.items()
             if type(n) is Task and classify_func(n.func)[0] == IO and n.dependencies <= inkeys]
    if not reads:
        return None
    return reads, {k: n for k, n in inner.items() if k not in reads}


def _split_reads(key: Any, node: Task, template: tuple, chunks: ChunkInfo) -> dict[Any, GraphNode]:
    reads, remaining = template
    inner, outkey, inkeys, deps = node.args[0], node.args[1], node.args[2], node.args[3:]
    bound = {p: (d.key if type(d) is TaskRef else d) for p, d in zip(inkeys, deps)}
    used = set().union(*(n.dependencies for n in remaining.values()))
    kept = [(p, d) for p, d in zip(inkeys, deps) if p in used]  # drop what only reads used
    new_inkeys, new_deps = [p for p, _ in kept], [d for _, d in kept]
    tasks: dict[Any, GraphNode] = {}
    for inner_key in reads:
        read = inner[inner_key].substitute(bound)
        read_key = _read_key(inner_key, read, chunks)
        tasks[read_key] = Task(read_key, read.func, *read.args, **read.kwargs)
        new_inkeys.append(inner_key)
        new_deps.append(TaskRef(read_key))
    tasks[key] = Task(key, _execute_subgraph, remaining, outkey, tuple(new_inkeys), *new_deps)
    return tasks


def _read_key(inner_key: str, read: Task, chunks: ChunkInfo) -> Any:
    """The block's own key (``("array-abc", i, j)``) when the read's slices line up with the
    array's chunks; otherwise a key made from the read's token."""
    name = str(inner_key).split("_.")[0]
    index = next((a.value for a in read.args if isinstance(a, DataNode)
                  and isinstance(a.value, tuple) and all(isinstance(i, slice) for i in a.value)),
                 None)
    block = chunks.block_of(name, index) if index is not None else None
    if block is not None:
        return (name, *block)
    return (name, tokenize(read.func, read.args, read.kwargs))


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
    targets = alias_targets(dsk)

    def resolve(k: Any) -> Any:
        return targets.get(k, k)

    roles: dict[Any, tuple] = {}
    h2d: dict[Any, Any] = {}
    inner_on_device: dict[int, dict] = {}

    def device_input(dep: Any) -> Any:
        source = resolve(dep)
        if source in gpu:
            return prefixed_key(source, GPU_PREFIX)
        if source not in h2d:
            h2d[source] = key = prefixed_key(source, H2D_PREFIX)
            out[key] = Task(key, to_device, TaskRef(source), device)
            roles[key] = (TODEVICE_ROLE, None, None)
        return h2d[source]

    for decision in plan:
        key = decision.key
        if decision.device != GPU_ROLE:
            role = HOST_ROLE if decision.op in _HOST_FAMILIES else CPU_ROLE
            roles[key] = (role, decision.cpu_s, decision.cpu_s)
            continue
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
        roles[device_key] = (GPU_ROLE, decision.cpu_s, decision.gpu_total_s)
        if plan.needs_host(key):
            # the copy back gets a prefix of its own (the task stream tells it apart); the
            # original key, which outputs and CPU consumers read, is an alias of it
            host_key = prefixed_key(key, D2H_PREFIX)
            out[host_key] = Task(host_key, to_host, TaskRef(device_key), device)
            roles[host_key] = (TOHOST_ROLE, None, None)
            out[key] = Alias(key, host_key)
        else:
            del out[key]
    # Aliases of results that stay on the device had only GPU consumers, now rewired.
    for key, source in targets.items():
        if source in gpu and not plan.needs_host(source):
            del out[key]
    return annotated_graph(out, TaskRoles(roles, resource))
