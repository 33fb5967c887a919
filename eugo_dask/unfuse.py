"""Undo Dask's fusion where it glued device work to work that must stay on the host.

Dask's linear fusion can merge an I/O read or ``finalize`` with the compute that follows it, and
blockwise fusion can fold a read (``from_array`` of a zarr/h5py-like array) into its consumers.
A read must stay on the CPU while the compute may not, so such tasks are split back into parts
before anything is described or placed (:func:`split_mixed_tasks`), keeping every key a
consumer or the caller can see.
"""

from __future__ import annotations

from typing import NamedTuple

from dask._task_spec import Alias, DataNode, GraphNode, Task, TaskRef
from dask.base import tokenize

from eugo_dask.graph import FUSED_FUNC, FUSED_INNER, ChunkInfo, Fused, Key, fused, substitute_keys
from eugo_dask.ops import CPU_ONLY_FAMILIES, GPU_FAMILIES, IO, Family, classify_node, is_wrapper


def task_families(node: GraphNode, known: dict[int, set[Family]] | None = None) -> set[Family]:
    """The op families of the functions in a task (all of them, for a fused task). ``known``:
    the families of fused tasks' inner graphs and of plain tasks' functions seen before, by
    identity, read and filled in (a linearly fused chunk task's inner graph is its own, the
    blockwise-fused one nested in it its layer's, and the chunks of a layer share their
    functions)."""
    parts = fused(node)
    if parts is None:
        if type(node) is not Task:
            return set()
        if known is None or is_wrapper(node.func):  # (a wrapper: by the function it wraps)
            return {classify_node(node)[0]}
        families = known.get(id(node.func))
        if families is None:
            families = known[id(node.func)] = {classify_node(node)[0]}
        return families
    if known is None:
        return set().union(*[task_families(n) for n in parts.inner.values()])
    families = known.get(id(parts.inner))
    if families is None:
        if type(parts.outkey) is tuple:  # a linear chain: its inner graph is its own
            return _chain_families(parts.inner, known)
        families = known[id(parts.inner)] = set().union(
            *[task_families(n, known) for n in parts.inner.values()])
    return families


def _chain_families(inner: dict[Key, GraphNode], known: dict[int, set[Family]]) -> set[Family]:
    """:func:`task_families` of a linear chain's nodes (once per chunk task of a chain of
    layers: the families of each node's function or nested inner graph looked up by identity)."""
    families: set[Family] = set()
    for node in inner.values():
        if type(node) is Task:
            found = known.get(id(node.args[FUSED_INNER]) if node.func is FUSED_FUNC
                              else id(node.func))
            if found is not None and not is_wrapper(node.func):
                families |= found
                continue
        families |= task_families(node, known)
    return families


def split_mixed_tasks(dsk: dict[Key, GraphNode], chunks: ChunkInfo) -> dict[Key, GraphNode]:
    """Undo Dask's fusion where it joined device work with CPU-only work, so each part can be
    placed on its own.

    - Linear fusion (an I/O read before device work, ``finalize`` or an aggregate after it): the
      chain's nodes become top-level tasks again under their original keys; the fused key becomes
      an alias of the chain's last node.
    - Blockwise fusion of a read into its consumers (``from_array`` of a zarr/h5py-like array
      into a matmul): each read becomes a top-level task again, under the block's original key
      where it can be recovered, so a block read by several consumers is read once.
    """
    out: dict[Key, GraphNode] | None = None
    families_of: dict[int, set[Family]] = {}
    templates: dict[int, ReadTemplate | None] = {}

    def mixed(node: GraphNode) -> bool:
        """Whether ``node`` is a fused task whose parts mix device and CPU-only work (asked
        once per inner graph: a blockwise layer's tasks share theirs)."""
        if type(node) is not Task or node.func is not FUSED_FUNC:  # (is_fused, narrowing)
            return False
        families = task_families(node, families_of)
        return bool(families & GPU_FAMILIES and families & CPU_ONLY_FAMILIES)

    pending = [(key, node) for key, node in dsk.items() if mixed(node)]
    while pending:  # what a split exposes (a blockwise task inside a linear chain) is split too
        key, node = pending.pop()
        parts = fused(node)
        assert parts is not None  # (mixed)
        families = task_families(node, families_of)
        if not parts.is_blockwise:
            if out is None:
                out = dict(dsk)
            exposed = dict(parts.inner)
            if key not in exposed:  # (a nested fused task may carry the outer task's key)
                exposed[key] = Alias(key, parts.outkey)
            out.update(exposed)
            pending.extend((k, n) for k, n in exposed.items() if mixed(n))
        elif IO in families:
            if id(parts.inner) not in templates:
                templates[id(parts.inner)] = _read_template(parts)
            template = templates[id(parts.inner)]
            if template is not None:
                if out is None:
                    out = dict(dsk)
                assert type(node) is Task
                out.update(_split_reads(key, node, parts, template, chunks))
    return dsk if out is None else out


class ReadTemplate(NamedTuple):
    """The reads inside a blockwise-fused layer's inner graph, and the graph without them."""

    reads: list[Key]
    remaining: dict[Key, GraphNode]


def _read_template(parts: Fused) -> ReadTemplate | None:
    """The reads inside a blockwise-fused task (inner I/O nodes fed only by the task's own
    arguments) and its inner graph without them."""
    inkeys = set(parts.inkeys)
    reads = [k for k, n in parts.inner.items()
             if type(n) is Task and classify_node(n)[0] == IO and n.dependencies <= inkeys]
    if not reads:
        return None
    return ReadTemplate(reads, {k: n for k, n in parts.inner.items() if k not in reads})


def _split_reads(key: Key, node: Task, parts: Fused, template: ReadTemplate,
                 chunks: ChunkInfo) -> dict[Key, GraphNode]:
    """The reads as tasks of their own (data producers, as the fused task was, so the
    scheduler queues them as root tasks) and the rest of the fused task reading them."""
    bound = parts.bound_inputs()
    used = set().union(*(n.dependencies for n in template.remaining.values()))
    kept = [(p, d) for p, d in zip(parts.inkeys, parts.deps) if p in used]  # drop what only reads used
    new_inkeys, new_deps = [p for p, _ in kept], [d for _, d in kept]
    tasks: dict[Key, GraphNode] = {}
    for inner_key in template.reads:
        read = substitute_keys(parts.inner[inner_key], bound)
        assert isinstance(read, Task)
        read_key = _read_key(inner_key, read, chunks)
        tasks[read_key] = Task(read_key, read.func, *read.args,
                               _data_producer=node.data_producer, **read.kwargs)
        new_inkeys.append(inner_key)
        new_deps.append(TaskRef(read_key))
    tasks[key] = Fused(template.remaining, parts.outkey, tuple(new_inkeys), tuple(new_deps)).task(key)
    return tasks


def _read_key(inner_key: Key, read: Task, chunks: ChunkInfo) -> Key:
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
