"""The pass as a whole: fail-safe, the bridge's copy and pickle semantics, array expressions."""

from __future__ import annotations

import copy
import gc
import logging
import urllib.request

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import eugo_dask
from eugo_dask import array_optimize, eugo, pass_log
from eugo_dask import optimization as optimization_module
from eugo_dask.pass_log import pass_stats

from .conftest import H200_SERVER

A = np.random.default_rng(7).random((200, 200))


def pipeline():
    x = da.from_array(A, chunks=100)
    return (x @ x + 1).sum()


@pytest.fixture
def broken_describe(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in describe")

    monkeypatch.setattr(optimization_module, "describe_graph", fail)
    monkeypatch.setitem(pass_log._stats, "errors_logged", 0)


def test_a_failing_pass_runs_the_graph_unchanged(emulated, broken_describe, caplog):
    with dask.config.set(optimizations=[]):
        expected = pipeline().compute(scheduler="sync")
    before = pass_stats()["pass_errors"]
    with caplog.at_level(logging.ERROR, logger="eugo_dask.optimization"):
        for _ in range(3):
            assert_eq(pipeline().compute(scheduler="sync"), expected)
    assert pass_stats()["pass_errors"] == before + 3
    assert eugo_dask.device_stats()["tasks"] == 0  # ran unchanged, on the CPU
    logged = [r for r in caplog.records if "the pass failed" in r.getMessage()]
    assert len(logged) == 1 and "injected failure in describe" in caplog.text  # with traceback
    assert logged[0].exc_info is not None


def test_bad_settings_are_never_swallowed(emulated, broken_describe):
    with dask.config.set({"eugo.min-speedup": -1}):
        with pytest.raises(ValueError, match="eugo.min-speedup must be a number >= 0; got -1"):
            pipeline().compute(scheduler="sync")
    with dask.config.set({"eugo.profile": "h300"}):
        with pytest.raises(ValueError, match="got 'h300'"):
            pipeline().compute(scheduler="sync")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pass_errors_on_the_schedulers_metrics(broken_describe):
    from distributed import Client, LocalCluster

    from eugo_dask.plugin import EugoSchedulerPlugin

    with LocalCluster(n_workers=1, processes=False, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(EugoSchedulerPlugin())
        before = pass_stats()["pass_errors"]
        settings = {"optimizations": [eugo], "eugo.device": "emulated", "eugo.min-speedup": 0,
                    "eugo.profile": H200_SERVER}
        with dask.config.set(settings):
            assert_eq(pipeline().compute(), (A @ A + 1).sum())
        port = client.scheduler_info()["services"]["dashboard"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("eugo_pass_errors_total"))
    assert float(line.split()[-1]) == before + 1 >= 1


# ---------------------------------------------------------------------------------------------
# Copies of Dask's config (distributed.utils_test's reset_config, apps that save settings)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def restorable_config():
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


def _device_tasks(settings):
    eugo_dask.reset_device_stats()
    with dask.config.set(settings):
        pipeline().compute(scheduler="sync")
    return eugo_dask.device_stats()["tasks"]


def test_a_copy_taken_with_eugo_off_still_turns_on(restorable_config):
    snapshot = copy.deepcopy(dask.config.config)
    dask.config.config.clear()
    dask.config.config.update(copy.deepcopy(snapshot))
    assert _device_tasks({"optimizations": [eugo], "eugo.device": "emulated",
                          "eugo.min-speedup": 0}) > 0


def test_a_copy_taken_with_eugo_on_still_turns_off(restorable_config):
    with dask.config.set({"optimizations": [eugo], "eugo.device": "emulated",
                          "eugo.min-speedup": 0}):
        snapshot = copy.deepcopy(dask.config.config)
    dask.config.config.clear()
    dask.config.config.update(copy.deepcopy(snapshot))
    assert _device_tasks({"optimizations": [], "eugo.device": "emulated",
                          "eugo.min-speedup": 0}) == 0
    assert dask.config.get("array_optimize") is eugo_dask.bridge
    assert copy.copy(eugo_dask.bridge) is eugo_dask.bridge


def _small_matmul():
    x = da.ones((64, 64), chunks=8)
    return (x @ x.T).sum()


def test_the_pass_leaves_no_garbage_for_the_cyclic_collector(emulated):
    """What the pass builds and drops is freed by reference counting as it goes: garbage in
    a reference cycle (a class made per call, closing over the graph being written) kept the
    plan and the intermediate graph alive until the collector ran. (Other garbage, such as
    that of event loops earlier tests left running, is not the pass's.)"""
    x = _small_matmul()
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    eugo(graph, keys)  # first use: imports, caches
    gc.collect()
    gc.disable()
    try:
        out = eugo(graph, keys)
        rewritten = [k for k in dict(out) if "eugo-gpu" in str(k)]
        del out
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds stays in gc.garbage
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith(("eugo_dask", "dask."))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert rewritten
    assert ours == []


def test_the_pass_leaves_the_collector_as_it_found_it(emulated):
    x = _small_matmul()
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    assert gc.isenabled()
    eugo(graph, keys)
    assert gc.isenabled()
    # objects the process froze (gc.freeze, before forking workers) stay frozen
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        eugo(graph, keys)
        # still frozen (gc.unfreeze would leave none; a few may have been freed meanwhile)
        assert gc.get_freeze_count() > frozen - 100
        assert gc.isenabled()
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        eugo(graph, keys)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_garbage_made_before_the_pass_stays_young(emulated):
    """The pass moves the objects it made to the oldest generation; garbage made before it is
    collected first, not moved where only a full collection would find it."""
    import weakref

    class Holder:
        pass

    x = _small_matmul()
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    eugo(graph, keys)
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection: only the pass's own
    try:
        cycle = Holder()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        eugo(graph, keys)
        gc.collect(1)  # a young collection
        assert alive() is None
    finally:
        gc.set_threshold(*thresholds)


def test_the_plan_token_follows_settings_and_profile_file(tmp_path):
    """The token in every key eugo writes is remembered per settings and profile, and is what
    tokenizing them gives: another min-speedup or an edited profile file gives another token."""
    import os
    import time

    import yaml
    from dask.base import tokenize

    from eugo_dask._version import __version__
    from eugo_dask.config import read_settings
    from eugo_dask.optimization import _profile, _token
    from eugo_dask.profile import profile_dict

    path = tmp_path / "p.yaml"
    data = {**profile_dict("h200"), "cpu": "server-x86"}
    path.write_text(yaml.safe_dump(data))

    def token(**settings):
        with dask.config.set({"eugo.device": "emulated", "eugo.profile": str(path), **settings}):
            s = read_settings().resolved()
            p = _profile(s)
            expected = tokenize(s.to_dict(), p, None, __version__)[:8]
            assert _token(s, p) == _token(s, p) == expected
            return expected

    first = token()
    assert token() == first
    # a value that prints alike but tokenizes otherwise (numpy's 2.0 for 2.0) is not served the
    # token remembered for the other one
    from dataclasses import replace

    import numpy as np
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": str(path)}):
        s = read_settings().resolved()
    p = _profile(s)
    for value in (2.0, np.float64(2.0), 2):
        t = replace(s, min_speedup=value)
        assert _token(t, p) == tokenize(t.to_dict(), p, None, __version__)[:8]
    other = token(**{"eugo.min-speedup": 3})
    assert other != first
    data["link"]["h2d_bytes_per_s"] = 1e9
    path.write_text(yaml.safe_dump(data))
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    edited = token()
    assert edited not in (first, other)


# ---------------------------------------------------------------------------------------------
# A graph eugo rewrote before is told by its tasks, not by names anyone can choose
# ---------------------------------------------------------------------------------------------
def _survey(name):
    x = da.from_array(A, chunks=50, name=name)
    return (np.sin(x) @ x.T + 1).sum(axis=0)


@pytest.mark.parametrize("name", ["teugo-gpu-survey", "eugo-tohost-x", "my-eugo-todevice-data"])
def test_a_layer_named_like_eugos_keys_is_planned_as_any_other(name, emulated, monkeypatch):
    """Its name made the pass take the graph for one it had rewritten: explain() planned GPU
    tasks, compute ran none, and Dask's linear fusion was skipped."""
    partial = []
    original = array_optimize.optimize_without_linear_fusion
    monkeypatch.setattr(array_optimize, "optimize_without_linear_fusion",
                        lambda *args: partial.append(args) or original(*args))
    with dask.config.set(optimizations=[]):
        expected = _survey(name).compute(scheduler="sync")
    plan = eugo_dask.explain(_survey(name))
    assert len(plan.gpu_keys) == len(eugo_dask.explain(_survey("survey")).gpu_keys) > 0
    eugo_dask.reset_device_stats()
    result = _survey(name).compute(scheduler="sync")
    assert_eq(result, expected)
    assert eugo_dask.device_stats()["tasks"] == len(plan.gpu_keys)
    assert not partial  # Dask's own optimization, linear fusion included


def test_work_added_to_an_optimized_collection_is_not_taken_for_device_work(emulated):
    """A task Dask fused after the pass (a read blockwise-fused into an add on top of an
    optimized collection) is device work only where eugo's tasks are inside it: a read inside
    made it one, asking for the GPU resource."""

    class Lazy:  # read through getter, as zarr/h5py arrays are
        shape, dtype, ndim = A.shape, A.dtype, A.ndim

        def __getitem__(self, index):
            return A[index]

    a = da.from_array(A, chunks=100)
    (once,) = dask.optimize(np.exp(a) @ a.T)
    z = once + da.from_array(Lazy(), chunks=100)
    graph = z.__dask_optimize__(z.__dask_graph__(), z.__dask_keys__())
    (layer,) = graph.layers.values()
    roles, resources = layer.annotations["eugo"], layer.annotations["resources"]
    added = [k for k in layer.mapping if k[0] == z.name]
    assert len(added) == 4 and not any(map(roles, added)) and not any(map(resources, added))
    assert {roles(k)["role"] for k in layer.mapping if k[0].startswith("eugo-gpu")} == {"gpu"}
    with dask.config.set(optimizations=[]):
        expected = (np.exp(a) @ a.T + A).compute(scheduler="sync")
    assert_eq(z.compute(scheduler="sync"), expected)
