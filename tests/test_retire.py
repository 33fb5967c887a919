"""Device values never strand a worker: retiring a GPU worker and replicating move its results to workers that cannot rebuild device arrays (no CuPy: the ``poison_device``
preload) as host arrays, and nothing hangs. Separate-process clusters; every wait bounded."""

from __future__ import annotations

import concurrent.futures
import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

from eugo_dask.graph import GPU_PREFIX
from eugo_dask.rewrite import prefixed_key

from .cluster import POISON, SETTINGS, placements, process_cluster, received_device_arrays

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CPU_WORKERS_WITHOUT_CUPY = {"cpu-1": {"extra": ["--preload", POISON]},
                            "cpu-2": {"extra": ["--preload", POISON]}}


def address_of(client, name):
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name)


def bounded(call, *args, timeout=90):
    """``call(*args)`` from another thread, failing (not hanging) after ``timeout`` seconds."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call, *args).result(timeout=timeout)


def device_array(seed):
    """A device array made on the worker it runs on (its emulated device)."""
    from eugo_dask.runtime import usable_device

    return usable_device("emulated").wrap(np.random.default_rng(seed).random((200, 50)))


def eugo_key(i):
    """A key of eugo's own device results (a device task's, as the rewrite names them)."""
    return prefixed_key(f"device-array-{i}", GPU_PREFIX, "test")


def type_name(value):
    return type(value).__name__


def held_types(dask_worker):
    """{key: the type name of the value this worker holds under it}."""
    return {key: type_name(value) for key, value in dask_worker.data.items()}


def test_retiring_the_gpu_worker_where_cpu_workers_have_no_cupy(tmp_path):
    workers = {"gpu": {"gpu": True, "nthreads": 2}, **CPU_WORKERS_WITHOUT_CUPY}
    a = da.random.default_rng(5).random((3000, 3000), chunks=(100, 3000))
    x = np.exp(np.sin(a) ** 2) * 2
    with dask.config.set(optimizations=[]):
        expected = x.sum(axis=1).compute(scheduler="sync")
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            (persisted,) = dask.persist(x)  # device results pile up on the GPU worker
        deadline = time.monotonic() + 30
        while sum(role == "gpu" for _, role, _ in placements(client)) <= 5:
            assert time.monotonic() < deadline, "no device task ran"
            time.sleep(0.01)
        bounded(client.retire_workers, [address_of(client, "gpu")])
        assert sorted(w["name"] for w in client.scheduler_info()["workers"].values()) == \
            ["cpu-1", "cpu-2"]
        with dask.config.set(SETTINGS):
            assert_eq(client.compute(persisted.sum(axis=1)).result(timeout=120), expected)
        assert not any(received_device_arrays(client).values())


@pytest.mark.parametrize("move", ["retire", "replicate"])
def test_device_values_leave_a_gpu_worker_as_host_arrays(tmp_path, move):
    workers = {"gpu-1": {"gpu": True}, "gpu-2": {"gpu": True}, **CPU_WORKERS_WITHOUT_CUPY}
    # (the active memory manager off: its pass every 2 s drops the replicas replicate made)
    no_amm = {"DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False"}
    with process_cluster(tmp_path, workers=workers, scheduler_env=no_amm) as (cluster, client):
        gpu_1 = address_of(client, "gpu-1")
        futures = [client.submit(device_array, i, workers=[gpu_1], key=eugo_key(i))
                   for i in range(12)]
        client.gather(futures)  # (NumPy here: what a client fetches is a host array too)
        if move == "retire":
            # both GPU workers go, so every value must land on a worker without CuPy (which
            # remaining worker takes what is distributed's choice, by their process memory)
            bounded(client.retire_workers, [gpu_1, address_of(client, "gpu-2")])
        else:
            bounded(client.replicate, futures, 4)
        held = client.run(held_types)
        by_name = {w["name"]: held[a] for a, w in client.scheduler_info()["workers"].items()}
        assert not any(received_device_arrays(client).values())
        keys = {f.key for f in futures}
        on_cpu = [by_name[n].get(k) for n in ("cpu-1", "cpu-2") for k in keys]
        copies = 12 if move == "retire" else 24  # each key once, or on each of them
        assert sorted(t for t in on_cpu if t) == ["ndarray"] * copies, by_name
        values = bounded(client.gather, futures)
        assert all(type(v) is np.ndarray for v in values)
        for i, value in enumerate(values):
            np.testing.assert_array_equal(value, np.random.default_rng(i).random((200, 50)))


def test_a_users_own_device_arrays_move_as_they_are(tmp_path):
    """Only eugo's device values are sent as host arrays: a user's own device chunks (a
    map_blocks(cupy.asarray)) reach another GPU worker and the client as device arrays, as in
    plain Dask (gathered as NumPy and fed to the user's next device function, they broke it)."""
    workers = {"gpu-1": {"gpu": True}, "gpu-2": {"gpu": True}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        gpu_1, gpu_2 = address_of(client, "gpu-1"), address_of(client, "gpu-2")
        users = client.submit(device_array, 1, workers=[gpu_1], key="users-device-array")
        ours = client.submit(device_array, 2, workers=[gpu_1], key=eugo_key(2))
        seen = client.gather([client.submit(type_name, f, workers=[gpu_2], pure=False)
                              for f in (users, ours)], direct=True)
        assert seen == ["EmulatedDeviceArray", "ndarray"]  # (a device task copies ours back)
        with dask.config.set({"eugo.device": "emulated"}):  # a client that holds device arrays
            assert type_name(users.result(timeout=60)) == "EmulatedDeviceArray"
            assert type_name(ours.result(timeout=60)) == "ndarray"
