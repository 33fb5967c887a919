"""Cluster truth, on separate-process clusters (``dask scheduler``, ``dask worker``): counts from
what workers ran, nothing that hangs, reads still queued and paced to the device, user
annotations kept, a plugin registered from a client equal to the preload, bad settings reported
where they are made, and input from clients or workers that cannot poison the scheduler's
counters.

Every wait has a timeout: a hang is a failure, never a stuck CI."""

from __future__ import annotations

import logging
import time
import urllib.request
import warnings
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from dask.utils import key_split
from distributed import Client, span
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

import eugo_dask
from eugo_dask.plugin import MAX_PREFIXES, EugoSchedulerPlugin
from eugo_dask.worker import REPORT_OP

from .cluster import SETTINGS, placements, plugin_summary, process_cluster, worker_stats
from .pipelines import EXPECTED, pipeline, row_sums

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def wait_until(predicate, timeout=30, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def gpu_tasks_reported(client):
    """GPU tasks the workers report having run, on the device and on their CPU path."""
    tasks = plugin_summary(client)["tasks"]
    return (sum(tasks.get("gpu", {}).values()),
            sum(n for p, n in tasks.get("cpu", {}).items() if p.startswith("eugo-gpu")))


# ---------------------------------------------------------------------------------------------
# 1. Counts from what ran
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu_worker_device", ["emulated", "none"])
def test_gpu_counts_are_what_the_workers_did(tmp_path, gpu_worker_device):
    workers = {"gpu": {"gpu": True, "env": {"DASK_EUGO__DEVICE": gpu_worker_device}},
               "cpu": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            assert_eq(pipeline().compute(), EXPECTED)
        planned = [k for k, role, _ in placements(client) if role == "gpu"]
        assert planned
        reported = wait_until(lambda: sum(gpu_tasks_reported(client)) >= len(planned) and
                              gpu_tasks_reported(client))
        on_device, on_cpu = reported
        stats = worker_stats(client)
        summary = plugin_summary(client)
        assert on_device == stats["gpu"]["tasks"] and on_device + on_cpu == len(planned)
        assert summary["bytes_h2d"] == stats["gpu"]["h2d_bytes"]
        if gpu_worker_device == "emulated":
            assert on_device == len(planned) and summary["fallbacks"] == {}
            assert summary["workers_without_device"] == {}
        else:  # a GPU worker that cannot use a device: nothing counted as GPU work, and said
            assert on_device == 0 and summary["bytes_h2d"] == 0
            assert summary["fallbacks"] == {"no-device": len(planned)}
            (reason,) = summary["workers_without_device"].values()
            assert reason == "eugo.device is 'none' on this worker"
            assert any("cannot use a device" in w for w in summary["warnings"])
            assert "cannot use a device" in cluster.logs()
            port = client.scheduler_info()["services"]["dashboard"]
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
            assert b"eugo_gpu_workers_without_device 1.0" in text


def test_masked_chunks_stay_on_the_host_and_count_there(tmp_path):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    data = np.ma.masked_greater(np.arange(400.0).reshape(20, 20), 300)
    x = np.exp(da.from_array(data, chunks=10) / 100)
    with dask.config.set(SETTINGS):
        plan = eugo_dask.explain(x)
    assert not plan.gpu_keys  # no device holds a masked chunk
    assert any("chunks of type numpy.ma.MaskedArray stay on the host" in d.reason for d in plan)
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            result = x.compute()
        assert_eq(result, np.exp(data / 100))
        assert not [k for k, role, _ in placements(client) if role == "gpu"]
        assert not plugin_summary(client)["tasks"].get("gpu")
        assert all(s["tasks"] == 0 for s in worker_stats(client).values())


# ---------------------------------------------------------------------------------------------
# 2. register_plugin is the preload
# ---------------------------------------------------------------------------------------------
def test_register_plugin_equals_the_preload(tmp_path):
    workers = {"gpu": {"gpu": True, "env": {"DASK_EUGO__DEVICE": "emulated"}}, "cpu": {}}
    with process_cluster(tmp_path, workers=workers, preload_plugin=False) as (cluster, client):
        client.register_plugin(EugoSchedulerPlugin())
        # auto: planned for the cluster's GPU workers although this client has no GPU
        with dask.config.set({**SETTINGS, "eugo.device": "auto"}):
            assert_eq(pipeline().compute(), EXPECTED)
        assert {w for _, role, w in placements(client) if role == "gpu"} == {"gpu"}
        port = client.scheduler_info()["services"]["dashboard"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        assert b"eugo_tasks_total" in text and b"eugo_pass_errors_total" in text
        # the worker plugin came with it: each worker says what it can use
        devices = client.run(lambda dask_worker: (dask_worker.name, dask_worker.eugo_device))
        assert sorted(devices.values(), key=str) == [("cpu", None), ("gpu", "emulated")]
        # cupy on a scheduler without CuPy: planned for the workers, no ImportError
        with dask.config.set({**SETTINGS, "eugo.device": "cupy"}):
            assert_eq(pipeline().compute(), EXPECTED)


# ---------------------------------------------------------------------------------------------
# 3. Nothing hangs
# ---------------------------------------------------------------------------------------------
def test_retiring_the_gpu_worker_mid_computation(tmp_path):
    workers = {"gpu": {"gpu": True, "nthreads": 2}, "cpu-1": {}, "cpu-2": {}}
    a = da.random.default_rng(5).random((3000, 3000), chunks=(100, 3000))
    x = np.exp(np.sin(a) ** 2) * 2
    y = x.sum(axis=1)
    with dask.config.set(optimizations=[]):
        expected = y.compute(scheduler="sync")
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            (persisted,) = dask.persist(x)  # device results pile up on the GPU worker
        wait_until(lambda: sum(1 for _, role, w in placements(client) if role == "gpu") > 5,
                   every=0.01)
        address = next(a for a, w in client.scheduler_info()["workers"].items()
                       if w["name"] == "gpu")
        client.retire_workers([address])  # its results move to the CPU workers as host arrays
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 2)
        assert len(client.scheduler_info()["workers"]) == 2
        with dask.config.set(SETTINGS):
            assert_eq(persisted.sum(axis=1).compute(), expected)


def test_a_misspelt_key_in_the_schedulers_environment_is_reported(tmp_path):
    with process_cluster(tmp_path, workers={"cpu": {}},
                         scheduler_env={"DASK_EUGO__RESORCE": "GPU2"}) as (cluster, client):
        (warning,) = [w for w in plugin_summary(client)["warnings"] if "scheduler's" in w]
        assert "unknown setting eugo.resorce" in warning and "eugo.resource" in warning
        assert "scheduler's settings" in cluster.logs()


def gpu_run_specs(dask_scheduler):
    """The states and run specs of the GPU tasks the scheduler still holds."""
    plugin = dask_scheduler.plugins["eugo"]
    return {str(k): (ts.state, repr(ts.run_spec)) for k in plugin.gpu_keys
            if (ts := dask_scheduler.tasks.get(k)) is not None}


def _inject_a_sticky_fault():
    """In the GPU worker: its emulated device fails as CUDA after an illegal address, at the
    next task's synchronisation, and stays broken (every later call raises again)."""
    import os

    from eugo_dask.runtime import get_device

    get_device("emulated").inject_fault("sticky", where="sync")
    return os.getpid()


def test_a_sticky_error_restarts_the_gpu_worker_and_its_keys_are_recomputed(tmp_path):
    # issue 31: a sticky CUDA error left the worker running with its device keys lost: the task
    # that hit it fell back to its CPU path, which could not read its device inputs, and failed
    workers = {"gpu": {"gpu": True, "extra": ["--nanny"]}, "cpu": {}}
    a = da.random.default_rng(7).random((1200, 400), chunks=(100, 400))
    x = np.exp(np.sin(a) ** 2) * 2
    with dask.config.set(optimizations=[]):
        expected = (x + 1).sum(axis=1).compute(scheduler="sync")
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        def gpu_address():
            return next((a for a, w in client.scheduler_info()["workers"].items()
                         if w["name"] == "gpu"), None)

        first = gpu_address()
        pid = client.run(_inject_a_sticky_fault, workers=[first])[first]
        with dask.config.set(SETTINGS):
            result = client.compute((x + 1).sum(axis=1)).result(timeout=120)
        assert_eq(result, expected)
        assert wait_until(lambda: gpu_address() not in (None, first), timeout=60)
        again = gpu_address()
        assert client.run(lambda: __import__("os").getpid(), workers=[again])[again] != pid
        closing = [e for _, e in client.get_events(first)
                   if isinstance(e, dict) and e.get("action") == "closing-worker"]
        assert closing and closing[0]["reason"].startswith("eugo: device memory lost (sticky error")
        # the fresh worker's device works: GPU tasks run there again
        with dask.config.set(SETTINGS):
            assert_eq(client.compute((x + 1).sum(axis=1)).result(timeout=120), expected)
        assert worker_stats(client)["gpu"]["tasks"] > 0


def test_the_gpu_worker_leaving_after_its_work_is_done(tmp_path):
    """The GPU tasks of a finished computation whose result is still held are released, not
    pending: when the GPU worker leaves, they are not re-routed (their run specs were rewritten
    to the CPU path) and nothing warns that pending GPU tasks run their CPU path."""
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    x, expected = row_sums()
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            future = client.compute(x)
        assert_eq(future.result(timeout=120), expected)
        before = client.run_on_scheduler(gpu_run_specs)
        assert before and {state for state, _ in before.values()} == {"released"}
        cluster.kill("gpu")
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 1)
        assert client.run_on_scheduler(gpu_run_specs) == before
        assert not any("left" in w for w in plugin_summary(client)["warnings"])
        assert_eq(future.result(timeout=60), expected)


def test_same_collection_plain_and_with_eugo_at_once(tmp_path):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    y = da.random.RandomState(0).random((2000, 2000), chunks=500).rechunk((250, 2000)).sum(axis=1)
    with dask.config.set(optimizations=[]):
        expected = y.compute(scheduler="sync")
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        for _ in range(4):
            plain = client.compute(y)
            plain.result(timeout=30)  # held: its keys stay on the scheduler
            with dask.config.set({**SETTINGS, "eugo.min-speedup": 0}):
                assert_eq(client.compute(y).result(timeout=30), expected)
            with dask.config.set({**SETTINGS, "eugo.min-speedup": 0, "eugo.profile": "t4"}):
                assert_eq(client.compute(y).result(timeout=30), expected)
            del plain
        assert "Detected different `run_spec`" not in cluster.logs()


def test_device_out_of_memory_while_receiving(tmp_path):
    workers = {"gpu-1": {"gpu": True},
               "gpu-2": {"gpu": True, "env": {"DASK_EUGO__EMULATED__MEMORY_LIMIT": "1000"}}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            assert_eq(client.compute(pipeline()).result(timeout=60), EXPECTED)


@pytest.mark.parametrize("case", ["resource-mismatch", "no-plugin-no-gpu-worker"])
def test_unsatisfiable_resource_request_is_never_made(tmp_path, case):
    if case == "resource-mismatch":  # the client asks for "gpu", the workers offer "GPU"
        workers, preload, settings = {"gpu": {"gpu": True}, "cpu": {}}, True, {"eugo.resource": "gpu"}
    else:
        workers, preload, settings = {"cpu-1": {}, "cpu-2": {}}, False, {}
    resource = settings.get("eugo.resource", "GPU")
    told = f"no worker advertises the resource {resource!r}"
    with process_cluster(tmp_path, workers=workers, preload_plugin=preload) as (cluster, client):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with dask.config.set({**SETTINGS, **settings}):
                assert_eq(client.compute(pipeline()).result(timeout=30), EXPECTED)
            events = wait_until(lambda: client.get_events("eugo"))
            if case == "resource-mismatch":  # likely a misspelt resource: the client hears of it
                assert wait_until(lambda: [w for w in caught if told in str(w.message)
                                           and w.category is RuntimeWarning])
            else:  # no GPU worker at all is no mistake: the CPU run is silent on the client
                time.sleep(1)
                assert not [w for w in caught if told in str(w.message)]
        assert any(told in e[1].get("warning", "") for e in events)
        assert told in cluster.logs()


_OTHER_RESOURCE = ("eugo: no worker advertises the resource 'GPU' (workers advertise: "
                   "['FOO']); this graph runs unchanged on the CPU")


def _two_graphs(compute):
    """Two graphs computed with ``compute``, and the RuntimeWarnings the client saw of
    :data:`_OTHER_RESOURCE` (once the scheduler's events for both have arrived)."""
    x = da.random.default_rng(0).random((256, 256), chunks=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dask.config.set(SETTINGS):
            for y in ((np.sin(x) + 1).sum(), (np.cos(x) * 2).mean()):
                compute(y)
        seen = wait_until(lambda: len([w for w in caught if _OTHER_RESOURCE in str(w.message)])
                          >= 2, timeout=10)
        time.sleep(0.5)  # (a third would have arrived by now)
    assert seen
    return [w for w in caught if _OTHER_RESOURCE in str(w.message)]


def test_a_misspelt_resource_is_said_once_per_graph(tmp_path):
    # workers advertising another resource: the scheduler's log said it twice per graph (the
    # pass's line, and the plugin's on receiving the pass's event)
    workers = {"cpu-1": {"extra": ["--resources", "FOO=1"]}, "cpu-2": {"extra": ["--resources", "FOO=1"]}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        told = _two_graphs(lambda y: client.compute(y).result(timeout=60))
        assert [w.category for w in told] == [RuntimeWarning, RuntimeWarning]
        kept = wait_until(lambda: len(plugin_summary(client)["warnings"]) >= 2, timeout=10)
        assert kept and plugin_summary(client)["warnings"] == [_OTHER_RESOURCE] * 2
        assert (tmp_path / "scheduler.log").read_text().count(_OTHER_RESOURCE) == 2


@pytest.mark.parametrize("plugin", [True, False])
def test_a_misspelt_resource_is_said_once_per_graph_in_the_clients_process(plugin, caplog):
    # a LocalCluster's scheduler runs in its client's process: the client saw its
    # RuntimeWarning and, beside it, the scheduler's log line (twice with the plugin)
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, resources={"FOO": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        if plugin:
            client.register_plugin(EugoSchedulerPlugin())
        with caplog.at_level(logging.WARNING):
            told = _two_graphs(lambda y: y.compute())
        logged = [r for r in caplog.records if _OTHER_RESOURCE in r.getMessage()]
        assert (len(told), len(logged)) == (2, 0)


# ---------------------------------------------------------------------------------------------
# 4. Reads stay queued root tasks, paced to the device
# ---------------------------------------------------------------------------------------------
class _Lazy:
    """A zarr/h5py-like array read through ``getter``."""

    def __init__(self, shape):
        self.shape, self.dtype, self.ndim = shape, np.dtype("f4"), len(shape)

    def __getitem__(self, index):
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape))
        return np.full(shape, 0.5, dtype="f4")


SLOW_DEVICE = str(Path(__file__).with_name("slow_device.py"))


class FinishOrder(SchedulerPlugin):
    """The task prefixes in the order their tasks finish, as the scheduler records them."""

    name = "finish-order"

    def __init__(self):
        self.finished = []

    def transition(self, key, start, finish, *args, **kwargs):
        if start == "processing" and finish == "memory":
            self.finished.append(key_split(key))


def most_reads_ahead(finished):
    """The most reads finished whose device task had not: reads finished minus device tasks
    finished (one per read here), at its highest after any task finished."""
    ahead = most = 0
    for prefix in finished:
        ahead += (prefix == "array") - prefix.startswith("eugo-gpu")
        most = max(most, ahead)
    return most


def reads_as_scheduled(dask_scheduler):
    """Each read the scheduler holds: its state, whether it is root-ish (queued where workers
    are busy), restricted to workers, asking for resources, and marked a data producer."""
    return [(ts.state, dask_scheduler.is_rootish(ts), bool(ts.worker_restrictions),
             bool(ts.resource_restrictions), ts.run_spec.data_producer)
            for ts in dask_scheduler.tasks.values() if ts.prefix.name == "array"]


@pytest.mark.parametrize("read_ahead", [2, None])
def test_reads_are_paced_to_a_slow_device(tmp_path, read_ahead):
    # the GPU worker's device takes 50 ms a task: slower than the reads, however busy the machine
    workers = {"gpu": {"gpu": True, "extra": ["--preload", SLOW_DEVICE]}, "cpu": {}}
    x = da.from_array(_Lazy((3000, 3000)), chunks=300)  # 100 reads
    y = np.exp(np.sin(x)).sum()
    # the reads the two one-thread workers take at once (ceil(1.1 x 1) each), and read-ahead
    # blocks for the one GPU slot
    window = 2 + 2 + (read_ahead or 0)
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        client.register_plugin(FinishOrder())
        with dask.config.set({**SETTINGS, "eugo.read-ahead": read_ahead}):
            future = client.compute(y)
        seen = wait_until(lambda: client.run_on_scheduler(reads_as_scheduled), timeout=30,
                          every=0.05)
        total = float(future.result(timeout=120))
        # reads stay root-ish tasks, unrestricted: distributed queues them where workers are busy
        assert seen and all(root and not restricted and not resources and producer
                            for _, root, restricted, resources, producer in seen)
        finished = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["finish-order"].finished)
        warnings = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.plugins["eugo"].warnings))
        tokens = {w for k, role, w in placements(client) if role == "pace"}
        gates = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].gates.summary())
        with dask.config.set(optimizations=[]):  # plain Dask's, on the same cluster
            plain = float(client.compute(y).result(timeout=120))
    assert total == pytest.approx(plain, rel=1e-5)
    assert finished.count("array") == 100 and sum(p.startswith("eugo-gpu") for p in finished) == 100
    ahead = [w for w in warnings if "run ahead of its device" in w]
    if read_ahead is not None:
        # paced: never more than the window's reads done ahead of the device, no warning;
        # held back by the plugin on the scheduler (no token task, nothing fetched), every
        # gate let go by its device task ending, none by the watchdog
        assert most_reads_ahead(finished) <= window, finished
        assert not ahead and not tokens
        assert gates["made"] >= 100 - window and gates["forced"] == 0 and not gates["held"], gates
    else:
        # unpaced, the reads run ahead of the device (dask/distributed#9164): the plugin says
        # so, once for the graph
        assert most_reads_ahead(finished) > 2 * window
        assert len(ahead) == 1 and "tasks are assigned to GPU worker gpu" in ahead[0], warnings
        assert not tokens and not gates["made"]


def gates_of(client):
    return client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["eugo"].gates.summary())


@pytest.mark.parametrize("killed", ["gpu", "cpu-1"])
def test_a_worker_killed_while_reads_and_copies_are_held_hangs_nothing(tmp_path, killed):
    # the plugin holds reads and copies on the scheduler until device tasks end: the GPU worker
    # dying (its pending device work then runs its CPU path, the gates with it) or a CPU worker
    # dying (its reads run again elsewhere) leaves nothing held, and the result is plain Dask's
    workers = {"gpu": {"gpu": True, "extra": ["--preload", SLOW_DEVICE]}, "cpu-1": {}, "cpu-2": {}}
    x = da.from_array(_Lazy((3000, 3000)), chunks=300)  # 100 reads
    y = np.exp(np.sin(x)).sum()
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            future = client.compute(y)
        # killed while reads and copies wait on the scheduler for device tasks
        assert wait_until(lambda: gates_of(client)["held"] > 0
                          and sum(role == "gpu" for _, role, _ in placements(client)) >= 10,
                          timeout=60, every=0.05)
        cluster.kill(killed)
        total = float(future.result(timeout=120))
        gates = gates_of(client)
        with dask.config.set(optimizations=[]):  # plain Dask's, on the cluster left
            plain = float(client.compute(y).result(timeout=120))
    assert total == pytest.approx(plain, rel=1e-5)
    assert gates["made"] > 0 and not gates["held"], gates


def _reset_device_peak():
    from eugo_dask.devices.emulated import EmulatedDevice
    from eugo_dask.devices.stats import _live_devices

    for device in list(_live_devices):
        if isinstance(device, EmulatedDevice):
            device.reset_peak()


def _device_peak():
    from eugo_dask.devices.stats import device_memory_stats

    return sum(o["array_peak_bytes"] for s in device_memory_stats() if s["device"] == "emulated"
               for o in s["ordinals"])


def test_copies_to_the_device_are_held_to_the_devices_pace(tmp_path):
    # every block of a is in memory on the CPU workers before the product starts: every copy
    # to the device is ready at once, and copies ask for no GPU slot. Ungated
    # (eugo.read-ahead: null), the GPU worker copies blocks far ahead of its 50 ms kernels;
    # gated, each copy waits for the device task 3 places before its consumer to end
    # (old code: the same high water either way, ~50 blocks on a4771a1, ~20 on main)
    workers = {"gpu": {"gpu": True, "nthreads": 2, "extra": ["--preload", SLOW_DEVICE]},
               "cpu-1": {}, "cpu-2": {}}
    block = 300 * 300 * 4
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        (gpu,) = [w for w, i in client.scheduler_info()["workers"].items() if i["resources"]]
        cpu = [w for w in client.scheduler_info()["workers"] if w != gpu]
        with dask.config.set(optimizations=[]):
            a = client.persist(da.random.default_rng(0).random((1800, 1800), chunks=300,
                                                                 dtype=np.float32), workers=cpu)
            expected = float(da.exp(a @ a.T).sum().compute())
        high = {}
        for name, read_ahead in (("ungated", None), ("gated", 2)):
            client.run(_reset_device_peak, workers=[gpu])
            with dask.config.set({**SETTINGS, "eugo.read-ahead": read_ahead}):
                total = float(client.compute(da.exp(a @ a.T).sum()).result(timeout=120))
            assert total == pytest.approx(expected, rel=1e-4)
            high[name] = client.run(_device_peak, workers=[gpu])[gpu] / block
        gates = gates_of(client)
    # 36 blocks of a, 216 products: gated, the device holds a few tasks' blocks at a time
    assert high["gated"] <= 16 and high["ungated"] >= 3 * high["gated"], high
    assert gates["made"] > 0 and gates["forced"] == 0 and not gates["held"], gates


def test_copies_overlap_kernels_on_a_gpu_worker(tmp_path):
    # a GPU worker with two threads and one GPU slot, whose device takes 50 ms a kernel: copies
    # ask for none of the slot, so they run on the other thread while a kernel holds it (when
    # they held the slot, a copy and a kernel never ran at the same time)
    from distributed import get_task_stream

    workers = {"gpu": {"gpu": True, "nthreads": 2, "extra": ["--preload", SLOW_DEVICE]},
               "cpu": {}}
    x = da.from_array(_Lazy((2400, 2400)), chunks=300)  # 64 reads
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS), get_task_stream(client) as stream:
            total = float(client.compute(np.exp(np.sin(x)).sum()).result(timeout=120))
    assert total == pytest.approx(2400 * 2400 * np.exp(np.sin(np.float32(0.5))), rel=1e-3)
    spans: dict[str, list[tuple[float, float]]] = {"copy": [], "kernel": []}
    for record in stream.data:
        name = record["key"][0] if isinstance(record["key"], tuple) else record["key"]
        kind = ("copy" if name.startswith(("eugo-todevice", "eugo-tohost")) else
                "kernel" if name.startswith("eugo-gpu") else None)
        compute = [s for s in record["startstops"] if s["action"] == "compute"]
        if kind is not None and compute:
            spans[kind].append((compute[0]["start"], compute[0]["stop"]))
    assert len(spans["kernel"]) >= 64 and len(spans["copy"]) >= 64, {k: len(v) for k, v in spans.items()}
    # a copy inside a kernel's 50 ms, clear of its ends (the worker stamps a task's stop after
    # it hands the slot on, so the next task may start a fraction of a millisecond before it)
    margin = 0.005
    overlapping = [c for c in spans["copy"]
                   if any(k[0] + margin <= c[0] and c[1] <= k[1] - margin for k in spans["kernel"])]
    assert overlapping, "no copy ran while a kernel held the GPU slot"


class CopyStarts(WorkerPlugin):
    """On each worker: for every copy as it starts, whether a task of higher priority (a kernel,
    in Dask's order before it) waited in the worker's queue of tasks that ask for resources."""

    name = "copy-starts"

    def setup(self, worker):
        self.worker = worker
        worker.eugo_copy_starts = self.starts = []

    def transition(self, key, start, finish, **kwargs):
        if finish != "executing" or not key_split(key).startswith("eugo-todevice"):
            return
        state = self.worker.state
        ts = state.tasks[key]
        self.starts.append(any(other.priority < ts.priority for other in state.constrained))


def test_copies_do_not_wait_behind_kernels_waiting_for_the_slot(tmp_path):
    # a worker takes every task that asks for a resource from one queue, in priority order, and
    # stops at its head while that task's resources are taken (_ensure_computing): a copy that
    # asked for none of the slot ({GPU: 0}) started only once every kernel before it had the
    # slot, its thread free meanwhile. Asking for no resource, it starts on a free thread while
    # kernels before it wait (on the old code: never, in all 64 copies)
    workers = {"gpu": {"gpu": True, "nthreads": 2, "extra": ["--preload", SLOW_DEVICE]},
               "cpu": {}}
    x = da.from_array(_Lazy((2400, 2400)), chunks=300)  # 64 reads
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        client.register_plugin(CopyStarts())
        with dask.config.set(SETTINGS):
            total = float(client.compute(np.exp(np.sin(x)).sum()).result(timeout=120))
        starts = client.run(lambda dask_worker: dask_worker.eugo_copy_starts)
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    assert total == pytest.approx(2400 * 2400 * np.exp(np.sin(np.float32(0.5))), rel=1e-3)
    by_name = {names[a]: s for a, s in starts.items()}
    assert len(by_name["gpu"]) >= 64 and not by_name["cpu"], {k: len(v) for k, v in by_name.items()}
    assert any(by_name["gpu"]), "every copy waited until the kernels before it had the slot"


# ---------------------------------------------------------------------------------------------
# 5. Bad settings
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, message", [
    ("eugo.min-speedup", "abc", "eugo.min-speedup must be a number >= 0; got 'abc'"),
    ("eugo.emulated.memory-limit", None,
     "eugo.emulated.memory-limit must be a positive byte count or a size like '16 GiB'; got None"),
    ("eugo.device", "gpu", "eugo.device must be one of ['auto', 'cupy', 'emulated', 'none']"),
])
def test_bad_client_setting_is_reported_before_submission(tmp_path, key, value, message):
    with process_cluster(tmp_path, workers={"cpu": {}}) as (cluster, client):
        with dask.config.set({**SETTINGS, key: value}):
            with pytest.raises(ValueError) as info:
                client.compute(pipeline())
        assert message in str(info.value)
        assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0


@pytest.mark.parametrize("env, message", [
    ({"DASK_EUGO__DEVICE": "gpu"},
     "eugo.device must be one of ['auto', 'cupy', 'emulated', 'none']; got 'gpu'"),
    ({"DASK_EUGO__DEVICE": "emulated", "DASK_EUGO__STAGING_BUFFER": "100"},
     "eugo.staging-buffer must be 0 or at least 64 KiB; got 100"),
    ({"DASK_EUGO__DEVICE": "emulated", "DASK_EUGO__DEVICE_MEMORY_FRACTION": "80"},
     "eugo.device-memory-fraction must be"),
])
def test_bad_worker_setting_is_reported_where_the_worker_starts(tmp_path, env, message):
    workers = {"gpu": {"gpu": True, "env": env}, "cpu": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        summary = wait_until(lambda: plugin_summary(client)["invalid_settings"] and
                             plugin_summary(client)["workers_without_device"] and
                             plugin_summary(client))
        (problem,) = summary["invalid_settings"].values()
        assert problem.startswith(message)
        (why,) = summary["workers_without_device"].values()
        assert why == f"invalid setting: {problem}"
        with dask.config.set(SETTINGS):  # its GPU tasks run their CPU path, and say why
            assert_eq(pipeline().compute(), EXPECTED)
        assert wait_until(lambda: plugin_summary(client)["fallbacks"].get("no-device"))
        logs = cluster.logs()
        assert message in logs and "failed to setup" not in logs and "Traceback" not in logs


# ---------------------------------------------------------------------------------------------
# 6. Untrusted input
# ---------------------------------------------------------------------------------------------
def test_spoofed_events_do_not_reach_the_counters(tmp_path):
    with process_cluster(tmp_path, workers={"cpu": {}}) as (cluster, client):
        for i in range(3 * MAX_PREFIXES):
            client.log_event("eugo", {"fallback": f"pwned-{i}", "prefix": f"p{i}"})
        client.log_event("eugo", {"fallback": "device error: X" * 100, "prefix": "p"})
        client.log_event("eugo", {"no-device": "fake", "worker": "tcp://10.0.0.1:1"})
        client.log_event("eugo", "not a dict")
        for i in range(500):
            client.log_event("eugo", {"warning": f"w{i}"})
        summary = wait_until(lambda: len(plugin_summary(client)["warnings"]) >= 100 and
                             plugin_summary(client))
        assert summary["fallback_reasons"] == {} and summary["workers_without_device"] == {}
        assert len(summary["warnings"]) == 100
        port = client.scheduler_info()["services"]["dashboard"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        assert b"pwned" not in text


def test_a_client_cannot_report_a_worker_nor_forge_log_lines(tmp_path):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        gpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "gpu")
        # a healthy GPU worker, named by a client (client.log_event is a call the scheduler has
        # handled when it returns)
        client.log_event("eugo", {"no-device": "forged", "worker": gpu})
        client.log_event("eugo", {"invalid-setting": "forged", "worker": gpu})
        client.log_event("eugo", {"warning": "w\n2099-01-01 FORGED - CRITICAL - all lost\r\x1b[2J"})
        client.log_event("eugo", {"fallback": "no device: x\nFORGED fallback", "prefix": "p\nFORGED"})
        # nor on the stream workers report on: the scheduler drops that client's connection
        # (the client connects again)
        with Client(cluster.address, timeout=30) as other:
            other._send_to_scheduler({"op": REPORT_OP, "worker": gpu,
                                      "report": {"no-device": "forged"}})
            assert wait_until(lambda: f"Remove client {other.id}" in cluster.logs())
        summary = plugin_summary(client)
        assert summary["workers_without_device"] == {} and summary["invalid_settings"] == {}
        port = client.scheduler_info()["services"]["dashboard"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        assert b"eugo_gpu_workers_without_device 0.0" in text
        assert b"eugo_workers_with_invalid_settings 0.0" in text
        # the untrusted text is logged on one line, escaped
        (line,) = [ln for ln in (tmp_path / "scheduler.log").read_text().splitlines()
                   if "FORGED" in ln]
        assert "w\\n2099-01-01 FORGED - CRITICAL - all lost\\r\\x1b[2J" in line
        assert summary["warnings"][-1] == "w\\n2099-01-01 FORGED - CRITICAL - all lost\\r\\x1b[2J"


def test_scheduler_writes_history_only_where_its_own_settings_say(tmp_path):
    own = tmp_path / "scheduler-history.json"
    clients = tmp_path / "client-history.json"
    workers = {"gpu": {"gpu": True}}
    with process_cluster(tmp_path, workers=workers,
                         scheduler_env={"DASK_EUGO__HISTORY": str(own)}) as (cluster, client):
        with dask.config.set({**SETTINGS, "eugo.learn": True, "eugo.history": str(clients)}):
            for _ in range(3):
                assert_eq(pipeline().compute(), EXPECTED)
        client.run_on_scheduler(lambda dask_scheduler: eugo_dask.history.save_all())
    assert own.exists() and not clients.exists()


# ---------------------------------------------------------------------------------------------
# 7. The user's annotations are kept
# ---------------------------------------------------------------------------------------------
class CountAnnotation(SchedulerPlugin):
    name = "count-annotation"

    def __init__(self):
        self.seen = {}

    def update_graph(self, scheduler, *, annotations=None, **kwargs):
        for kind, values in (annotations or {}).items():
            self.seen[kind] = self.seen.get(kind, 0) + len(values)


def _annotation_counts(client, compute):
    client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[
        "count-annotation"].seen.clear())
    compute()
    return client.run_on_scheduler(lambda dask_scheduler: dict(
        dask_scheduler.plugins["count-annotation"].seen))


@pytest.mark.parametrize("when", ["built", "computed"])
def test_user_annotations_survive_the_rewrite(tmp_path, when):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    # Dask's own fusion drops annotations made when a collection is built; a scheduler that
    # turns fusion off keeps them, and eugo must keep them as well
    no_fusion = {"DASK_OPTIMIZATION__FUSE__ACTIVE": "False"}
    with process_cluster(tmp_path, workers=workers, scheduler_env=no_fusion) as (cluster, client):
        client.register_plugin(CountAnnotation())
        counts = {}
        for mode, settings in (("plain", {"optimizations": []}), ("eugo", SETTINGS)):
            with dask.config.set({**settings, "optimization.fuse.active": False}):
                if when == "built":
                    with dask.annotate(mytag="a", priority=2):
                        x = np.exp(da.ones((10, 10), chunks=2))  # 25 chunks
                    compute = (x + 1).compute
                else:
                    x = np.exp(da.ones((10, 10), chunks=2))

                    def compute(x=x):
                        with dask.annotate(mytag="a", priority=2):
                            return (x + 1).compute()
                counts[mode] = _annotation_counts(client, compute)
        assert counts["plain"]["mytag"] >= 25
        # every task eugo writes keeps the annotations of the task it came from
        assert counts["eugo"]["mytag"] >= counts["plain"]["mytag"]


def test_spans_keep_their_tasks(tmp_path):
    workers = {"gpu": {"gpu": True}, "cpu": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        a = da.random.default_rng(0).random((400, 400), chunks=100)
        with dask.config.set(SETTINGS):
            with span("p1"):
                (a @ a).sum().compute()
            with span("p2"):
                np.exp(a).sum().compute()

        def spans(dask_scheduler):
            ext = dask_scheduler.extensions["spans"]
            out = {}
            for (name, *_), found in ext.spans_search_by_name.items():
                for sp in found:
                    entry = out.setdefault(name, {"tasks": 0, "prefixes": set()})
                    entry["tasks"] += sum(sp.states.values())
                    entry["prefixes"] |= {tg.prefix.name for tg in sp.traverse_groups()}
            return out

        found = client.run_on_scheduler(spans)
        for name in ("p1", "p2"):  # each workflow's tasks, eugo's among them, in its span
            assert found[name]["tasks"] > 0
            assert any(p.startswith("eugo-gpu") for p in found[name]["prefixes"]), found[name]
        assert not any(p.startswith("eugo") for p in found.get("default", {}).get("prefixes", ()))


# ---------------------------------------------------------------------------------------------
# 8. The user's restrictions are kept
# ---------------------------------------------------------------------------------------------
class Restrictions(SchedulerPlugin):
    """Each task's restrictions as the scheduler sends it to a worker, and that worker."""

    name = "restrictions"

    def __init__(self):
        self.seen = []

    async def start(self, scheduler):
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            ts = self.scheduler.tasks[key]
            self.seen.append((ts.prefix.name, dict(ts.resource_restrictions or {}),
                              sorted(ts.worker_restrictions or ()),
                              sorted(ts.host_restrictions or ()), ts.loose_restrictions,
                              ts.processing_on.name))


def restricted_runs(client, compute):
    """What ``compute()`` returned, and each task's restrictions and worker as it was sent."""
    client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["restrictions"].seen.clear())
    result = compute()
    return result, client.run_on_scheduler(
        lambda dask_scheduler: list(dask_scheduler.plugins["restrictions"].seen))


def is_device_task(prefix):
    return prefix.startswith(("eugo-gpu", "eugo-todevice", "eugo-tohost"))


def test_every_task_keeps_the_users_restrictions(tmp_path):
    workers = {"gpu": {"extra": ["--resources", "GPU=1 MEM=1"],
                       "env": {"DASK_EUGO__DEVICE": "emulated"}},
               "cpu-1": {"extra": ["--resources", "MEM=1"]}, "cpu-2": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        client.register_plugin(Restrictions())
        gpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "gpu")
        for given in ({"workers": [gpu]}, {"resources": {"MEM": 1}}):
            runs = {}
            for mode, settings in (("plain", {"optimizations": []}), ("eugo", SETTINGS)):
                with dask.config.set(settings):
                    result, runs[mode] = restricted_runs(
                        client, lambda given=given: client.compute(pipeline(), **given).result(timeout=60))
                assert_eq(result, EXPECTED)
            user = ({"resources": {"MEM": 1}, "workers": [], "ran on": {"gpu", "cpu-1"}}
                    if "resources" in given else {"resources": {}, "workers": [gpu], "ran on": {"gpu"}})
            device = [r for r in runs["eugo"] if is_device_task(r[0])]
            assert device and not [r for r in runs["plain"] if is_device_task(r[0])]
            for mode, seen in runs.items():
                for prefix, resources, worker_restrictions, hosts, loose, ran_on in seen:
                    # every task as the user said, eugo's device tasks on the GPU worker besides:
                    # kernels hold its slot; copies, where the user named no workers, are kept
                    # to the GPU workers and ask for no resource of eugo's (one that asks for
                    # none of the slot still waits behind kernels in the worker's queue of
                    # tasks with resources), and where the user named workers, for none of
                    # the slot ({GPU: 0}: only workers advertising it meet that)
                    copy = prefix.startswith(("eugo-todevice", "eugo-tohost"))
                    mine = (({"GPU": 0} if user["workers"] else {}) if copy else
                            {"GPU": 1} if is_device_task(prefix) else {})
                    assert resources == {**user["resources"], **mine}, (mode, prefix, resources)
                    assert worker_restrictions == (user["workers"] or ([gpu] if copy else [])), (
                        mode, prefix)
                    assert not hosts and not loose, (mode, prefix)
                    assert ran_on in user["ran on"] and (ran_on == "gpu" or not (mine or copy)), (
                        mode, prefix)
            for kind in ("eugo-todevice", "eugo-tohost", "eugo-gpu"):  # each kind was checked
                assert any(prefix.startswith(kind) for prefix, *_ in device), (kind, device)
            assert {ran_on for *_, ran_on in device} == {"gpu"}


def restriction_warnings(client):
    return [w for w in plugin_summary(client)["warnings"] if "restrictions" in w]


def test_a_restriction_no_gpu_worker_meets_runs_the_cpu_path(tmp_path):
    # no GPU worker has MEM, nor is cpu-1
    workers = {"gpu": {"gpu": True}, "cpu-1": {"extra": ["--resources", "MEM=1"]}, "cpu-2": {}}
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        client.register_plugin(Restrictions())
        cpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "cpu-1")

        def annotated(**kwargs):
            with dask.annotate(resources={"MEM": 1}):
                return client.compute(pipeline(), **kwargs)

        cases = [  # how the user restricts, what every task then carries
            (lambda: client.compute(pipeline(), resources={"MEM": 1}), {"MEM": 1}, [], False),
            (annotated, {"MEM": 1}, [], False),
            (lambda: client.compute(pipeline(), workers=[cpu]), {}, [cpu], False),
            # loose: the GPU resource would not go with it (a worker without it could be sent
            # the task), so the device tasks run their CPU path too
            (lambda: client.compute(pipeline(), workers=[cpu], allow_other_workers=True), {},
             [cpu], True),
        ]
        for compute, resources, restricted_to, loose in cases:
            warned = len(restriction_warnings(client))
            runs = {}
            for mode, settings in (("plain", {"optimizations": []}), ("eugo", SETTINGS)):
                with dask.config.set(settings):  # never a hang: each result within a minute
                    result, runs[mode] = restricted_runs(
                        client, lambda compute=compute: compute().result(timeout=60))
                assert_eq(result, EXPECTED)
            device = [r for r in runs["eugo"] if is_device_task(r[0])]
            assert device and not [r for r in runs["plain"] if is_device_task(r[0])]
            for mode, seen in runs.items():
                for prefix, resources_seen, worker_restrictions, hosts, loose_seen, ran_on in seen:
                    assert resources_seen == resources, (mode, prefix, resources_seen)
                    assert worker_restrictions == restricted_to and loose_seen == loose, (mode, prefix)
                    assert not hosts and (loose or ran_on == "cpu-1"), (mode, prefix, ran_on)
            # eugo's device tasks ran their CPU path where the user said, the device unused
            assert {ran_on for *_, ran_on in device} == {"cpu-1"}
            assert all(s["tasks"] == 0 for s in worker_stats(client).values())
            warnings = wait_until(lambda w=warned: len(restriction_warnings(client)) > w and
                                  restriction_warnings(client))
            assert len(warnings) == warned + 1, warnings  # one warning for the graph
            assert "no worker advertising 'GPU' meets" in warnings[-1]


def test_the_gpu_worker_meeting_a_restriction_leaves_mid_computation(tmp_path):
    # gpu-1 meets the user's restriction (MEM); gpu-2 is a GPU worker that does not
    workers = {"gpu-1": {"extra": ["--resources", "GPU=1 MEM=1"],
                         "env": {"DASK_EUGO__DEVICE": "emulated"}},
               "gpu-2": {"gpu": True}, "cpu": {"extra": ["--resources", "MEM=1"]}}
    x, expected = row_sums()
    with process_cluster(tmp_path, workers=workers) as (cluster, client):
        with dask.config.set(SETTINGS):
            future = client.compute(x, resources={"MEM": 1})
        wait_until(lambda: any(role == "gpu" for _, role, _ in placements(client)), every=0.01)
        assert not future.done()
        cluster.kill("gpu-1")
        assert_eq(future.result(timeout=120), expected)  # never a hang
        gpu_tasks = {w for _, role, w in placements(client) if role == "gpu"}
        assert "gpu-1" in gpu_tasks and "cpu" in gpu_tasks and "gpu-2" not in gpu_tasks
        assert any("no worker left advertising 'GPU' meets" in w
                   for w in plugin_summary(client)["warnings"])
