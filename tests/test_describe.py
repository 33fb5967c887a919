"""Describing a graph: chunks share the work of being described, never its answer."""

from __future__ import annotations

import warnings

import dask.array as da
import numpy as np
import pytest
from dask.array.core import PerformanceWarning
from dask.array.optimization import optimize as dask_optimize

from eugo_dask import describe as describe_module
from eugo_dask.describe import describe_graph
from eugo_dask.graph import ArraySpec, ChunkInfo, key_name, task_spec_dict
from eugo_dask.optimization import _current_settings, _profile
from eugo_dask.unfuse import split_mixed_tasks

from .pipelines import LazyArray


def _matmul_tree():
    # Dask's linear fusion gives each chunk of the contraction's tree reduction an inner
    # graph of its own; random chunks each draw from a seed of their own
    z = da.random.default_rng(0).random((300, 300), chunks=(20, 30))
    return z @ z.T


def _pipeline():
    z = da.random.default_rng(1).random((96, 96), chunks=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        return (np.exp(z @ z.T) + 1).sum(axis=0)


def _two_trees():
    # two tree reductions of one shape but different functions, fused chunk by chunk (20
    # blocks by 4: a level of single-input partials, fused with the level below)
    z = da.random.default_rng(3).random((400, 300), chunks=(20, 30))
    return z.sum(axis=0, split_every=4) + z.max(axis=0, split_every=4)


def _legacy_random_with_edges():
    x = da.random.RandomState(2).normal(size=(100, 70), chunks=(30, 20)).astype("f4")
    return x[::2].std(axis=1) + da.ones(50, chunks=7, dtype="i2")


def _reads_with_edges():
    # reads of a stored array fused with device work (split off again), chunks of four shapes
    x = da.from_array(LazyArray(np.random.default_rng(4).random((100, 70))), chunks=(30, 20))
    return (da.exp(x) @ x.T).sum(axis=0)


def _described(collection, share=True):
    graph, keys = collection.__dask_graph__(), collection.__dask_keys__()
    chunks = ChunkInfo.from_graph(graph)
    dsk = split_mixed_tasks(task_spec_dict(dask_optimize(graph, keys)), chunks)
    follows = 0
    follow = describe_module._follow

    def counting(*args):
        nonlocal follows
        follows += 1
        return follow(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(describe_module, "_follow", counting)
        description = describe_graph(dsk, chunks, _profile(_current_settings()), share=share)
    return description, follows


@pytest.mark.parametrize(("build", "fewer"), [(_matmul_tree, 4), (_pipeline, 4),
                                             (_two_trees, 2), (_legacy_random_with_edges, 1)])
def test_chunks_share_the_work_of_their_description_not_its_answer(h200_server, build, fewer):
    shared, shared_follows = _described(build())
    alone, alone_follows = _described(build(), share=False)  # each chunk on its own
    assert shared.order == alone.order
    assert shared.specs == alone.specs
    assert shared.estimates == alone.estimates
    assert shared.inputs == alone.inputs
    assert shared_follows * fewer <= alone_follows, (shared_follows, alone_follows)


def test_linearly_fused_chunks_are_followed_once_per_class_of_chunk(h200_server):
    """Random chunks through an elementwise chain into a partial sum: Dask's linear fusion
    gives each chunk an inner graph of its own (its seed, its keys, its random call's keyword
    arguments in a dict of their own). Chunks of one shape are followed once: 12 x 6 blocks of
    4 shapes (each chunk task two follows: its blockwise-fused part is nested), then the tree's
    levels (148 follows before: each chunk's keywords were told apart by identity)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        x = da.random.default_rng(0).random((230, 170), chunks=(20, 30))
        collection = ((x + 1) * 2).sum(axis=0)
    shared, shared_follows = _described(collection)
    alone, alone_follows = _described(collection, share=False)
    assert shared.estimates == alone.estimates
    assert alone_follows >= 2 * 12 * 6
    assert shared_follows <= 2 * 4 + 4, (shared_follows, alone_follows)


def test_reads_are_described_without_being_followed(h200_server, monkeypatch):
    """A read of a stored array has no shape rule (its chunk is the annotation's): it is
    described as following it would, each chunk priced at its own size, without following it
    (a read per chunk, each with indexes of its own: nothing to share)."""
    described, follows = _described(_reads_with_edges())
    monkeypatch.setattr(describe_module, "IO", "no family")  # reads followed as other tasks
    followed, all_follows = _described(_reads_with_edges())
    reads = [k for k, e in described.estimates.items() if e.family == "io"]
    assert len(reads) == 16  # (4 x 4 blocks, read once each)
    assert described.estimates == followed.estimates
    assert described.specs == followed.specs
    assert follows == all_follows - len(reads)
    shapes = {described.specs[k].shape for k in reads}
    assert shapes == {(30, 20), (30, 10), (10, 20), (10, 10)}
    for k in reads:
        assert described.estimates[k].out_bytes == 8 * np.prod(described.specs[k].shape)


def test_fused_graphs_of_one_shape_are_followed_once(h200_server):
    description, follows = _described(_matmul_tree())
    tree_tasks = [k for k in description.estimates if "partial" in str(k[0])]
    assert len(tree_tasks) >= 100  # (one inner graph each)
    # the layers' distinct chunk shapes (15 x 10 blocks, two shapes of chunk) bound the work
    assert follows <= 16, follows


@pytest.mark.parametrize("order", ["ABC", "ACB", "CAB", "BAC"])
def test_one_inner_graph_serving_tasks_that_name_its_inputs_differently(h200_server, order):
    """Tasks may share an inner graph (or have ones of one shape) but name its inputs in
    another order: each is described from its own names, whichever comes first."""
    from dask._task_spec import DataNode, Task, TaskRef, _execute_subgraph

    def fused(key, inner, inkeys, *deps):
        return Task(key, _execute_subgraph, inner, "o", inkeys, *deps)

    p, q = np.ones((10, 20)), np.ones((20, 30))
    inner = {"o": Task("o", np.matmul, TaskRef("a"), TaskRef("b"))}
    same_shape = {"o": Task("o", np.matmul, TaskRef("a"), TaskRef("b"))}
    tasks = {"A": fused("A", inner, ("a", "b"), TaskRef("p"), TaskRef("q")),  # p @ q
             "B": fused("B", inner, ("b", "a"), TaskRef("q"), TaskRef("p")),  # p @ q
             "C": fused("C", same_shape, ("a", "b"), TaskRef("q"), TaskRef("p"))}  # q @ p: fails
    dsk = {"p": DataNode("p", p), "q": DataNode("q", q), **{k: tasks[k] for k in order}}
    description = describe_graph(dsk, ChunkInfo({}), _profile(_current_settings()))
    assert description.specs["A"] == description.specs["B"] == ((10, 30), np.dtype("f8"))
    assert description.specs["C"] is None  # (its shapes do not multiply)


def test_an_index_read_from_a_chunk_is_the_datas_to_say_not_the_stand_ins(h200_server):
    """Shapes of views come from a stand-in chunk with no memory behind it. An integer index
    array selects from it whatever it holds; a boolean mask selects as many elements as it
    holds True, which only the data knows: unknown, as Dask's own chunks are, on every pass
    (a stand-in of uninitialized memory gave 26 elements on one pass and 0 on the next)."""
    import operator

    from eugo_dask.ops import classify_func
    from eugo_dask.shapes import infer_step

    family, name = classify_func(operator.getitem)
    values = ArraySpec((26, 3), np.dtype("f8"))
    for _ in range(3):
        mask = ArraySpec((26,), np.dtype(bool))
        assert infer_step(family, name, operator.getitem, [values, mask], {}).out is None
        index = ArraySpec((5,), np.dtype("i8"))
        assert infer_step(family, name, operator.getitem, [values, index], {}).out == ArraySpec(
            (5, 3), np.dtype("f8"))

    stored = da.from_array(LazyArray(np.arange(26 * 13).reshape(13, 26, 1) % 10), chunks=(1, 26, 1))
    masked = stored[stored > 2].astype("f8")
    first, _ = _described(masked[masked > 4])
    second, _ = _described(masked[masked > 4])
    assert first.estimates == second.estimates
    assert all(spec is None or 0 not in spec.shape for spec in first.specs.values())


def test_a_cast_is_read_not_tried():
    """A cast's dtype is read from the task (NumPy warns of casting complex to real whatever
    the values: trying it on a probe warned during planning); an unsized one (``"U"``) is
    what NumPy makes of it."""
    import operator
    import warnings

    from dask.array.chunk import astype

    from eugo_dask.ops import ELEMENTWISE
    from eugo_dask.shapes import infer_step

    complex_chunk = ArraySpec((3, 2), np.dtype("c16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for func, kwargs in [(astype, {"astype_dtype": "f4"}),
                             (operator.methodcaller("astype", "f4"), {}),
                             (operator.methodcaller("astype", "f4", copy=False), {}),
                             (operator.methodcaller("astype", dtype="f4"), {})]:
            step = infer_step(ELEMENTWISE, "astype", func, [complex_chunk], kwargs)
            assert step.out == ArraySpec((3, 2), np.dtype("f4")), func
    text = infer_step(ELEMENTWISE, "astype", astype, [ArraySpec((3,), np.dtype("f8"))],
                      {"astype_dtype": "U"})
    assert text.out == ArraySpec((3,), np.ones((), "f8").astype("U").dtype)


def _assert_dependency_order(dsk, ordered):
    keys = [k for k, _ in ordered]
    assert sorted(map(str, keys)) == sorted(map(str, dsk))
    assert all(dsk[k] is node for k, node in ordered)
    position = {k: i for i, k in enumerate(keys)}
    for k, node in ordered:
        assert all(position[d] < position[k] for d in node.dependencies if d in dsk), k


@pytest.mark.parametrize("build", [_pipeline, _two_trees, _legacy_random_with_edges,
                                   _reads_with_edges])
def test_dask_graphs_are_ordered_layer_by_layer(build):
    """Dask's graphs (layers that read other layers) are ordered a layer at a time, each
    layer's keys in the graph's order: no lookup by key."""
    from eugo_dask.graph import _layer_order, dependency_order

    x = build()
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    dsk = split_mixed_tasks(task_spec_dict(dask_optimize(graph, keys)),
                            ChunkInfo.from_graph(graph))
    ordered = dependency_order(dsk)
    assert _layer_order(dsk) == ordered
    _assert_dependency_order(dsk, ordered)
    name = [key_name(k) for k, _ in ordered]
    runs = [n for i, n in enumerate(name) if i == 0 or n != name[i - 1]]
    assert len(runs) == len(set(name))  # each layer in one run
    for layer in set(name):
        assert [k for k, _ in ordered if key_name(k) == layer] == \
            [k for k in dsk if key_name(k) == layer]


def test_graphs_whose_layers_read_themselves_or_each_other_are_ordered_key_by_key():
    """A layer that reads its own keys (cumsum's running totals), or two layers that read
    each other key by key, cannot be ordered a layer at a time: key by key, still each key
    after its dependencies; a cycle of keys raises."""
    from dask._task_spec import Alias, DataNode, Task, TaskRef

    from eugo_dask.graph import _layer_order, dependency_order

    x = da.exp(da.random.default_rng(1).random((40, 30), chunks=10)).cumsum(axis=0)
    dsk = split_mixed_tasks(task_spec_dict(dask_optimize(x.__dask_graph__(),
                                                         x.__dask_keys__())),
                            ChunkInfo.from_graph(x.__dask_graph__()))
    assert _layer_order(dsk) is None
    _assert_dependency_order(dsk, dependency_order(dsk))

    crossed = {  # a reads b's first key, b's second key reads a: no cycle of keys
        ("b", 1): Task(("b", 1), np.negative, TaskRef(("a", 0))),
        ("a", 0): Task(("a", 0), np.exp, TaskRef(("b", 0))),
        ("b", 0): DataNode(("b", 0), np.ones(3)),
        "out": Alias("out", ("b", 1)),
    }
    assert _layer_order(crossed) is None
    ordered = dependency_order(crossed)
    _assert_dependency_order(crossed, ordered)
    assert [k for k, _ in ordered].index(("a", 0)) < [k for k, _ in ordered].index(("b", 1))

    cycle = {("a", 0): Task(("a", 0), np.exp, TaskRef(("b", 0))),
             ("b", 0): Task(("b", 0), np.exp, TaskRef(("a", 0)))}
    with pytest.raises(ValueError, match="cycle"):
        dependency_order(cycle)


def test_keys_from_outside_the_graph_are_not_waited_for():
    from dask._task_spec import Task, TaskRef

    from eugo_dask.graph import _layer_order

    dsk = {("b", 0): Task(("b", 0), np.exp, TaskRef(("persisted", 0))),
           ("c", 0): Task(("c", 0), np.add, TaskRef(("b", 0)), TaskRef("elsewhere"))}
    assert [k for k, _ in _layer_order(dsk)] == [("b", 0), ("c", 0)]


def test_keys_that_name_no_layer_are_ordered_key_by_key():
    """A key read as an equal tuple of another type names no layer, and ``()`` has no name:
    such graphs (Dask computes neither) are still ordered, each key after what it reads."""
    from collections import namedtuple

    from dask._task_spec import DataNode, Task, TaskRef

    from eugo_dask.graph import dependency_order

    K = namedtuple("K", "name i")
    odd = {("y", 0): Task(("y", 0), np.negative, TaskRef(K("x", 0))),
           ("x", 0): DataNode(("x", 0), 1)}
    _assert_dependency_order(odd, dependency_order(odd))
    assert [k for k, _ in dependency_order(odd)] == [("x", 0), ("y", 0)]
    empty = {"b": Task("b", np.negative, TaskRef(())), (): DataNode((), 1)}
    assert [k for k, _ in dependency_order(empty)] == [(), "b"]


def test_a_tree_reduction_hands_its_partials_on_as_a_list():
    """``_chunk_sum(_identity_cast(Alias(k1), Alias(k2), typ=list))`` reduces the list of
    partial products its nested task makes: followed through it, the mean's chunk step fused
    after it gives its own small result, not the product's chunk (which the copy of that result
    back to the host was priced at)."""
    x = da.random.default_rng(0).random((2048, 2048), chunks=1024, dtype="f4")
    collection = (x @ x.T).mean(axis=0)
    graph, keys = collection.__dask_graph__(), collection.__dask_keys__()
    dsk = task_spec_dict(dask_optimize(graph, keys))
    description = describe_graph(dsk, ChunkInfo.from_graph(graph), _profile(_current_settings()))
    steps = [(k, est) for k, est in zip(description.task_keys, description.task_estimates)
             if est.detail == "_chunk_sum>mean_chunk"]
    assert steps
    for key, est in steps:
        assert description.specs[key] == ArraySpec((1, 1024), np.dtype("f4")), key
        assert est.out_bytes == 1024 * 4
