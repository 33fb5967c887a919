"""graph: the adapter to Dask's task specs, on Dask's own graphs: chunk specs per key, fused
tasks taken apart and put together, aliases, eugo's key names, and a P2P shuffle's id.

(dependency_order is tested in test_describe, beside the graphs it orders; new_task in
test_rewrite.)"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Alias, DataNode, Task, TaskRef, fuse_linear_task_spec
from dask.array.optimization import optimize as dask_optimize

from eugo_dask.graph import (
    ArraySpec,
    ChunkInfo,
    Fused,
    alias_targets,
    barrier_key,
    execution_order,
    flatten_keys,
    fused,
    fused_output,
    holds_eugo_device_value,
    is_fused,
    keeps_its_name,
    key_name,
    materialized_layers,
    optimize_without_linear_fusion,
    shuffle_id_of,
    task_spec_dict,
    with_shuffle_id,
)


def _optimized(x):
    return task_spec_dict(dask_optimize(x.__dask_graph__(), x.__dask_keys__()))


def test_array_spec_and_key_names():
    spec = ArraySpec((3, 4), np.dtype("f4"))
    assert (spec.size, spec.nbytes) == (12, 48)
    assert ArraySpec((), np.dtype("c16")).nbytes == 16
    assert key_name(("x-abc", 0, 1)) == "x-abc"
    assert key_name("x-abc") == "x-abc" and key_name(()) == ()


def test_chunk_specs_per_key_from_a_collections_layers():
    x = da.ones((10, 7), chunks=(4, 5), dtype="i2")
    y = (x + 1).astype("f4")
    chunks = ChunkInfo.from_graph(y.__dask_graph__())
    name = y.name
    assert chunks.spec((name, 0, 0)) == ArraySpec((4, 5), np.dtype("f4"))
    assert chunks.spec((name, 2, 1)) == ArraySpec((2, 2), np.dtype("f4"))  # the edge chunk
    assert chunks.spec((x.name, 2, 0)) == ArraySpec((2, 5), np.dtype("i2"))
    # one object per distinct spec: chunks of one shape share it
    assert chunks.spec((name, 0, 0)) is chunks.spec((name, 1, 0))
    assert chunks.spec((name, 3, 0)) is None  # no such block
    assert chunks.spec((name, 0)) is None  # an index of another length
    assert chunks.spec(("not-a-layer", 0, 0)) is None
    assert chunks.spec(name) is None  # a bare name stands for a layer of one chunk only
    one = da.ones((3, 2), chunks=-1)
    assert ChunkInfo.from_graph(one.__dask_graph__()).spec(one.name) == ArraySpec((3, 2), np.dtype("f8"))


def test_chunks_of_unknown_size_have_no_spec():
    x = da.arange(10, chunks=5)
    y = x[x > 3]  # boolean indexing: NaN chunk sizes
    chunks = ChunkInfo.from_graph(y.__dask_graph__())
    assert chunks.spec((y.name, 0)) is None
    assert chunks.spec((x.name, 1)) == ArraySpec((5,), x.dtype)


def test_a_layer_of_special_chunks_is_named_as_such():
    data = np.ma.masked_greater(np.arange(12.0).reshape(3, 4), 5)
    masked = da.from_array(data, chunks=2) + 1
    plain = da.ones(4, chunks=2) + 1
    chunks = ChunkInfo.from_graph(masked.__dask_graph__()).merge(
        ChunkInfo.from_graph(plain.__dask_graph__()))
    assert "MaskedArray" in chunks.special_chunk_type((masked.name, 0, 0))
    assert chunks.special_chunk_type((plain.name, 0)) is None
    assert chunks.spec((plain.name, 1)) == ArraySpec((2,), np.dtype("f8"))  # merged: both known
    assert chunks.spec((masked.name, 1, 1)) == ArraySpec((1, 2), np.dtype("f8"))


def test_block_of_names_the_chunk_an_index_selects_exactly():
    x = da.ones((10, 7), chunks=(4, 5))
    chunks = ChunkInfo.from_graph(x.__dask_graph__())
    assert chunks.block_of(x.name, (slice(0, 4), slice(0, 5))) == (0, 0)
    assert chunks.block_of(x.name, (slice(8, 10), slice(5, 7))) == (2, 1)
    assert chunks.block_of(x.name, (slice(None, 4), slice(5, None))) == (0, 1)
    assert chunks.block_of(x.name, (slice(1, 4), slice(0, 5))) is None  # not a chunk's start
    assert chunks.block_of(x.name, (slice(0, 3), slice(0, 5))) is None  # part of a chunk
    assert chunks.block_of(x.name, (slice(0, 4, 2), slice(0, 5))) is None  # a step
    assert chunks.block_of(x.name, (slice(0, 4),)) is None
    assert chunks.block_of("other", (slice(0, 4), slice(0, 5))) is None


def test_a_blockwise_fused_task_taken_apart_and_put_together():
    x = da.ones((6, 4), chunks=3)
    y = np.exp(x + 1) * 2
    dsk = _optimized(y)
    key = (y.name, 1, 0)
    node = dsk[key]
    assert is_fused(node)
    parts = fused(node)
    assert isinstance(parts, Fused) and parts.is_blockwise
    assert parts.outkey in parts.inner
    bound = parts.bound_inputs()
    assert set(bound) == set(parts.inkeys)
    assert {k for k in bound.values() if not isinstance(k, DataNode)} == set(node.dependencies)
    rebuilt = parts.task(key)
    assert rebuilt.key == key and rebuilt.dependencies == node.dependencies
    values = dask.get(dsk, list(node.dependencies)) if node.dependencies else []
    env = dict(zip(node.dependencies, values))
    np.testing.assert_array_equal(rebuilt(env), node(env))
    np.testing.assert_array_equal(rebuilt(env), np.full((3, 3), np.exp(2) * 2))
    out = fused_output(node)
    assert out is parts.inner[parts.outkey] and not is_fused(out)
    plain = Task(("p", 0), np.negative, TaskRef(("q", 0)))
    assert fused(plain) is None and not is_fused(plain) and fused_output(plain) is plain
    assert fused(DataNode("d", 1)) is None and fused(Alias("a", "b")) is None


def test_execution_order_puts_each_inner_node_after_what_it_reads():
    x = da.ones((6, 4), chunks=3)
    y = ((x + 1) * np.sin(x)).T @ x
    dsk = _optimized(y)
    checked = 0
    for node in dsk.values():
        parts = fused(node)
        if parts is None:
            continue
        order = execution_order(parts.inner)
        assert sorted(map(id, order)) == sorted(map(id, parts.inner.values()))
        position = {n.key: i for i, n in enumerate(order)}
        for n in order:
            assert all(position[d] < position[n.key] for d in n.dependencies if d in parts.inner)
        checked += 1
    assert checked


def test_aliases_are_followed_to_what_they_finally_stand_for():
    dsk = {"a": Alias("a", "b"), "b": Alias("b", "c"), "c": DataNode("c", 1),
           "d": Alias("d", "c"), "loop1": Alias("loop1", "loop2"), "loop2": Alias("loop2", "loop1")}
    targets = alias_targets(dsk)
    assert {k: targets[k] for k in "abd"} == {"a": "c", "b": "c", "d": "c"}
    assert set(targets) == {"a", "b", "d", "loop1", "loop2"}  # a cycle ends, bounded
    # Dask's linear fusion: the chain's keys alias the fused task's
    x = da.ones(8, chunks=4)
    y = np.negative(np.exp(x + 1).rechunk(8).rechunk(4))
    fused_graph = fuse_linear_task_spec(task_spec_dict(y.__dask_graph__()), y.__dask_keys__())
    targets = alias_targets(fused_graph)
    assert targets
    assert all(not isinstance(fused_graph[t], Alias) for t in targets.values())


def test_task_spec_dict_reads_legacy_graphs_and_leaves_task_specs_as_they_are():
    legacy = {"a": 1, "b": (np.add, "a", 10), ("c", 0): (sum, ["a", "b"])}
    converted = task_spec_dict(legacy)
    assert all(isinstance(v, (Task, DataNode)) for v in converted.values())
    assert dask.get(converted, ("c", 0)) == 12
    specs = {"a": DataNode("a", 1), "b": Task("b", np.negative, TaskRef("a"))}
    assert task_spec_dict(specs) == specs
    x = da.ones(4, chunks=2) + 1
    assert set(task_spec_dict(x.__dask_graph__())) == set(dict(x.__dask_graph__()))


def test_optimization_up_to_linear_fusion():
    """Blockwise fusion and culling, no linear fusion (no Alias left by it), and nothing set for
    the process."""
    x = da.ones((8, 8), chunks=4)
    y = (np.exp(x + 1) * 2).rechunk(8)[:4]
    unused = da.zeros(3, chunks=3) + 7
    from dask.highlevelgraph import HighLevelGraph

    graph = HighLevelGraph.merge(y.__dask_graph__(), unused.__dask_graph__())
    out = dict(optimize_without_linear_fusion(graph, y.__dask_keys__()))
    # culled as Dask's own optimization culls (which, by the hash seed, may keep the unused
    # root layer: its keys are no promise of this function's)
    with dask.config.set({"optimization.fuse.active": False}):
        assert set(out) == set(dict(dask_optimize(graph, y.__dask_keys__())))
    assert any(key_name(k) == y.name for k in out)
    nodes = task_spec_dict(out)
    assert not any(isinstance(v, Alias) for v in nodes.values())
    assert any(is_fused(v) and fused(v).is_blockwise for v in nodes.values())
    assert dask.config.get("optimization.fuse.active", None) is not False
    np.testing.assert_array_equal(dask.get(nodes, y.__dask_keys__()[0][0]), np.full((4, 8), np.exp(2) * 2))
    # a plain dict of a graph: a graph of one layer (nothing to fuse), culled
    plain = task_spec_dict(optimize_without_linear_fusion(dict(graph), y.__dask_keys__()))
    assert not any(key_name(k) == unused.name for k in plain)
    np.testing.assert_array_equal(dask.get(plain, y.__dask_keys__()[0][0]), np.full((4, 8), np.exp(2) * 2))


def test_materialized_layers_leave_the_others_unmaterialized():
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    x = da.ones(4, chunks=2) + 1  # Blockwise layers
    extra = MaterializedLayer({("m", 0): DataNode(("m", 0), 1)})
    graph = HighLevelGraph.merge(x.__dask_graph__(), HighLevelGraph({"m": extra}, {"m": set()}))
    layers = list(materialized_layers(graph))
    assert layers == [extra.mapping]
    plain = {"a": DataNode("a", 1)}
    assert list(materialized_layers(plain)) == [plain]


def test_flatten_keys():
    assert flatten_keys([[("x", 0, 0), ("x", 0, 1)], [("x", 1, 0)]]) == {("x", 0, 0), ("x", 0, 1),
                                                                         ("x", 1, 0)}
    assert flatten_keys("x") == {"x"} and flatten_keys([]) == set()


@pytest.mark.parametrize(("key", "ours"), [
    (("eugo-gpu-add-abc", 0), True), ("eugo-todevice-x-1", True), (("eugo-tohost-add", 1), False),
    (("add-abc", 0), False), (("array-eugo-todevice-ab-eugo-gpu-add", 0), True),
    (("eugo-gpuadd", 0), False), ((), False), (42, False),
])
def test_which_keys_hold_eugos_device_values(key, ours):
    assert holds_eugo_device_value(key) is ours


def _shuffle_graph():
    x = da.ones((40, 40), chunks=(40, 5)).rechunk((5, 40), method="p2p") + 1
    return x, _optimized(x)


def _strings(value):
    """Every string among a node's arguments, also in nested tasks and inner graphs."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Task):
        for a in (*value.args, *value.kwargs.values()):
            yield from _strings(a)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _strings(v)


def test_a_shuffles_barrier_keeps_its_name_and_names_its_shuffle():
    _, dsk = _shuffle_graph()
    barriers = [v for v in dsk.values() if keeps_its_name(v)]
    assert len(barriers) == 1
    (barrier,) = barriers
    shuffle_id = shuffle_id_of(barrier)
    assert barrier.key == barrier_key(shuffle_id) == f"shuffle-barrier-{shuffle_id}"
    assert not any(keeps_its_name(v) for v in dsk.values() if v is not barrier)


def test_a_shuffle_given_a_new_id_everywhere_it_is_named():
    _, dsk = _shuffle_graph()
    (barrier,) = [v for v in dsk.values() if keeps_its_name(v)]
    old, new = shuffle_id_of(barrier), "eugo-new-id"
    renamed_barrier = with_shuffle_id(barrier, old, new)
    assert type(renamed_barrier) is type(barrier) and shuffle_id_of(renamed_barrier) == new
    assert renamed_barrier.key == barrier.key  # the key is the caller's to change
    assert renamed_barrier.dependencies == barrier.dependencies
    naming = 0
    for key, node in dsk.items():
        renamed = with_shuffle_id(node, old, new)
        assert renamed.key == node.key and renamed.dependencies == node.dependencies
        before = list(_strings(node))
        if old in before:
            naming += 1
            after = list(_strings(renamed))
            assert old not in after and after.count(new) == before.count(old), key
        elif not isinstance(node, Task):
            assert renamed is node  # aliases and data: as they were
        else:
            assert renamed == node
    assert naming > 8  # transfers and unpacks, some inside fused tasks
    assert with_shuffle_id(DataNode("d", "x"), "x", "y") == DataNode("d", "x")
