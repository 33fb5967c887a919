"""Reads paced to the device: a rewritten graph's reads wait for the device to consume the blocks
read before them.

distributed queues root tasks (reads: ``from_array`` or zarr blocks, creation functions) and
hands a worker the next one when it has a thread free, whatever waits for the blocks it read on
another worker (dask/distributed#9164). Where a read's block goes to the device, its consumer runs
on a GPU worker: CPU workers go on reading while the device lags behind, and the blocks wait in
memory, on the GPU worker and on the device, without bound.

:func:`pace_reads` writes the bound into the graph. The **reads** are the tasks distributed
treats as roots (no dependencies, or marked ``data_producer``) whose results go only to copies to
the device and are not outputs, put in block order (chunk index, then layer: the reads of ``x +
y`` interleave). Read ``j`` waits for a **token**, a task that runs on the GPU worker after the
first device task consuming read ``j - window`` has ended (its copy back to the host, where it
has one: results wait for a thread on the GPU worker too) and returns None; so at most ``window``
reads are done whose first consumer on the device is not. A read is paced only where that device
task reads nothing from read ``j`` or later (its ancestors' highest read index is below ``j``):
by induction over ``j``, no read then waits on itself, and the graph stays acyclic. Any other
read is left as it was, queued by distributed alone.

The paced read is the original task nested in ``after_token(token, value)``: the token's value
never reaches the read's function. It keeps ``data_producer`` (and gets it, where it had no
dependencies), so distributed still queues it as a root once its token is there. A key keeps
one meaning: the paced read is renamed after its read and the device task it waits for, and a
token is named after that device task.

Graphs planned for a local scheduler are not paced: its pool of threads or processes is the
bound (the pass decides, :mod:`eugo_dask.optimization`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from dask._task_spec import GraphNode, Task, TaskRef
from dask.base import tokenize

from eugo_dask.graph import NO_KWARGS, Key, key_name, new_task
from eugo_dask.runtime import DeviceCall, after_token, pace_token, to_host

logger = logging.getLogger(__name__)

#: Key prefix of the tokens (``key_split`` shows ``eugo-paced-<the device task's prefix>``).
PACE_PREFIX = "eugo-paced"


def copies_ahead(read_ahead: int, slots: int) -> int:
    """How many device tasks' copies to the device may run ahead of the device, with
    ``eugo.read-ahead`` ``read_ahead`` and ``slots`` GPU slots: the one each slot runs, and
    ``read_ahead`` more per slot (eugo's scheduler plugin holds each copy until the device task
    that many places before its first consumer has ended, :mod:`eugo_dask.gates`; the schedule
    model does the same, :func:`eugo_dask.schedule.simulate`)."""
    return (read_ahead + 1) * slots


class Paced(NamedTuple):
    """A graph with its reads paced: the tokens written, and each paced read's new key."""

    graph: dict[Key, GraphNode]
    tokens: list[Key]
    renames: dict[Key, Key]


def pace_reads(graph: dict[Key, GraphNode], copies: Iterable[Key], outputs: set[Key],
               window: int) -> Paced:
    """Pace the reads of ``graph`` (a rewritten graph; ``copies``: its copies to the device, each
    reading one key; ``outputs``: its output keys) so that at most ``window`` of them run ahead
    of the device tasks that consume them (see the module docstring). ``graph`` itself, with no
    tokens, where no read is paced."""
    reads = _candidates(graph, copies, outputs)
    if len(reads) <= window:
        return Paced(graph, [], {})
    consumers = _read_only_by_copies(graph, reads)
    order = _block_order(list(reads))
    index = {read: i for i, read in enumerate(order)}
    highest = _HighestRead(graph, index, reads)
    gates: dict[Key, Key] = {}  # a read -> the device task it waits for
    for j in range(window, len(order)):
        ends = consumers.get(order[j - window])
        if not ends:
            continue
        first = ends[0] if len(ends) == 1 else min(ends, key=highest)
        if highest(first) < j:
            gates[order[j]] = first
    logger.debug("eugo: %d of %d reads paced to the device (window %d)", len(gates),
                 len(order), window)
    if not gates:
        return Paced(graph, [], {})
    return _write(graph, reads, gates)


def _candidates(graph: dict[Key, GraphNode], copies: Iterable[Key], outputs: set[Key]
                ) -> dict[Key, list[Key]]:
    """The root tasks (no dependencies, or ``data_producer``) that ``copies`` read, not outputs,
    each with its copies to the device."""
    reads: dict[Key, list[Key]] = {}
    for copy in copies:
        (source,) = graph[copy].dependencies
        node = graph.get(source)
        if (type(node) is Task and (node.data_producer or not node.dependencies)
                and source not in outputs):
            reads.setdefault(source, []).append(copy)
    return reads


def _read_only_by_copies(graph: dict[Key, GraphNode], reads: dict[Key, list[Key]]
                         ) -> dict[Key, list[Key]]:
    """Drop from ``reads`` those that another task than their copies reads, in one walk over
    ``graph`` that also finds, for each read, the end of each device task reading its copies:
    the copy of its result back to the host where it has one (until then the result waits on
    the GPU worker, for a thread there), else the device task itself."""
    source_of = {c: read for read, cs in reads.items() for c in cs}
    copy_keys, read_keys = source_of.keys(), reads.keys()
    consumers: dict[Key, list[Key]] = {}
    back: dict[Key, Key] = {}  # a device task -> its copy back
    for key, node in graph.items():
        deps = node.dependencies
        if not deps:
            continue
        if not read_keys.isdisjoint(deps) and key not in copy_keys:
            for read in read_keys & deps:  # read by another task than its copy: not a read
                del reads[read]
        if type(node) is not Task:
            continue
        if node.func is to_host:
            (device,) = deps
            back[device] = key
        elif isinstance(node.func, DeviceCall) and not copy_keys.isdisjoint(deps):
            for copy in copy_keys & deps:
                consumers.setdefault(source_of[copy], []).append(key)
    return {read: [back.get(k, k) for k in ends] for read, ends in consumers.items()
            if read in reads}


def _block_order(reads: list[Key]) -> list[Key]:
    """``reads`` by chunk index, then layer (``("x", 0, 1)`` before ``("y", 0, 1)`` before
    ``("x", 0, 2)``), the order in which Dask's ordering consumes blocks; as they came where
    their indices do not compare."""
    try:
        return sorted(reads, key=_block)
    except TypeError:
        return reads


def _block(key: Key) -> tuple[Any, str]:
    if type(key) is tuple and key:
        return (key[1:], str(key[0]))
    return ((), str(key))


class _HighestRead:
    """The highest read index among a task's ancestors and itself (-1: none), worked out on
    demand and kept: each task is looked at once, whatever the number of device tasks asked
    about. Known from the start: each read whose dependencies are roots (a ``from_array``'s
    array, or none), and its copies."""

    def __init__(self, graph: dict[Key, GraphNode], index: dict[Key, int],
                 reads: dict[Key, list[Key]]) -> None:
        self.graph, self.index = graph, index
        self.known: dict[Key, int] = {}
        known = self.known
        for read, copies in reads.items():
            deps = graph[read].dependencies
            if all(d not in graph or not graph[d].dependencies for d in deps):
                known.update(dict.fromkeys(deps, -1))
                known.update(dict.fromkeys(copies, index[read]))
                known[read] = index[read]

    def __call__(self, key: Key) -> int:
        known = self.known
        found = known.get(key)
        if found is not None:
            return found
        graph, index = self.graph, self.index
        stack = [key]
        while stack:
            top = stack[-1]
            if top in known:
                stack.pop()
                continue
            node = graph.get(top)
            deps = node.dependencies if node is not None else ()
            pending = [d for d in deps if d not in known]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            known[top] = max(index.get(top, -1), max(map(known.__getitem__, deps), default=-1))
        return known[key]


def _write(graph: dict[Key, GraphNode], reads: dict[Key, list[Key]], gates: dict[Key, Key]
           ) -> Paced:
    """``graph`` with each read of ``gates`` waiting for the token of its device task: the read
    renamed and nested in ``after_token``, its copies reading it by its new name, each key
    where it was (Dask's ordering breaks ties by the graph's order) and the tokens after
    them."""
    tokens: dict[Key, Key] = {}  # a device task -> its token
    renames: dict[Key, Key] = {}
    changed: dict[Key, GraphNode] = {}
    for read, gate in gates.items():
        token = tokens.get(gate)
        if token is None:
            token = tokens[gate] = _suffixed(PACE_PREFIX + "-", gate)
        node = graph[read]
        assert type(node) is Task
        paced = renames[read] = _paced_key(read, gate)
        changed[read] = new_task(paced, after_token, (TaskRef(token), node), NO_KWARGS,
                                 node.dependencies | {token}, True)
        for copy in reads[read]:
            changed[copy] = _reading(graph[copy], read, paced)
    out = dict(zip(map(renames.get, graph, graph), map(changed.get, graph, graph.values())))
    for gate, token in tokens.items():
        out[token] = new_task(token, pace_token, (TaskRef(gate),), NO_KWARGS, frozenset([gate]))
    return Paced(out, list(tokens.values()), renames)


def _reading(copy: GraphNode, old: Key, new: Key) -> Task:
    """A copy to the device (``Task(key, to_device, TaskRef(old), device)``) reading ``new``."""
    assert type(copy) is Task
    args = tuple(TaskRef(new) if type(a) is TaskRef and a.key == old else a for a in copy.args)
    return new_task(copy.key, copy.func, args, copy.kwargs, frozenset([new]))


def _suffixed(prefix: str, key: Key) -> Key:
    """``key`` with ``prefix`` before its name: the token of device task ``key``."""
    if type(key) is tuple and key:
        return (f"{prefix}{key[0]}", *key[1:])
    return f"{prefix}{key}"


def _paced_key(read: Key, gate: Key) -> Key:
    """The paced read's key: the read's, named after the device task's layer too and indexed by
    its chunk and the device task's (a key keeps one meaning: the same read waiting for another
    device task is another task). ``key_split`` still gives the read's prefix."""
    gate_index = gate[1:] if type(gate) is tuple else ()
    suffix = _gate_suffix(key_name(gate) if gate_index else gate)
    if type(read) is tuple and read:
        return (_paced_name(read[0], suffix), *read[1:], *gate_index)
    name = _paced_name(read, suffix)
    return (name, *gate_index) if gate_index else name


@functools.lru_cache(maxsize=1024)
def _gate_suffix(name: Key) -> str:
    """Eight hex digits naming a device task's layer (or its key where it has no index)."""
    return tokenize(name)[:8]


@functools.lru_cache(maxsize=4096)
def _paced_name(name: Key, suffix: str) -> str:
    """One string per layer of paced reads, shared by its keys."""
    return f"{name}-paced-{suffix}"
