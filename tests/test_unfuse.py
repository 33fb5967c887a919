"""unfuse: Dask's fusion of reads (and other CPU-only work) with device work undone, on Dask's
own fused graphs: every key a consumer or the caller sees kept, and the same values computed."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
from dask._task_spec import Alias, DataNode, Task, TaskRef, fuse_linear_task_spec
from dask.array.core import concatenate3, getter
from dask.array.optimization import optimize as dask_optimize

from eugo_dask.graph import ChunkInfo, fused, key_name, task_spec_dict
from eugo_dask.unfuse import split_mixed_tasks, task_families

from .pipelines import LazyArray

DATA = np.arange(100.0).reshape(10, 10)


def _stored():
    return da.from_array(LazyArray(DATA), chunks=(5, 10))


def _optimized(*collections):
    from dask.highlevelgraph import HighLevelGraph

    graph = HighLevelGraph.merge(*(c.__dask_graph__() for c in collections))
    keys = [c.__dask_keys__() for c in collections]
    return task_spec_dict(dask_optimize(graph, keys)), ChunkInfo.from_graph(graph), keys


def _values(dsk, keys):
    return [np.asarray(v) for v in dask.get(dsk, keys)]


def test_task_families_are_those_of_every_function_inside():
    x = _stored()
    dsk, _, _ = _optimized(np.exp(x))
    families = {frozenset(task_families(v)) for v in dsk.values()}
    assert frozenset({"elementwise", "io"}) in families  # the read fused into exp
    assert task_families(Task("t", getter, DataNode(None, DATA), (slice(0, 5),))) == {"io"}
    assert task_families(DataNode("d", 1)) == set() and task_families(Alias("a", "b")) == set()


def test_a_graph_with_nothing_mixed_is_handed_back_as_it_is():
    y = (da.ones((10, 10), chunks=5) + 1) @ da.ones((10, 10), chunks=5)
    dsk, chunks, _ = _optimized(y)
    assert split_mixed_tasks(dsk, chunks) is dsk
    reads_only, chunks, _ = _optimized(_stored())  # reads alone: nothing to split from
    assert split_mixed_tasks(reads_only, chunks) is reads_only


def test_reads_fused_blockwise_into_device_work_become_tasks_of_their_own():
    x = _stored()
    y = np.exp(x) * 2
    dsk, chunks, keys = _optimized(y)
    split = split_mixed_tasks(dsk, chunks)
    assert set(dsk) <= set(split)  # every key kept
    reads = {k: v for k, v in split.items() if task_families(v) == {"io"}}
    assert set(reads) == {(x.name, 0, 0), (x.name, 1, 0)}  # the blocks' own keys
    for key in dict(dsk):
        node = split[key]
        if key_name(key) == y.name:
            assert task_families(node) == {"elementwise"}
            (read,) = [d for d in node.dependencies if d in reads]
            assert read == (x.name, key[1], 0)
            assert reads[read].data_producer == dsk[key].data_producer
    for a, b in zip(_values(split, keys), _values(dsk, keys)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(concatenate3(dask.get(split, keys)[0]), np.exp(DATA) * 2)


def test_a_block_read_by_several_consumers_is_read_once():
    x = _stored()
    dsk, chunks, keys = _optimized(np.exp(x), np.sin(x) + 1)
    split = split_mixed_tasks(dsk, chunks)
    reads = [k for k, v in split.items() if task_families(v) == {"io"}]
    assert sorted(reads) == [(x.name, 0, 0), (x.name, 1, 0)]
    for a, b in zip(_values(split, keys), _values(dsk, keys)):
        np.testing.assert_array_equal(a, b)


def test_a_read_whose_block_is_not_known_gets_a_key_of_its_own():
    """Without the array's chunks the read cannot be named by its block: a key made from the
    read itself, the same for the same read, and the values unchanged."""
    x = _stored()
    y = np.exp(x)
    dsk, _, keys = _optimized(y)
    split = split_mixed_tasks(dsk, ChunkInfo({}))
    reads = [k for k, v in split.items() if task_families(v) == {"io"}]
    assert len(reads) == 2 and all(key_name(k) == x.name and k[1:] not in [(0, 0), (1, 0)]
                                    for k in reads)
    assert sorted(reads) == sorted(k for k, v in split_mixed_tasks(dsk, ChunkInfo({})).items()
                                   if task_families(v) == {"io"})
    for a, b in zip(_values(split, keys), _values(dsk, keys)):
        np.testing.assert_array_equal(a, b)


def test_a_linear_chain_of_a_read_and_device_work_is_taken_apart():
    """Linear fusion glued a read to the exp after it: the chain's tasks are top-level again
    under their own keys, the fused key an alias of the chain's last."""
    source = DataNode("source", DATA)
    graph = {
        "source": source,
        ("read", 0): Task(("read", 0), getter, TaskRef("source"), (slice(0, 5), slice(None))),
        ("exp", 0): Task(("exp", 0), np.exp, TaskRef(("read", 0))),
    }
    fused_graph = fuse_linear_task_spec(graph, [("exp", 0)])
    (chain_key,) = [k for k, v in fused_graph.items() if fused(v) is not None]
    assert task_families(fused_graph[chain_key]) == {"io", "elementwise"}
    split = split_mixed_tasks(dict(fused_graph), ChunkInfo({}))
    assert set(fused_graph) <= set(split)
    assert task_families(split[("read", 0)]) == {"io"}
    assert task_families(split[("exp", 0)]) == {"elementwise"}
    assert ("read", 0) in split[("exp", 0)].dependencies
    assert isinstance(split[chain_key], Alias) and split[chain_key].target == ("exp", 0)
    np.testing.assert_array_equal(dask.get(split, chain_key), np.exp(DATA[:5]))
