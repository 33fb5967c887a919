"""``dask.config.set(optimizations=[eugo])`` on every scheduler Dask has.

The distributed case that matters: the graph is optimized on the scheduler, so the client's
settings at submission must travel with it. A scheduler in a separate process (started with the
``dask scheduler`` CLI, knowing nothing of the client's config) proves it.
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask import device_stats, eugo, reset_device_stats

from .cluster import process_cluster
from .conftest import H200_SERVER

A = np.random.default_rng(3).random((120, 80))
B = np.random.default_rng(4).random((80, 60))
SETTINGS = {
    "optimizations": [eugo],
    "eugo.device": "emulated",
    "eugo.min-speedup": 0,
    "eugo.profile": H200_SERVER,
}


def pipeline():
    a = da.from_array(A, chunks=40)
    b = da.from_array(B, chunks=30)
    return (np.exp(a / 4) @ b + 1).sum(axis=0)


EXPECTED = (np.exp(A / 4) @ B + 1).sum(axis=0)


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_local_schedulers(scheduler):
    with dask.config.set(SETTINGS):
        reset_device_stats()
        result = pipeline().compute(scheduler=scheduler)
    assert_eq(result, EXPECTED)
    assert type(result) is np.ndarray
    assert device_stats()["tasks"] > 0


def test_processes_scheduler():
    with dask.config.set(SETTINGS):
        x = pipeline()
        graph = x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__())
        result = x.compute(scheduler="processes", num_workers=2)
    assert any(str(k[0] if isinstance(k, tuple) else k).startswith("eugo-gpu") for k in dict(graph))
    assert_eq(result, EXPECTED)  # device counters live in the worker processes


def test_processes_scheduler_pool_runs_the_plan_on_the_device():
    """The pool's processes start with Dask's default config (eugo.device: auto, no emulated
    device): the settings the plan was made under travel with its tasks, so device tasks run on
    the device there, rather than each falling back to the CPU."""
    import dask.multiprocessing

    from eugo_dask.devices.emulated import EmulatedDeviceArray

    with dask.config.set(SETTINGS):
        x = pipeline()
        graph = dict(x.__dask_optimize__(x.__dask_graph__(), x.__dask_keys__()))
        on_device = [k for k in graph if isinstance(k, tuple) and k[0].startswith("eugo-gpu")]
        assert on_device
        # the device results themselves, as the pool's processes made them (a CPU path's
        # result arrives here as a host array, a device array as one of this emulated device)
        results = dask.multiprocessing.get(graph, on_device[:3], num_workers=2)
    assert all(type(r) is EmulatedDeviceArray for r in results), [type(r) for r in results]


def test_local_cluster_in_process():
    with LocalCluster(
        n_workers=1, processes=False, threads_per_worker=2, resources={"GPU": 1},
        dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        with dask.config.set(SETTINGS):
            reset_device_stats()
            x = pipeline()
            assert_eq(x.compute(), EXPECTED)
            assert_eq(client.compute(x).result(), EXPECTED)
            (persisted,) = dask.persist(x)
            assert_eq(persisted.compute(), EXPECTED)
            (computed,) = dask.compute(x)
        assert_eq(computed, EXPECTED)
        assert device_stats()["tasks"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_separate_process_scheduler_uses_client_settings(tmp_path):
    workers = {"gpu-worker": {"gpu": True, "nthreads": 2}, "cpu-worker": {"nthreads": 2}}
    with process_cluster(tmp_path, workers=workers, preload_plugin=False) as (_, client):
        def scheduler_config(dask_scheduler=None):
            import dask as _dask

            return _dask.config.get("optimizations", None), _dask.config.get("eugo.device", None)

        # the scheduler itself has eugo off: its own config never enabled it (eugo_dask may be
        # imported there through the `dask eugo` CLI entry point, with its defaults)
        optimizations, device = scheduler_config_value(client, scheduler_config)
        assert optimizations is None and device in (None, "auto")

        def per_worker_tasks():
            stats = client.run(eugo_dask.device_stats)
            return {client.scheduler_info()["workers"][w]["name"]: s["tasks"]
                    for w, s in stats.items()}

        # without the client setting, nothing goes to the device
        assert_eq(pipeline().compute(), EXPECTED)
        assert set(per_worker_tasks().values()) == {0}

        with dask.config.set(SETTINGS):
            x = pipeline()
            result = x.compute()
            assert_eq(client.compute(x).result(), EXPECTED)
            (persisted,) = dask.persist(x)
            assert_eq(persisted.compute(), EXPECTED)
            (computed,) = dask.compute(x)
        assert_eq(result, EXPECTED)
        assert_eq(computed, EXPECTED)
        tasks = per_worker_tasks()
        # GPU tasks asked for the GPU resource, so only the GPU worker ran device work
        assert tasks["gpu-worker"] > 0 and tasks["cpu-worker"] == 0

        # the client's min-speedup travels too: with a prohibitive margin nothing offloads
        client.run(eugo_dask.reset_device_stats)
        with dask.config.set({**SETTINGS, "eugo.min-speedup": 1e9}):
            assert_eq(pipeline().compute(), EXPECTED)
        assert set(per_worker_tasks().values()) == {0}


def scheduler_config_value(client, func):
    return client.run_on_scheduler(func)
