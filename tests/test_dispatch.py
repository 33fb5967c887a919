"""Run-time dispatch of dual tasks (``eugo.dispatch: dual``): the ledger's choice, the plan's
dual layers, the schedule model's ``dual`` policy, and on clusters a dual layer split across
CPU workers and a GPU slot with plain Dask's result, also when the GPU worker dies.

Every wait has a timeout; nothing asserts on wall time."""

from __future__ import annotations

import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Task
from dask.utils import key_split

from eugo_dask import explain
from eugo_dask.dispatch import CPU_UNIT, GPU_UNIT, Ledger
from eugo_dask.schedule import Costs, Machine, simulate

from .conftest import H200_SERVER

DUAL = {"eugo.profile": H200_SERVER, "eugo.device": "none", "eugo.dispatch": "dual"}


def seed_elementwise(n: int = 4096, chunk: int = 1024):
    """The seed's elementwise transform: a creation fused with its transform, per chunk."""
    x = da.random.default_rng(0).random((n, n), chunks=chunk, dtype=np.float32)
    return da.exp(-x * x) * da.sin(x)


# ---------------------------------------------------------------------------------------------
# The ledger's choice
# ---------------------------------------------------------------------------------------------
def test_choose_takes_the_unit_that_finishes_first():
    ledger = Ledger()
    ledger.set_worker("cpu", threads=2, slots=0, now=0.0)
    ledger.set_worker("gpu", threads=0, slots=1, now=0.0)
    # a task of 10 s on a thread, 3 s on the slot (copies included): the slot first
    choices = []
    for _ in range(6):
        choice = ledger.choose("p", 10.0, 3.0, 0.0)
        assert ledger.charge(choice.worker, choice.kind, 10.0 if choice.kind == CPU_UNIT
                             else 3.0, 0.0) is not None
        choices.append((choice.kind, choice.finish))
    # slot at 3, 6, 9, then the threads (10 each) while the slot would end at 12, 15
    assert choices == [(GPU_UNIT, 3.0), (GPU_UNIT, 6.0), (GPU_UNIT, 9.0), (CPU_UNIT, 10.0),
                       (CPU_UNIT, 10.0), (GPU_UNIT, 12.0)]


def test_a_tie_and_a_ledger_without_gpu_slots_go_to_the_cpu():
    ledger = Ledger()
    ledger.set_worker("cpu", threads=1, slots=0, now=5.0)
    assert ledger.choose("p", 1.0, 0.1, 5.0).kind == CPU_UNIT  # no GPU slot at all
    ledger.set_worker("gpu", threads=0, slots=1, now=5.0)
    assert ledger.choose("p", 1.0, 1.0, 5.0) == (CPU_UNIT, "cpu", 0, 6.0)  # a tie
    ledger.remove_worker("cpu")  # no CPU worker: the CPU path runs anywhere, as soon as now
    assert ledger.choose("p", 1.0, 2.0, 5.0) == (CPU_UNIT, None, -1, 6.0)
    assert ledger.choose("p", 1.0, 0.5, 5.0) == (GPU_UNIT, "gpu", 0, 5.5)


def test_settle_moves_the_units_later_work_and_observe_scales_estimates():
    ledger = Ledger()
    ledger.set_worker("gpu", threads=0, slots=1, now=0.0)
    unit, end = ledger.charge("gpu", GPU_UNIT, 4.0, 0.0)
    ledger.charge("gpu", GPU_UNIT, 4.0, 0.0)  # queued behind it: the slot frees at 8
    ledger.settle("gpu", GPU_UNIT, unit, end, now=1.0)  # the first ended 3 s early
    assert ledger.slots["gpu"] == [5.0]
    ledger.settle("gpu", GPU_UNIT, unit, 5.0, now=20.0)  # late: never before now
    assert ledger.slots["gpu"] == [20.0]
    # measured 10x the estimate on the GPU: the prefix's GPU estimates grow towards it
    ledger.observe("p", GPU_UNIT, expected_s=1.0, measured_s=10.0)
    assert ledger.seconds("p", GPU_UNIT, 2.0) == pytest.approx(20.0)
    ledger.observe("p", GPU_UNIT, expected_s=1.0, measured_s=1.0)
    assert 2.0 < ledger.seconds("p", GPU_UNIT, 2.0) < 20.0
    assert ledger.seconds("p", CPU_UNIT, 2.0) == 2.0 and ledger.seconds("q", GPU_UNIT, 2.0) == 2.0


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def test_explain_says_which_layers_are_dual():
    with dask.config.set(DUAL):
        plan = explain(seed_elementwise())
    assert len(plan.dual_keys) == len(plan) == 16
    assert all(d.device == "cpu" and d.dual.slot_s < d.dual.thread_s for d in plan)
    text = str(plan)
    assert "dual: 16 tasks carry both paths" in text and "random-mul 16" in text
    assert "dual: the scheduler picks per task" in plan[plan.dual_keys[0]].reason
    with dask.config.set({**DUAL, "eugo.dispatch": "static"}):
        static = explain(seed_elementwise())
    assert not static.dual_keys and "dual" not in str(static)
    assert [d.device for d in static] == [d.device for d in plan]  # the placement is the same


def test_dual_from_bounds_the_band_and_gpu_dominated_tasks_stay_fixed():
    # the seed's chunks: 0.33x on the GPU with its copies against the CPU's threads
    with dask.config.set({**DUAL, "eugo.dual-from": 0.5}):
        assert not explain(seed_elementwise()).dual_keys
    a = da.random.default_rng(0).random((4096, 4096), chunks=2048, dtype=np.float32)
    with dask.config.set(DUAL):
        plan = explain(a @ a)
    assert plan.gpu_keys and not set(plan.gpu_keys) & set(plan.dual_keys)


def test_a_bad_dispatch_setting_names_the_key_and_the_values():
    with dask.config.set({**DUAL, "eugo.dispatch": "dynamic"}), pytest.raises(
            ValueError, match=r"eugo.dispatch must be one of \['static', 'dual', 'balanced'\]; got 'dynamic'"):
        explain(seed_elementwise())
    with dask.config.set({**DUAL, "eugo.dual-from": -1}), pytest.raises(
            ValueError, match="eugo.dual-from must be a number >= 0; got -1"):
        explain(seed_elementwise())


# ---------------------------------------------------------------------------------------------
# The schedule model
# ---------------------------------------------------------------------------------------------
def test_the_dual_policy_splits_independent_tasks_by_earliest_finish():
    n = 8  # tasks of 4 s on a thread, 1 s on the device, 1 MB in and out
    costs = Costs([("t", i) for i in range(n)], [4.0] * n, [1.0] * n, [1_000_000] * n,
                  [()] * n, frozenset(range(n)), [False] * n, list(range(n)),
                  dual=frozenset(range(n)))
    machine = Machine(cpu_threads=1, gpus=1, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    static, dual = simulate(costs, machine, "static"), simulate(costs, machine, "dual")
    assert static.makespan_s == pytest.approx(32.0) and static.gpu_tasks == 0
    # the slot holds each for 1 s + 1 ms back (no inputs): the 4th task would end there at
    # 4.004 s, on the idle thread at 4 s; every later one ends sooner on the slot than at 8 s
    assert dual.assignment == (0, 0, 0, -1, 0, 0, 0, 0)
    assert dual.makespan_s == pytest.approx(7.007)


# ---------------------------------------------------------------------------------------------
# On clusters
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_dual_layer_splits_across_cpu_workers_and_the_gpu_slot():
    from distributed.utils_test import gen_cluster

    from eugo_dask.plugin import EugoSchedulerPlugin
    from eugo_dask.testing import cpu_path_tasks, cpu_worker, device_tasks, emulated_settings, gpu_worker

    with dask.config.set(optimizations=[]):
        expected = seed_elementwise().compute(scheduler="sync")
    settings = {**emulated_settings(min_speedup=2), "eugo.dispatch": "dual"}

    @gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker(2)], config=settings)
    async def run(client, scheduler, gpu, cpu):
        await client.register_plugin(EugoSchedulerPlugin())
        result = await client.compute(seed_elementwise())
        assert type(result) is np.ndarray and result.dtype == expected.dtype
        np.testing.assert_array_equal(result, expected)
        plugin = scheduler.plugins["eugo"]
        assert plugin.errors == 0
        # what the plugin sent where, and what the workers say they ran
        sent = plugin.summary()["dual"]
        assert sent["gpu"] > 0 and sent["cpu"] > 0 and sent["gpu"] + sent["cpu"] == 16, sent
        assert device_tasks(gpu) == sent["gpu"] and cpu_path_tasks(gpu) == 0
        assert cpu_path_tasks(cpu) == sent["cpu"] and device_tasks(cpu) == 0
        assert sum(role == "dual" for _, role, _ in plugin.placements) == 16
        # planned once (dask.optimize), then computed: the pass runs again over the rewritten
        # graph, finds its dual tasks (eugo-dual-…) by their function and keeps them dual
        (optimized,) = dask.optimize(seed_elementwise() * 2)  # (new keys: nothing held)
        tasks = [k for k, v in dict(optimized.__dask_graph__()).items() if type(v) is Task]
        assert len(tasks) == 16 and all(key_split(k).startswith("eugo-dual-") for k in tasks)
        np.testing.assert_array_equal(await client.compute(optimized), expected * 2)
        again = plugin.summary()["dual"]
        assert again["gpu"] + again["cpu"] == 32, again
        # (where they went follows what the first 16 measured on each kind of unit: the
        # emulated device is NumPy, far slower than the H200 the estimates are for)
        assert {kind for _, kind in plugin.dual.ledger.scale} == {"cpu", "gpu"}

    run()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_gpu_worker_dying_mid_dispatch_hangs_nothing(tmp_path):
    from pathlib import Path

    from .cluster import SETTINGS, placements, process_cluster

    slow = str(Path(__file__).with_name("slow_device.py"))  # 50 ms a device task
    workers = {"gpu": {"gpu": True, "nthreads": 1, "extra": ["--preload", slow]}, "cpu": {}}
    x = seed_elementwise(4096, 512)  # 64 dual tasks, most sent to the slot at first
    with dask.config.set(optimizations=[]):
        expected = x.compute(scheduler="sync")
    settings = {**SETTINGS, "eugo.min-speedup": 2, "eugo.dispatch": "dual"}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(settings):
            future = client.compute(x)
        deadline = time.monotonic() + 60
        while not any(w == "gpu" for _, role, w in placements(client) if role == "dual"):
            assert time.monotonic() < deadline, "no dual task ran on the GPU worker"
            time.sleep(0.02)
        cluster.kill("gpu")
        result = future.result(timeout=120)
        sent = client.run_on_scheduler(
            lambda dask_scheduler: dict(dask_scheduler.plugins["eugo"].dual.sent))
    np.testing.assert_array_equal(result, expected)
    # those sent to the dead worker were sent again: more decisions than tasks
    assert sent["gpu"] > 0 and sent["gpu"] + sent["cpu"] > 64, sent


# ---------------------------------------------------------------------------------------------
# eugo.dispatch: balanced on a cluster: the split made for the cluster's own shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_balanced_places_for_the_cluster_it_runs_on(tmp_path):
    """The seed's transform: for the profile's machine (32 threads, a thread for each of the
    16 chunks) it stays on the CPU under either dispatch; on a cluster of one CPU thread and
    two emulated GPU workers the pass, run on the scheduler, places for that cluster: the
    chunks run on the GPU workers, and the result is plain Dask's."""
    from .cluster import SETTINGS, placements, process_cluster

    x = seed_elementwise()
    with dask.config.set(optimizations=[]):
        expected = x.compute(scheduler="sync")
    balanced = {**SETTINGS, "eugo.min-speedup": 2, "eugo.dispatch": "balanced"}
    with dask.config.set({**balanced, "eugo.device": "none"}):
        assert explain(x).gpu_keys == []  # (the profile's machine)
    workers = {"gpu-1": {"gpu": True}, "gpu-2": {"gpu": True}, "cpu": {"nthreads": 1}}
    with process_cluster(tmp_path, workers=workers) as (_, client):
        with dask.config.set({**SETTINGS, "eugo.min-speedup": 2}):  # static: on the CPU
            np.testing.assert_array_equal(client.compute(x).result(timeout=120), expected)
        assert not [k for k, role, _ in placements(client) if role == "gpu"]
        with dask.config.set({**balanced, "eugo.device": "none"}):
            # explain() with the client connected plans for its cluster too (it planned for
            # the profile's machine: nothing on the GPU, where compute ran every chunk there)
            plan = explain(x)
        shape = plan.schedule.machine
        assert (shape.cpu_threads, shape.gpus) == (1, 2), shape
        assert "on 1 CPU thread and 2 GPUs (the cluster's workers)" in plan.schedule.text()
        with dask.config.set(balanced):
            result = client.compute(x).result(timeout=120)
        assert type(result) is np.ndarray and result.dtype == expected.dtype
        np.testing.assert_array_equal(result, expected)
        ran = [(key_split(k), w) for k, role, w in placements(client) if role == "gpu"]
        assert ran and {w for _, w in ran} <= {"gpu-1", "gpu-2"}, ran
        assert len(plan.gpu_keys) == len(ran)
        assert client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].errors) == 0


@pytest.mark.timeout(120)
def test_explain_reads_the_clusters_workers_not_the_clients_refreshed_cache():
    """The client's cached scheduler identity is replaced every refresh interval by one without
    workers (distributed asks for n_workers=0); explain() must ask the scheduler itself, or it
    plans, now and then, for the profile's machine instead of the cluster's."""
    from distributed import Client, LocalCluster

    from eugo_dask.context import client_workers

    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0", resources={"GPU": 1}) as cluster, \
            Client(cluster):
        seen = []
        for _ in range(200):
            seen.append(client_workers())
            time.sleep(0.002)
    assert all(w == [({"GPU": 1.0}, 1)] * 2 for w in seen), [w for w in seen if len(w or ()) != 2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_explain_does_not_wait_forever_on_a_scheduler_that_does_not_answer(tmp_path, monkeypatch):
    """A scheduler stopped (SIGSTOP: alive, its socket open, nothing answered): explain() plans
    for the profile's machine after eugo_dask.context.SCHEDULER_TIMEOUT_S (it waited forever)."""
    import signal

    from eugo_dask import context

    from .cluster import process_cluster

    monkeypatch.setattr(context, "SCHEDULER_TIMEOUT_S", 1.0)
    with process_cluster(tmp_path, workers={"cpu": {"nthreads": 1}}) as (cluster, client):
        assert context.client_workers() == [({}, 1)]
        scheduler = cluster.procs["scheduler"]
        scheduler.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with dask.config.set({"eugo.device": "none"}):
                plan = explain(da.ones(10, chunks=5) + 1)
            assert time.monotonic() - started < 30
            assert context.client_workers() is None
        finally:
            scheduler.send_signal(signal.SIGCONT)
    assert plan.schedule.machine.gpus == 1  # the profile's machine: its one GPU
