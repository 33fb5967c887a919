"""eugo_dask.testing: users' own gen_cluster and LocalCluster tests with eugo on."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from distributed.utils_test import gen_cluster

from eugo_dask.testing import (
    cpu_path_tasks,
    cpu_worker,
    device_tasks,
    emulated_gpu_cluster,
    emulated_settings,
    gpu_worker,
)

A = np.random.default_rng(9).random((400, 300))


def pipeline():
    x = da.from_array(A, chunks=100)
    return (np.exp(x / 4) @ x.T).sum(axis=0)


EXPECTED = (np.exp(A / 4) @ A.T).sum(axis=0)


@gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
async def test_gen_cluster_with_reset_config_runs_eugo(c, s, gpu, cpu):
    # gen_cluster deep-copied Dask's config (reset_config) before this test: eugo must be on
    result = await c.compute(pipeline())
    assert_eq(result, EXPECTED)
    assert device_tasks(gpu) > 0 and cpu_path_tasks(gpu) == 0
    assert device_tasks(cpu) == 0 and cpu_path_tasks(cpu) == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_cluster_with_an_emulated_gpu_worker():
    with emulated_gpu_cluster(cpu_workers=2) as client:
        assert_eq(client.compute(pipeline()).result(timeout=60), EXPECTED)
        counts = client.run(lambda dask_worker: (dask_worker.name, device_tasks(dask_worker)))
        by_name = dict(counts.values())
        assert by_name["gpu"] > 0 and by_name["cpu-0"] == by_name["cpu-1"] == 0
    assert not dask.config.get("optimizations", None)  # the settings were for the cluster only


@gen_cluster(client=True, nthreads=[gpu_worker()],
             config={**emulated_settings(), "eugo.device-idle-release": "100ms"})
async def test_workers_give_idle_device_memory_back_without_a_thread_of_their_own(c, s, gpu):
    # the eugo worker plugin's periodic callback releases the pool; gen_cluster's thread-leak
    # check fails this test if the device started a releaser thread instead
    import asyncio

    from eugo_dask.plugin import EugoSchedulerPlugin
    from eugo_dask.runtime import get_device

    await c.register_plugin(EugoSchedulerPlugin())
    assert "eugo-idle-release" in gpu.periodic_callbacks
    assert_eq(await c.compute(pipeline()), EXPECTED)
    assert device_tasks(gpu) > 0

    device = get_device("emulated")  # the one the worker used (this process, these settings)

    def held() -> int:
        return sum(o["pool_held_bytes"] for o in device.memory_stats()["ordinals"])

    for _ in range(100):
        if held() == 0:
            break
        await asyncio.sleep(0.05)
    assert held() == 0


USER_TEST = '''
from distributed.utils_test import gen_cluster  # first, as a user's conftest may do

import dask.array as da
import numpy as np
from dask.array.utils import assert_eq

from eugo_dask.testing import cpu_worker, device_tasks, emulated_settings, gpu_worker

A = np.random.default_rng(9).random((200, 200))


@gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
async def test_user_pipeline(c, s, gpu, cpu):
    x = da.from_array(A, chunks=100)
    assert_eq(await c.compute((x @ x.T + 1).sum(axis=0)), (A @ A.T + 1).sum(axis=0))
    assert device_tasks(gpu) > 0
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gen_cluster_runs_eugo_when_distributed_utils_test_is_imported_first(tmp_path):
    """The module docstring's example in a user's project: distributed.utils_test snapshots
    Dask's config on import, before eugo_dask has put its hook there."""
    import subprocess
    import sys

    (tmp_path / "test_user.py").write_text(USER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_user.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout


def test_process_cluster_starts_its_scheduler_again_where_its_port_was_taken(tmp_path,
                                                                              monkeypatch):
    """A port found free can be taken before the scheduler binds it (a worker's own server
    took one in CI, and the client then waited on it for a handshake): the scheduler starts
    again on another port, and the workers start once it listens."""
    import socket

    from eugo_dask import testing

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports = [taken_port]
        free_port = testing.free_port
        monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else free_port())
        with testing.process_cluster(tmp_path, workers={"cpu": {}}) as (cluster, client):
            assert not ports  # the taken port was tried first
            assert cluster.address != f"tcp://127.0.0.1:{taken_port}"
            assert client.submit(sum, [1, 2]).result(timeout=30) == 3


@gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
async def test_an_asynchronous_default_client_is_planned_for_not_a_pass_failure(c, s, gpu, cpu):
    # Dask refuses to hand an asynchronous client to synchronous code (get_scheduler raises);
    # the pass asked it which scheduler it runs on and failed: the graph ran unchanged, counted
    # as a pass error (distributed's test_compute_nested_containers and
    # test_annotations_survive_optimization with eugo on)
    from eugo_dask.pass_log import pass_stats

    before = pass_stats()
    (optimized,) = dask.optimize(pipeline())  # synchronous code under an asynchronous client
    result = await c.compute({"x": [pipeline()], "y": 123})  # a container: planned here
    after = pass_stats()
    assert after["pass_errors"] == before["pass_errors"]
    assert after["graphs_planned"] >= before["graphs_planned"] + 2
    assert_eq(result["x"][0], EXPECTED) and result["y"] == 123
    assert_eq(await c.compute(optimized), EXPECTED)
    assert device_tasks(gpu) > 0
