"""P2P rechunking with eugo on: distributed's shuffle finds its barrier by name
(``shuffle-barrier-<id>``), so a shuffle the rewrite touches becomes a shuffle of its own (a new
id in its barrier's name, spec, transfers and unpacks), and the computation gives plain Dask's
result on clusters with a GPU worker beside CPU workers, also beside the same computation
without eugo.

Every wait has a timeout: a hang is a failure."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Alias, Task
from dask.array.utils import assert_eq
from dask.core import flatten

from eugo_dask.pass_log import pass_stats
from eugo_dask.testing import device_tasks, emulated_gpu_cluster, emulated_settings

from .cluster import (
    HETEROGENEOUS,
    placements,
    process_cluster,
    received_device_arrays,
    worker_stats,
)

pytestmark = pytest.mark.timeout(240)

X = np.random.default_rng(5).random((600, 600))


def barriers(graph):
    return {k for k in graph if isinstance(k, str) and k.startswith("shuffle-barrier-")}


def through_p2p(x, method="p2p"):
    """Device work on both sides of a P2P rechunk: the transfers read results copied back
    from the device, the unpacked chunks are copied to it (``method="tasks"``: the same
    computation without P2P, whose result plain Dask gives without a cluster)."""
    y = np.exp(x) * 2
    z = y.rechunk((600, 50), method=method)
    return (z @ z.T + 1).sum()


def shuffle_ids_read(node):
    """The 32-hex shuffle ids among a task's arguments, also inside tasks fused into it."""
    found = set()

    def walk(arg):
        if isinstance(arg, str) and len(arg.split("-")[0]) == 32:
            found.add(arg)
        elif isinstance(arg, Task):
            for a in (*arg.args, *arg.kwargs.values()):
                walk(a)
        elif isinstance(arg, dict):
            for a in arg.values():
                walk(a)

    walk(node)
    return found


def test_every_shuffle_the_rewrite_touches_is_a_shuffle_of_its_own():
    """A barrier is found by the name shuffle-barrier-<its spec's id>, and its transfers and
    unpacks name the same id; a shuffle whose transfers read renamed keys gets a new id, so
    no key of it means one thing in plain Dask's graph and another in eugo's."""
    x = da.from_array(X, chunks=(50, 600))
    y = (np.sin(x) + 1).rechunk((100, 300), method="p2p") @ np.ones((600, 10))  # partial: 3
    plain = dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))
    with dask.config.set(emulated_settings()):
        rewritten = dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))
    assert any(isinstance(k, tuple) and k[0].startswith("eugo-gpu") for k in rewritten)
    assert len(barriers(rewritten)) == len(barriers(plain)) > 1
    assert barriers(rewritten).isdisjoint(barriers(plain))
    for key in barriers(rewritten):
        barrier = rewritten[key]
        assert key == f"shuffle-barrier-{barrier.spec.id}"
        assert barrier.args[0] == barrier.spec.id
        assert len(barrier.dependencies) == len(plain[key.rsplit("-", 1)[0]].dependencies)
        for dep in barrier.dependencies:  # transfers (through the alias of a fused one)
            node = rewritten[dep]
            while isinstance(node, Alias):
                node = rewritten[node.target]
            assert shuffle_ids_read(node) == {barrier.spec.id}
        readers = [n for n in rewritten.values() if key in n.dependencies]
        assert readers and all(shuffle_ids_read(n) == {barrier.spec.id} for n in readers)
    shared = plain.keys() & rewritten.keys() - set(flatten(y.__dask_keys__()))
    assert shared and all(rewritten[k] == plain[k] for k in shared)  # (outputs keep names)


def test_a_p2p_rechunk_whose_chunks_are_the_result(caplog):
    """The unpacks read by the compute's finalize (a task of nested lists): only the
    shuffle's own tasks change their id; the pass runs through (distributed's
    test_rechunk_expand failed inside the pass, its graph run unchanged)."""
    a = np.random.default_rng(2).random((10, 10))
    x = np.sin(da.from_array(a, chunks=(5, 5)))
    y = x.rechunk(chunks=((3, 3, 3, 1), (3, 3, 3, 1)), method="p2p")
    errors = pass_stats()["pass_errors"]
    with emulated_gpu_cluster(cpu_workers=1, threads_per_worker=2) as client:
        assert_eq(client.compute(y).result(timeout=120), np.sin(a))
        assert device_tasks(client.cluster.workers["gpu"]) > 0
    assert pass_stats()["pass_errors"] == errors, caplog.text


def test_a_p2p_rechunk_computed_plain_and_with_eugo_at_once(caplog):
    """The same collection submitted without eugo and with it, both in flight: no key of one
    graph with two specs ('Detected different run_spec for key shuffle-barrier-...', which
    distributed warns can cause failures and deadlocks), both results plain Dask's."""
    x = da.from_array(X, chunks=(30, 600))
    expected = through_p2p(x, "tasks").compute(scheduler="sync")
    with emulated_gpu_cluster(cpu_workers=1, threads_per_worker=2) as client:
        y = through_p2p(x)
        with dask.config.set(optimizations=[]):
            plain = client.compute(y)
        with_eugo = client.compute(y)
        assert_eq(plain.result(timeout=120), expected)
        assert_eq(with_eugo.result(timeout=120), expected)
        assert device_tasks(client.cluster.workers["gpu"]) > 0
    assert "different `run_spec`" not in caplog.text


def test_p2p_rechunk_in_a_local_cluster():
    """The issue's minimal case, with an input whose values plain Dask reproduces."""
    x = da.from_array(X, chunks=(30, 600))
    expected = through_p2p(x, "tasks").compute(scheduler="sync")
    with emulated_gpu_cluster(cpu_workers=1, threads_per_worker=2) as client:
        result = client.compute(through_p2p(x)).result(timeout=120)
        gpu = client.cluster.workers["gpu"]
        assert device_tasks(gpu) > 0
    assert_eq(result, expected)


@pytest.mark.slow
def test_p2p_rechunk_on_a_process_cluster(tmp_path):
    """Separate processes; CPU workers that cannot rebuild a device array (as without CuPy):
    the shuffle's transfers and outputs run anywhere, device work on the GPU worker."""
    x = da.from_array(X, chunks=(30, 600))
    expected = through_p2p(x, "tasks").compute(scheduler="sync")
    with process_cluster(tmp_path, workers=HETEROGENEOUS) as (cluster, client):
        with dask.config.set(emulated_settings()):
            result = client.compute(through_p2p(x)).result(timeout=120)
        assert_eq(result, expected)
        runs = placements(client)
        assert {w for _, role, w in runs if role in ("gpu", "todevice", "tohost")} == {"gpu"}
        assert worker_stats(client)["gpu"]["tasks"] == sum(role == "gpu" for _, role, _ in runs) > 0
        assert not any(received_device_arrays(client).values())  # none reached a CPU worker
