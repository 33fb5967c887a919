"""P2P rechunking with eugo on: distributed's shuffle finds its barrier by name
(``shuffle-barrier-<id>``), so the rewrite keeps that name whatever the barrier reads, and the
computation gives plain Dask's result on clusters with a GPU worker beside CPU workers.

Every wait has a timeout: a hang is a failure."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

from eugo_dask.testing import device_tasks, emulated_gpu_cluster, emulated_settings

from .cluster import process_cluster
from .test_plugin import HETEROGENEOUS, placements, received_device_arrays, worker_stats

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


def test_the_rewrite_keeps_every_barrier_name():
    # a partial rechunk: several shuffles, a barrier each
    x = da.from_array(X, chunks=(50, 600))
    y = (np.sin(x) + 1).rechunk((100, 300), method="p2p") @ np.ones((600, 10))
    plain = dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))
    with dask.config.set(emulated_settings()):
        rewritten = dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))
    assert any(isinstance(k, tuple) and k[0].startswith("eugo-gpu") for k in rewritten)
    assert barriers(rewritten) == barriers(plain) != set()
    for key in barriers(rewritten):  # each still waits for all of its shuffle's transfers
        assert len(rewritten[key].dependencies) == len(plain[key].dependencies)
        assert all(dep in rewritten for dep in rewritten[key].dependencies)


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
