"""The scheduler plugin on real clusters: GPU work on the GPU worker, aggregation and I/O on CPU
workers, re-routing without a GPU worker, fallbacks counted, and no device array ever sent to a
CPU worker. Clusters here are separate processes started with the ``dask`` CLI."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask.plugin import EugoSchedulerPlugin
from eugo_dask.testing import device_tasks

from .cluster import (
    HETEROGENEOUS,
    POISON,
    SETTINGS,
    placements,
    plugin_summary,
    process_cluster,
    received_device_arrays,
    reported_summary,
    worker_stats,
)
from .pipelines import EXPECTED, pipeline, row_sums
from .pipelines import PIPELINE_A as A
from .pipelines import PIPELINE_B as B

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_heterogeneous_cluster_places_by_role(tmp_path):
    with process_cluster(tmp_path, workers=HETEROGENEOUS) as (cluster, client):
        assert "eugo" in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
        with dask.config.set(SETTINGS):
            result = pipeline().compute()
        assert_eq(result, EXPECTED)
        assert type(result) is np.ndarray
        runs = placements(client)
        by_role: dict[str, set] = {}
        for _, role, worker in runs:
            by_role.setdefault(role, set()).add(worker)
        # every GPU-planned task and transfer ran on the GPU worker
        for role in ("gpu", "todevice", "tohost"):
            assert by_role[role] == {"gpu"}, (role, by_role)
        # every aggregate, finalize and I/O task on a CPU worker
        host = [(k, w) for k, role, w in runs if role == "host"]
        prefixes = {str(k[0] if isinstance(k, tuple) else k).split("-")[0] for k, _ in host}
        assert {"finalize", "array"} <= prefixes, prefixes  # finalize and the reads
        assert any("aggregate" in str(k) for k, _ in host)
        # aggregation and finalize on CPU workers; the reads are root tasks, left unrestricted
        # so the scheduler queues them (they may run on any worker)
        assert {w for k, w in host if not str(k).startswith("('array")} <= {"cpu-1", "cpu-2"}
        # device work only where the device is
        stats = worker_stats(client)
        assert stats["gpu"]["tasks"] > 0 and stats["gpu"]["h2d_count"] > 0
        for name in ("cpu-1", "cpu-2"):
            assert stats[name]["tasks"] == 0 and stats[name]["h2d_count"] == 0
        # no CPU worker was ever sent a device array
        assert all(v == [] for v in received_device_arrays(client).values())
        gpu_run = [k for k, role, _ in runs if role == "gpu"]
        summary = reported_summary(client, len(gpu_run))
        # the counts are the workers' own reports of what ran, and agree with the GPU worker
        assert sum(summary["tasks"]["gpu"].values()) == len(gpu_run) == stats["gpu"]["tasks"]
        assert summary["bytes_h2d"] == stats["gpu"]["h2d_bytes"] >= A.nbytes + B.nbytes
        assert summary["bytes_d2h"] == stats["gpu"]["d2h_bytes"] > 0
        assert summary["estimated_saved_s"] != 0 and summary["errors"] == 0


def test_copies_stay_off_a_worker_advertising_the_resource_at_zero(tmp_path):
    # a copy asks for none of the GPU slot ({GPU: 0}), which a CPU worker started with
    # --resources GPU=0 meets too: there it passed its chunk through (no device), and every
    # kernel reading the chunk copied it again (on the old code 62 of the 64 copies to the device
    # ran there and the GPU worker made 994 copies where the plan said 64)
    workers = {"gpu": {"gpu": True},
               "zero": {"nthreads": 2, "extra": ["--resources", "GPU=0", "--preload", POISON]}}
    x = da.random.default_rng(0).random((2000, 2000), chunks=250)
    y = (np.exp(np.sin(x)) @ x.T).sum(axis=0)
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            result = client.compute(y).result(timeout=120)
        assert_eq(result, y.compute(scheduler="sync"))
        runs = placements(client)
        copies = [(role, w) for _, role, w in runs if role in ("todevice", "tohost")]
        assert {"todevice", "tohost"} <= {role for role, _ in copies}
        assert {w for _, w in copies} == {"gpu"}, sorted(set(copies))
        stats = worker_stats(client)
        assert stats["gpu"]["h2d_count"] == sum(role == "todevice" for role, _ in copies)
        assert stats["zero"]["tasks"] == stats["zero"]["h2d_count"] == 0


def test_no_gpu_worker_runs_cpu_path_with_one_warning(tmp_path):
    workers = {"cpu-1": {}, "cpu-2": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):  # never a hang: a result within a minute
            result = client.compute(pipeline()).result(timeout=60)
        assert_eq(result, EXPECTED)
        deadline = time.monotonic() + 10  # the pass's warning reaches the plugin as an event
        while not plugin_summary(client)["warnings"] and time.monotonic() < deadline:
            time.sleep(0.1)
        summary = plugin_summary(client)
        assert len(summary["warnings"]) == 1
        assert ("no worker advertises the resource 'GPU' (workers advertise: none); this "
                "graph runs unchanged on the CPU") in summary["warnings"][0]
        assert all(s["tasks"] == 0 for s in worker_stats(client).values())


def test_gpu_worker_killed_mid_computation(tmp_path):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    x, expected = row_sums()
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            future = client.compute(x)
        deadline = time.monotonic() + 60
        while not any(role == "gpu" for _, role, _ in placements(client)):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.01)
        assert not future.done()
        cluster.kill("gpu")
        assert_eq(future.result(timeout=120), expected)
        gpu_tasks = [w for _, role, w in placements(client) if role == "gpu"]
        # some GPU tasks ran on the GPU worker, the rest were re-routed to the CPU worker ...
        assert "gpu" in gpu_tasks and "cpu" in gpu_tasks
        # ... which reports having run them on its CPU (the workers' reports, not the plan)
        rerouted = gpu_tasks.count("cpu")
        deadline = time.monotonic() + 20
        while True:
            ran_on_cpu = sum(n for p, n in plugin_summary(client)["tasks"].get("cpu", {}).items()
                             if p.startswith("eugo-gpu"))
            if ran_on_cpu >= rerouted or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ran_on_cpu == rerouted
        assert any("last worker" in w for w in plugin_summary(client)["warnings"])


def test_out_of_memory_in_gpu_task_falls_back_and_is_counted(tmp_path):
    workers = {"gpu": {"gpu": True, "env": {"DASK_EUGO__EMULATED__MEMORY_LIMIT": "1000"}},
               "cpu": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):  # planned for a 16 GiB device ...
            result = pipeline().compute()  # ... run on one with 1000 bytes
        assert_eq(result, EXPECTED)
        stats = worker_stats(client)["gpu"]
        assert stats["fallbacks"] > 0 and stats["tasks"] == 0
        summary = reported_summary(client, stats["fallbacks"])
        # counted from the worker's reports: every GPU task ran its CPU path, none the device
        assert summary["fallbacks"] == {"device-error": stats["fallbacks"]}
        assert list(summary["fallback_reasons"]) == ["device error (out-of-memory): EmulatedOutOfMemoryError"]
        assert not summary["tasks"].get("gpu")


def test_register_plugin_on_local_cluster_reroutes_without_gpu_workers():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(EugoSchedulerPlugin())
        plugin = cluster.scheduler.plugins["eugo"]
        assert isinstance(plugin, EugoSchedulerPlugin)
        with dask.config.set(SETTINGS):
            assert_eq(pipeline().compute(), EXPECTED)
        deadline = time.monotonic() + 10
        while not plugin.warnings and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(plugin.warnings) == 1 and "no worker advertises" in plugin.warnings[0]


def test_in_process_gpu_workers_run_under_their_clients_settings_without_a_false_alarm(caplog):
    # as examples/connect_to_chart.py --quick: the workers start (and eugo's worker plugin checks
    # them) before the client turns eugo on with the emulated device, in the same process
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with caplog.at_level(logging.WARNING, logger="eugo_dask"):
            client.register_plugin(EugoSchedulerPlugin())
            with dask.config.set(SETTINGS):
                assert_eq(client.compute(pipeline()).result(timeout=60), EXPECTED)
        ran = client.run(lambda dask_worker: device_tasks(dask_worker))
        assert sum(ran.values()) > 0  # its device tasks ran on these workers' device
        summary = cluster.scheduler.plugins["eugo"].summary()
        assert summary["workers_without_device"] == {} and summary["invalid_settings"] == {}
        assert not [w for w in summary["warnings"] if "cannot use a device" in w]
        assert "cannot use a device" not in caplog.text


def test_auto_plans_for_the_clusters_gpu_workers(tmp_path):
    # The client has no GPU; eugo.device: auto must mean the cluster's devices, not the client's.
    workers = {"gpu": {"gpu": True, "env": {"DASK_EUGO__DEVICE": "auto"}}, "cpu": {}}
    settings = {**SETTINGS, "eugo.device": "auto"}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(settings):
            assert eugo_dask.read_settings().resolved().device == "none"  # on this client
            assert_eq(pipeline().compute(), EXPECTED)
        gpu_work = [(k, w) for k, role, w in placements(client) if role == "gpu"]
        assert gpu_work and {w for _, w in gpu_work} == {"gpu"}  # planned for, and pinned to, it
        # that worker has no CUDA device here, so its GPU tasks ran their CPU path
        assert worker_stats(client)["gpu"]["tasks"] == 0



def test_each_graph_s_machine_use_is_measured_beside_its_plans_work_bound():
    """The plugin's summary says, per graph, what it got from the machine: the makespan from
    the workers' own compute times, the seconds each kind of work kept its units busy, and the
    work bound of its plan (found by the plan id its tasks carry) on the machine it ran on."""
    from eugo_dask.dashboard import MachineUse
    from eugo_dask.pass_log import recent_plans

    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(EugoSchedulerPlugin())
        with dask.config.set(SETTINGS):
            assert_eq(client.compute(pipeline()).result(timeout=60), EXPECTED)
        plugin = cluster.scheduler.plugins["eugo"]
        deadline = time.monotonic() + 30  # (the last transitions reach the plugin after it)
        while plugin._usage_of and time.monotonic() < deadline:
            time.sleep(0.05)
        (usage,) = plugin.summary()["usage"]
    assert usage["plan"] in {p["id"] for p in recent_plans()}
    assert (usage["cpu_threads"], usage["gpu_slots"]) == (2, 2)  # 4 threads, 2 of them slots
    assert usage["done"] == usage["tasks"] > 0
    assert usage["busy_s"]["gpu"] > 0 and usage["busy_s"]["copies"] > 0
    assert usage["makespan_s"] >= max(usage["busy_s"].values()) / 4  # 4 threads at most
    # a GPU slot runs one device task at a time; copies run beside the kernels, and count
    # while a GPU worker has one in flight: neither more than all of its units
    assert usage["busy"]["gpu"] <= 1.0 + 1e-9 and usage["busy"]["copies"] <= 1.0 + 1e-9
    assert usage["bound_s"] is not None and usage["bound_s"] > 0
    use = MachineUse()
    use.update({"usage": [usage]}, [])
    assert use.source.data["tasks"] == [f"{usage['done']} / {usage['tasks']}"]
    assert use.source.data["ratio"] == [f"{usage['makespan_s'] / usage['bound_s']:.2f}x"]


def test_a_task_error_on_the_device_path_is_raised_as_plain_dask_and_logged_as_it_is(caplog):
    # an integer power with a negative exponent raises in NumPy wherever it runs: the error
    # reached the caller, but every GPU task of the prefix that raised (and those still running
    # when the compute failed) logged and counted "fell back to the CPU (unsupported on device:
    # ValueError ...)", a fallback that never completed
    from eugo_dask.testing import emulated_gpu_cluster

    x = da.ones((256, 256), chunks=64, dtype=int)
    y = (x * 3).map_blocks(np.power, -1, dtype=int) + 1
    with dask.config.set(optimizations=[]), pytest.raises(ValueError) as plain:
        y.compute(scheduler="sync")
    with caplog.at_level(logging.DEBUG, logger="eugo_dask.runtime"), \
            emulated_gpu_cluster(cpu_workers=1) as client:
        with pytest.raises(ValueError) as ours:
            client.compute(y).result(timeout=60)
        time.sleep(0.5)  # (tasks still running when the compute failed end and log)
        summary = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary())
    assert str(ours.value) == str(plain.value)
    assert summary["fallbacks"] == {} and summary["fallback_reasons"] == {}
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("eugo_dask.runtime")]
    assert logged and not [m for m in logged if "fell back" in m], logged
    own = ("eugo: a task of add raised ValueError on the device and again on its CPU path: the "
           "task's own error, raised to the caller as plain Dask raises it; no fallback counted")
    assert all(m.startswith(own) for m in logged), logged


_RELEASE_KERNEL = threading.Event()


def _held_kernel():
    assert _RELEASE_KERNEL.wait(60), "the test never released the kernel"
    return "kernel"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy_asks", [{"GPU": 0}, None])
def test_distributed_runs_a_task_asking_for_a_resource_only_at_its_queues_head(copy_asks):
    # plain distributed, no eugo: the fact the plugin's copy restrictions rest on. A worker
    # keeps every task that asks for a resource in one queue, in priority order, whose head
    # stops the rest while its resources are taken: a task asking for none of the slot
    # ({GPU: 0}) waits behind a kernel waiting for the slot, a thread free beside them; one
    # asking for no resource runs on the free thread
    from distributed.utils_test import gen_cluster

    _RELEASE_KERNEL.clear()

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 2, {"resources": {"GPU": 1}})])
    async def run(client, scheduler, worker):
        running = client.submit(_held_kernel, resources={"GPU": 1}, priority=10, pure=False)
        waiting = client.submit(_held_kernel, resources={"GPU": 1}, priority=9, pure=False)
        copy = client.submit(lambda: "copy", resources=copy_asks, priority=0, pure=False)
        state = worker.state
        deadline = time.monotonic() + 30
        while not (copy.key in state.tasks and waiting.key in state.tasks
                   and state.tasks[running.key].state == "executing"
                   and state.tasks[waiting.key].state == "constrained"
                   and state.tasks[copy.key].state not in ("waiting", "released")):
            assert time.monotonic() < deadline, {k: t.state for k, t in state.tasks.items()}
            await asyncio.sleep(0.01)
        try:
            if copy_asks:  # queued behind the waiting kernel, a thread free
                assert state.tasks[copy.key].state == "constrained"
                assert len(state.executing) == 1 < state.nthreads
            else:  # done while the first kernel still holds the slot
                assert await asyncio.wait_for(copy, 30) == "copy"
                assert state.tasks[running.key].state == "executing"
        finally:
            _RELEASE_KERNEL.set()
        assert await asyncio.wait_for(client.gather([running, waiting, copy]), 60) == [
            "kernel", "kernel", "copy"]

    run()
