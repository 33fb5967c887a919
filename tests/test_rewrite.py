"""The rewritten graph: transfers exactly at the planned boundaries, outputs intact."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Alias
from dask.array.utils import assert_eq
from dask.utils import key_split

import eugo_dask
from eugo_dask import device_stats, eugo

from .pipelines import MATMUL_A as A
from .pipelines import MATMUL_B as B
from .pipelines import matmul_add_sum


def test_matmul_add_sum_moves_each_chunk_once(emulated):
    x = matmul_add_sum()
    with dask.config.set(optimizations=[]):
        expected = x.compute()
    result = x.compute(scheduler="sync")
    assert_eq(result, expected)
    stats = device_stats()
    # one H2D per input chunk (6 of a, 4 of b), although each feeds several matmul partials
    assert stats["h2d_count"] == 6 + 4
    assert stats["h2d_bytes"] == A.nbytes + B.nbytes
    # D2H only for the partial sums (one per output block), not for any matrix block
    assert stats["d2h_count"] == 3 * 2
    assert stats["d2h_bytes"] == 3 * 2 * np.dtype("f8").itemsize
    assert stats["fallbacks"] == 0


def test_matmul_add_sum_placement(emulated):
    x = matmul_add_sum()
    plan = eugo_dask.explain(x)
    by_op = {}
    for d in plan:
        by_op.setdefault(d.op, set()).add(d.device)
    assert by_op["matmul"] == {"gpu"}
    assert by_op["aggregate"] == {"cpu"}  # the final aggregate runs on the CPU
    dsk = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
    prefixes = {key_split(k) for k in dsk}
    assert any(p.startswith("eugo-gpu-") for p in prefixes), prefixes
    assert any(p.startswith("eugo-todevice-") for p in prefixes)
    assert "eugo-gpu-chunk-sum" in prefixes  # the op stays readable in the dashboard
    # no round trip between matmul and add: nothing converts back to host and then to device
    # again, so the only host conversions feed the CPU aggregate
    to_host = [k for k, v in dsk.items() if getattr(v, "func", None) is eugo_dask.runtime.to_host]
    assert len(to_host) == 3 * 2
    from dask._task_spec import Alias

    readers = set(to_host)
    while True:  # every alias that ends at a copy back, however many hops
        more = {k for k, v in dsk.items() if isinstance(v, Alias) and v.target in readers}
        if more <= readers:
            break
        readers |= more
    consumers = {k for k, v in dsk.items()
                 if not isinstance(v, Alias) and set(v.dependencies) & readers}
    assert consumers and all(key_split(k) in ("sum-partial", "sum-aggregate") for k in consumers)
    for k in to_host:  # each copies back a partial sum computed on the device
        (source,) = dsk[k].dependencies
        assert key_split(source) == "eugo-gpu-chunk-sum-aggregate-sum"


def test_copy_back_read_on_the_cpu_takes_its_keys_place(emulated):
    """A device result that CPU tasks read is copied back under the copy's own key, which the
    CPU tasks read directly (no alias between: one task less per chunk); an output keeps its
    key, an alias of its copy back."""
    from dask.core import flatten

    from eugo_dask.runtime import to_host

    x = matmul_add_sum()
    dsk = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
    copies = {k for k, v in dsk.items() if getattr(v, "func", None) is to_host}
    assert len(copies) == 3 * 2
    with dask.config.set(optimizations=[]):
        plain = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
    # (Dask's linear fusion leaves aliases of its own: those stay, renamed where they read a
    # renamed key; the rewrite adds none)
    assert sum(isinstance(v, Alias) for v in dsk.values()) == sum(
        isinstance(v, Alias) for v in plain.values())
    read = set().union(*[v.dependencies for v in dsk.values()])
    assert copies <= read

    y = da.exp(da.from_array(A, chunks=100))
    graph = dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))
    outputs = list(flatten(y.__dask_keys__()))
    for key in outputs:
        assert isinstance(graph[key], Alias)
        assert graph[graph[key].target].func is to_host
    assert_eq(y.compute(scheduler="sync"), np.exp(A))
    assert_eq(x.compute(scheduler="sync"), (A @ B + 1).sum())


def test_gpu_tasks_carry_resource_and_role_annotations(emulated):
    x = matmul_add_sum()
    with dask.config.set({"eugo.resource": "CUDA"}):
        graph = x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__())
    (layer,) = graph.layers.values()
    resources, roles = layer.annotations["resources"], layer.annotations["eugo"]
    by_role: dict = {}
    for key in layer:
        role = roles(key)
        by_role.setdefault(role and role["role"], []).append(key)
        if role is not None and role["role"] in ("gpu", "todevice", "tohost"):
            # kernels hold the GPU slot; copies go to GPU workers without holding it
            assert resources(key) == {"CUDA": 1 if role["role"] == "gpu" else 0}
        else:
            assert resources(key) is None
    assert all(key_split(k).startswith("eugo-gpu") for k in by_role["gpu"])
    assert all(key_split(k).startswith("eugo-todevice") for k in by_role["todevice"])
    assert len(by_role["tohost"]) == 3 * 2
    # aggregation stays on CPU workers in a cluster
    assert {key_split(k) for k in by_role["host"]} == {"sum-partial", "sum-aggregate"}
    gpu_role = roles(by_role["gpu"][0])
    assert gpu_role["cpu_s"] > 0 and gpu_role["est_s"] > 0
    # the annotations survive pickling (they travel to the scheduler)
    import pickle

    assert pickle.loads(pickle.dumps(roles))(by_role["gpu"][0]) == gpu_role


def test_rewritten_tasks_are_what_dasks_constructor_makes(emulated):
    # the rewrite makes its device tasks and copies with their dependencies already worked
    # out (graph.new_task): each must equal Task(...) built from the same parts
    from dask._task_spec import Task

    a = da.from_array(A, chunks=100)
    x = (da.exp(a) @ a.T + da.ones((300, 300), chunks=100)).sum(axis=0) + a.sum()
    graph = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
    written = [v for k, v in graph.items() if key_split(k).startswith("eugo-")]
    kinds = {key_split(task.key).split("-")[1] for task in written}
    assert kinds == {"gpu", "todevice", "tohost"} and len(written) > 10
    for task in written:
        rebuilt = Task(task.key, task.func, *task.args, _data_producer=task.data_producer,
                       **task.kwargs)
        assert task.dependencies == rebuilt.dependencies, task.key
        assert task.dependencies <= graph.keys()
        assert task.data_producer is rebuilt.data_producer
    result = x.compute(scheduler="sync")
    with dask.config.set(optimizations=[]):
        assert_eq(result, x.compute(scheduler="sync"))


def test_rewritten_tree_reductions_are_what_dasks_constructors_make(emulated):
    # a matmul's contraction sums its partial products in a task per chunk,
    # _identity_cast(Alias(k1), Alias(k2), ...) nested in its arguments: moved to the device,
    # the nested task is rebuilt by the rewrite itself, each alias of an input becoming the
    # reference to its device copy (a TaskRef: Task evaluates it as it does the alias)
    from dask._task_spec import Task, TaskRef

    z = da.random.default_rng(0).random((64, 64), chunks=8)
    x = (np.exp(z @ z.T) + 1).sum(axis=0)
    with dask.config.set({"eugo.min-speedup": 0}):
        graph = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
        result = x.compute(scheduler="sync")
    nested = [(task, arg) for k, task in graph.items() if key_split(k).startswith("eugo-gpu")
              for arg in task.args if type(arg) is Task]
    assert len(nested) >= 8 * 8
    for task, arg in nested:
        refs = [a for a in arg.args if isinstance(a, TaskRef)]
        assert refs and not any(isinstance(a, Alias) for a in arg.args)
        for ref in refs:
            assert key_split(ref.key).startswith("eugo-gpu") and ref.key in graph
        assert arg == Task(arg.key, arg.func, *arg.args, **arg.kwargs)
        assert arg.dependencies == {a.key for a in refs} <= task.dependencies
        # evaluated as Dask evaluates the aliases it stands for
        values = {ref.key: np.full(3, i + 1.0) for i, ref in enumerate(refs)}
        aliased = Task(arg.key, arg.func, *[Alias(a.key) for a in refs], **arg.kwargs)
        np.testing.assert_array_equal(arg(values), aliased(values))
    with dask.config.set(optimizations=[]):
        assert_eq(result, x.compute(scheduler="sync"))


def test_device_tasks_read_their_copies_in_their_tasks_dependency_order(emulated):
    """A device task's dependency set is made in the order of the original task's dependencies
    (a frozenset's iteration order follows its insertion order where hashes collide, and
    dask.order breaks ties by it): the same order whichever path the rewrite takes."""
    from dask.array.optimization import optimize as dask_optimize

    from eugo_dask.describe import describe_graph
    from eugo_dask.graph import ChunkInfo, flatten_keys, task_spec_dict
    from eugo_dask.optimization import _current_settings, _Described, _profile, _token
    from eugo_dask.rewrite import Rewrite, rewrite_graph
    from eugo_dask.unfuse import split_mixed_tasks

    settings = _current_settings()
    profile = _profile(settings)
    how = Rewrite(settings.device, settings.resource, _token(settings, profile), {}, {})
    checked = 0
    for x in [(da.ones((60, 40), chunks=(6, 10)) + 1).rechunk((20, 10)).max(axis=0),
              (da.concatenate([da.ones((30, 40), chunks=7) + 1, da.ones((30, 40), chunks=9) * 2])
               + 1).sum(axis=0),
              (da.exp(da.from_array(A, chunks=50)) @ da.from_array(A, chunks=50).T).sum(axis=1)]:
        graph, keys = x.__dask_graph__(), x.__dask_keys__()
        chunks = ChunkInfo.from_graph(graph)
        original = task_spec_dict(dask_optimize(graph, keys))
        dsk = split_mixed_tasks(original, chunks)
        described = _Described(dsk, keys, describe_graph(dsk, chunks, profile), profile)
        plan = described.place(settings)
        rewritten = rewrite_graph(dsk, plan, described.description, original,
                                  flatten_keys(keys), how)
        out = dict(rewritten.graph)
        for key in plan.gpu_keys:
            device_task = out[rewritten.on_device[key].key]
            expected = frozenset([rewritten.on_device[d].key for d in dsk[key].dependencies])
            assert list(device_task.dependencies) == list(expected), key
            checked += 1
    assert checked > 100


def test_renamed_keys_keep_their_place_in_the_graph(emulated):
    """A key the rewrite renames (its task changed, or it reads a renamed key) stays where its
    original key was in the graph's order, as every key it keeps does: dask.order breaks ties by
    that order, so moving renamed keys to the end changed the priorities (SVD's singular
    values: an output and a renamed task swapped)."""
    from dask.array.optimization import optimize as dask_optimize

    from eugo_dask.describe import describe_graph
    from eugo_dask.graph import ChunkInfo, flatten_keys, task_spec_dict
    from eugo_dask.optimization import _current_settings, _Described, _profile, _token
    from eugo_dask.rewrite import Rewrite, rewrite_graph
    from eugo_dask.unfuse import split_mixed_tasks

    settings = _current_settings()
    profile = _profile(settings)
    how = Rewrite(settings.device, settings.resource, _token(settings, profile), {}, {})
    x = da.from_array(np.random.default_rng(0).random((64, 48)), chunks=(16, 48))
    renamed = 0
    for y in [da.linalg.svd(x)[1], x.map_overlap(lambda b: b * 2, depth=1) + 1]:
        graph, keys = y.__dask_graph__(), y.__dask_keys__()
        chunks = ChunkInfo.from_graph(graph)
        original = task_spec_dict(dask_optimize(graph, keys))
        dsk = split_mixed_tasks(original, chunks)
        described = _Described(dsk, keys, describe_graph(dsk, chunks, profile), profile)
        rewritten = rewrite_graph(dsk, described.place(settings), described.description,
                                  original, flatten_keys(keys), how)
        assert rewritten.renames
        renamed += len(rewritten.renames)
        back = {new: old for old, new in rewritten.renames.items()}
        kept = [back.get(k, k) for k in dict(rewritten.graph) if back.get(k, k) in dsk]
        kept_set = set(kept)
        assert kept == [k for k in dsk if k in kept_set]
    assert renamed > 2


@pytest.mark.parametrize("fast", [True, False])
def test_task_constructor_matches_dasks(monkeypatch, fast):
    """graph.new_task fills in the attributes Dask 2026.8's constructor sets; under another
    Dask (other attributes) it calls that constructor. Either way it makes what the constructor
    makes."""
    from dask._task_spec import Task, TaskRef

    from eugo_dask import graph

    monkeypatch.setattr(graph, "_TASK_SLOTS_MATCH", fast and graph._TASK_SLOTS_MATCH)
    args = (TaskRef(("y", 0)), Alias(("x", 1)))
    task = graph.new_task(("z", 0), max, args, {}, frozenset([("y", 0), ("x", 1)]), True)
    expected = Task(("z", 0), max, *args, _data_producer=True)
    assert task == expected
    assert task.dependencies == expected.dependencies and task.data_producer
    assert task({("y", 0): 3, ("x", 1): 5}) == 5


def test_idempotent_through_dask_optimize(emulated):
    x = (da.from_array(A, chunks=100) * 2 + 1).sum(axis=0)
    with dask.config.set(optimizations=[]):
        expected = x.compute()
    (optimized,) = dask.optimize(x)  # runs the pass once ...
    eugo_dask.reset_device_stats()
    result = optimized.compute(scheduler="sync")  # ... and compute runs it again
    assert_eq(result, expected)
    stats = device_stats()
    assert stats["tasks"] > 0
    # transfers were not duplicated by the second pass
    assert stats["h2d_count"] == 6
    graph = optimized.__dask_optimize__(optimized.__dask_graph__(), optimized.__dask_keys__())
    gpu_prefixes = [key_split(k) for k in dict(graph) if key_split(k).startswith("eugo-gpu")]
    assert not any(p.startswith("eugo-gpu-eugo") for p in gpu_prefixes)


def test_optimizing_an_optimized_collection_changes_nothing(emulated, monkeypatch):
    """dask.optimize twice (or optimize, then compute): Dask's linear fusion must not glue
    eugo's copies to the reads and host tasks beside them the second time."""
    a = da.from_array(A, chunks=100)
    x = (np.exp(a) @ a.T).sum(axis=0)
    (once,) = dask.optimize(x)
    set_config = dask.config.set
    settings_made = []

    def recording_set(*args, **kwargs):
        settings_made.append((args, kwargs))
        return set_config(*args, **kwargs)

    monkeypatch.setattr(dask.config, "set", recording_set)  # no process-wide switch that
    (twice,) = dask.optimize(once)                            # other threads would see
    monkeypatch.undo()
    assert not [s for s in settings_made if "optimization.fuse.active" in repr(s)]
    graph = dict(once.__dask_graph__())
    assert dict(twice.__dask_graph__()).keys() == graph.keys()
    assert any(key_split(k).startswith("eugo-todevice") for k in graph)
    with dask.config.set(optimizations=[]):
        assert_eq(twice.compute(scheduler="sync"), x.compute(scheduler="sync"))
    # what is built on top is still optimized (culled) as Dask would: a slice computes a part
    (part,) = dask.optimize(once[:1])
    assert len(dict(part.__dask_graph__())) < len(graph)


def test_direct_pass_keeps_output_keys_and_culls(emulated):
    x = da.from_array(A, chunks=100) * 2
    keys = x.__dask_keys__()
    dsk = eugo(x.__dask_graph__(), keys)
    flat = [k for row in keys for k in row]
    assert set(flat) <= set(dict(dsk))
    # culling to one output keeps only what that output needs
    from dask._task_spec import cull
    culled = cull(dict(dsk), [flat[0]])
    assert len(culled) < len(dict(dsk))
    result = dask.get(culled, flat[0])
    np.testing.assert_array_equal(result, A[:100, :100] * 2)
    assert type(result) is np.ndarray


def test_slice_after_offload_computes_only_needed(emulated):
    x = np.sin(da.from_array(A, chunks=100))
    result = x[:10, :10].compute(scheduler="sync")
    np.testing.assert_allclose(result, np.sin(A[:10, :10]))
    assert device_stats()["h2d_count"] == 1


def test_persist_then_compute(emulated):
    x = np.exp(da.from_array(A, chunks=100)) @ da.from_array(B, chunks=100)
    (p,) = dask.persist(x, scheduler="sync")
    for block in p.__dask_graph__().values():
        value = block.value if hasattr(block, "value") else block
        assert type(value) is np.ndarray
    assert_eq(p.sum(), (np.exp(A) @ B).sum())


def test_no_device_leaves_graph_unchanged():
    x = np.sin(da.from_array(A, chunks=100)) + 1
    for device in ("none", "auto"):  # auto: no CUDA device on this machine
        with dask.config.set({"optimizations": [eugo], "eugo.device": device}):
            graph = x.__dask_graph__()
            assert eugo(graph, x.__dask_keys__()) is graph


def test_importing_changes_no_graph():
    x = (np.sin(da.from_array(A, chunks=100)) @ da.from_array(B, chunks=100)).sum()
    from dask.array.optimization import optimize

    with dask.config.set({"eugo.device": "emulated", "eugo.min-speedup": 0}):
        ours = x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__())
        plain = optimize(x.__dask_graph__(), x.__dask_keys__())
    assert dict(ours).keys() == dict(plain).keys()


def test_device_out_of_memory_falls_back_to_cpu(emulated, caplog):
    x = np.exp(da.from_array(A, chunks=100)) * 2
    (planned,) = dask.optimize(x)  # placed for a device with room
    # ... then run on a device too small for one chunk
    with dask.config.set({"eugo.emulated.memory-limit": 1000}):
        result = planned.compute(scheduler="sync")
    np.testing.assert_allclose(result, np.exp(A) * 2)
    stats = device_stats()
    assert stats["tasks"] == 0
    assert stats["fallback_reasons"] == {"device error (out-of-memory): EmulatedOutOfMemoryError": 6}
    warnings = [r for r in caplog.records if "fell back to the CPU" in r.getMessage()]
    assert len(warnings) == 1  # logged once per task prefix


def test_tasks_without_keywords_share_one_empty_dict_that_running_them_leaves_empty(emulated):
    """The device tasks and copies eugo writes without keyword arguments share one empty dict
    (a dict each was an allocation per task of graphs a million tasks large): Dask only reads
    it, so running, pickling and unpickling the graph leave it empty."""
    import pickle

    from eugo_dask.graph import NO_KWARGS

    z = da.random.default_rng(0).random((64, 64), chunks=8)
    x = (np.exp(z @ z.T) + 1).sum(axis=0)
    with dask.config.set({"eugo.min-speedup": 0}):
        graph = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
        result = x.compute(scheduler="sync")
    written = [t for k, t in graph.items() if key_split(k).startswith("eugo-")]
    assert sum(t.kwargs is NO_KWARGS for t in written) > len(written) // 2
    pickle.loads(pickle.dumps(graph))
    assert NO_KWARGS == {}
    with dask.config.set(optimizations=[]):
        assert_eq(result, x.compute(scheduler="sync"))


def test_renaming_a_task_is_dasks_substitute():
    """The rewrite renames the keys a task reads with a substitute of its own (Dask's reads
    its constructor's signature on every call): the same task as Dask's, nested tasks,
    keyword arguments and ``data_producer`` included."""
    from dask._task_spec import DataNode, Task, TaskRef
    from dask.array.optimization import optimize as dask_optimize

    from eugo_dask.graph import task_spec_dict
    from eugo_dask.rewrite import _renamed_node, renamed_key

    x = da.random.default_rng(0).random((40, 40), chunks=10)
    y = (da.sin(x) + x.T).mean(axis=0, split_every=2) + x.map_overlap(lambda b: b, depth=1).sum()
    dsk = dict(task_spec_dict(dask_optimize(y.__dask_graph__(), y.__dask_keys__())))
    dsk["hand"] = Task("hand", np.add, Task("inner", np.negative, TaskRef(("a", 0))),
                       DataNode(None, 2), out=Alias(("a", 1)), _data_producer=True)
    renames = {k: renamed_key(k, "tok") for i, k in enumerate(dsk) if i % 3 == 0}
    renames.update({("a", 0): ("b", 0), ("a", 1): ("b", 1)})
    compared = nested = 0
    for key, node in dsk.items():
        ours = _renamed_node(key, node, renames)
        dasks = node.substitute(renames, key=renames.get(key, key))
        assert type(ours) is type(dasks) and ours.key == dasks.key, key
        assert ours.dependencies == dasks.dependencies, key
        assert ours == dasks, key
        if type(node) is Task:
            assert ours.data_producer == dasks.data_producer
            compared += not renames.keys().isdisjoint(node.dependencies)
            nested += any(type(a) is Task for a in node.args)
    assert compared > 20 and nested > 5
    hand = _renamed_node("hand", dsk["hand"], renames)
    assert hand.dependencies == {("b", 0), ("b", 1)} and hand.data_producer
    assert hand({("b", 0): 3.0, ("b", 1): None}) == -1.0


def test_device_values_under_names_dasks_linear_fusion_makes_are_eugos():
    """Dask's linear fusion run over a rewritten graph (the bag and delayed optimizers do it:
    ``db.from_delayed(x.to_delayed())``) moves a device task's value to a name it makes from
    the chain's names, sorted: ``array-eugo-todevice-...-eugo-gpu-add-...``, with the device
    task's own key an alias of it. The worker's ``get_data`` sends a device value as a host
    array only where ``holds_eugo_device_value`` names it eugo's: both keys must be."""
    from dask._task_spec import fuse_linear_task_spec

    from eugo_dask.graph import holds_eugo_device_value
    from eugo_dask.testing import emulated_settings

    x = da.from_array(np.random.default_rng(0).random((400, 400)), chunks=100)
    y = np.sin(x) * 2 + 1
    z = y @ y.T + y
    with dask.config.set(emulated_settings()):
        parts = z.to_delayed().ravel().tolist()
    graph = dict(parts[0].dask)
    fused_graph = fuse_linear_task_spec(graph, [p.key for p in parts])
    aliases = {k: v.target for k, v in fused_graph.items()
               if isinstance(v, Alias) and holds_eugo_device_value(k)}
    assert aliases  # device values the fusion moved
    missed = sorted({str(t[0] if isinstance(t, tuple) else t) for t in aliases.values()
                     if not holds_eugo_device_value(t)})
    assert not missed, missed
