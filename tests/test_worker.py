"""worker: what EugoWorkerPlugin does at a worker's start (settings checked and reported, a GPU
worker without a device said, idle release driven, device values sent as host arrays), on a
stand-in worker for the reports and on a real in-process cluster for get_data.

(Reports reaching the scheduler's summary from separate-process workers: test_cluster; a
retiring GPU worker's values: test_retire.)"""

from __future__ import annotations

import asyncio
import logging
import threading

import dask
import numpy as np
import pytest
from dask.array.utils import assert_eq
from distributed import Client, LocalCluster
from distributed.protocol.serialize import to_serialize
from distributed.utils_test import gen_cluster

from eugo_dask import worker as worker_module
from eugo_dask.runtime import get_device
from eugo_dask.testing import emulated_settings, gpu_worker
from eugo_dask.worker import (
    REPORT_OP,
    EugoWorkerPlugin,
    _HostDataComm,
    device_capability,
    running_schedulers,
    send_device_values_as_host,
)

from .pipelines import EXPECTED, pipeline


class StandInWorker:
    """What the plugin reads of a worker: handlers, periodic callbacks, resources, its loop's
    thread and batched stream."""

    def __init__(self, resources=None):
        self.handlers = {"get_data": self.get_data}
        self.periodic_callbacks = {}
        self.state = type("State", (), {"total_resources": resources or {}})()
        self.thread_id = threading.get_ident()
        self.sent = []

    async def get_data(self, comm, *args, **kwargs):
        return await comm.write({"status": "OK", "data": dict(kwargs.get("data", {}))})

    def batched_send(self, message):
        self.sent.append(message)


def _set_up(worker, plugin, settings):
    """Set the plugin up inside an event loop (its periodic callback needs one), then stop
    what it started."""
    async def run():
        plugin.setup(worker)
        for callback in worker.periodic_callbacks.values():
            callback.stop()

    with dask.config.set(settings):
        asyncio.run(run())


@pytest.fixture
def alone(monkeypatch):
    """No scheduler in this process, as on a worker of its own."""
    monkeypatch.setattr(worker_module, "running_schedulers", lambda: [])


def test_a_worker_with_an_invalid_setting_logs_and_reports_it(alone, caplog):
    worker = StandInWorker()
    with caplog.at_level(logging.ERROR, logger="eugo_dask.worker"):
        _set_up(worker, EugoWorkerPlugin(report=True), {"eugo.device": "tpu"})
    assert worker.eugo_device is None
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "eugo.device must be one of" in error and error.endswith("; this worker uses no device")
    (message,) = worker.sent
    assert message["op"] == REPORT_OP
    assert "eugo.device must be one of" in message["report"]["invalid-setting"]


def test_a_gpu_worker_that_cannot_use_a_device_says_so(alone, caplog):
    worker = StandInWorker(resources={"GPU": 1})
    with caplog.at_level(logging.WARNING, logger="eugo_dask.worker"):
        _set_up(worker, EugoWorkerPlugin(report=True), {"eugo.device": "none"})
    assert worker.eugo_device is None
    assert any("advertises GPU=1 but cannot use a device" in r.getMessage() for r in caplog.records)
    assert worker.sent == [{"op": REPORT_OP,
                            "report": {"no-device": "eugo.device is 'none' on this worker"}}]
    # the same worker without the resource: a CPU worker, nothing to say
    cpu = StandInWorker()
    _set_up(cpu, EugoWorkerPlugin(report=True), {"eugo.device": "none"})
    assert cpu.sent == []
    # under another resource name, GPU=1 does not mark a GPU worker
    other = StandInWorker(resources={"GPU": 1})
    _set_up(other, EugoWorkerPlugin("accel", report=True), {"eugo.device": "none"})
    assert other.sent == []


def test_reports_go_only_where_the_scheduler_handles_them(alone):
    worker = StandInWorker(resources={"GPU": 1})
    _set_up(worker, EugoWorkerPlugin(), {"eugo.device": "tpu"})  # report=False: the default
    assert worker.sent == []


def test_a_report_from_another_thread_goes_through_the_workers_loop(alone):
    class Loop:
        def __init__(self):
            self.callbacks = []

        def add_callback(self, fn, *args):
            self.callbacks.append((fn, args))

    worker = StandInWorker()
    worker.thread_id = -1  # the plugin runs off the worker's event loop thread
    worker.loop = Loop()
    EugoWorkerPlugin(report=True)._report(worker, "no-device", "x" * 100_000)
    assert worker.sent == []
    ((fn, (message,)),) = worker.loop.callbacks
    assert fn == worker.batched_send and message["op"] == REPORT_OP
    assert len(message["report"]["no-device"]) == worker_module.MAX_EVENT_TEXT  # cut to size


def test_a_worker_with_its_device_reports_nothing_and_drives_idle_release(alone):
    worker = StandInWorker(resources={"GPU": 1})
    settings = {"eugo.device": "emulated", "eugo.device-idle-release": "1s"}
    _set_up(worker, EugoWorkerPlugin(report=True), settings)
    assert worker.eugo_device == "emulated" and worker.sent == []
    callback = worker.periodic_callbacks["eugo-idle-release"]
    assert callback.callback_time == 250  # a quarter of the idle time, in ms
    _set_up(worker, EugoWorkerPlugin(report=True), settings)  # set up again: still one
    assert worker.periodic_callbacks == {"eugo-idle-release": callback}
    quiet = StandInWorker()
    _set_up(quiet, EugoWorkerPlugin(), {"eugo.device": "emulated", "eugo.device-idle-release": None})
    assert quiet.periodic_callbacks == {}


def test_device_capability_is_the_runtimes_answer():
    with dask.config.set({"eugo.device": "emulated"}):
        assert device_capability() == ("emulated", None)
    with dask.config.set({"eugo.device": "none"}):
        assert device_capability() == (None, "eugo.device is 'none' on this worker")
    with dask.config.set({"eugo.device": "tpu"}):
        device, why = device_capability()
        assert device is None and why.startswith("invalid setting: eugo.device must be one of")


def test_get_data_is_wrapped_once():
    worker = StandInWorker()
    original = worker.handlers["get_data"]
    send_device_values_as_host(worker)
    wrapped = worker.handlers["get_data"]
    assert wrapped is not original and wrapped._eugo_host
    send_device_values_as_host(worker)
    assert worker.handlers["get_data"] is wrapped
    without = StandInWorker()
    del without.handlers["get_data"]
    send_device_values_as_host(without)
    assert without.handlers == {}


def test_eugos_device_values_leave_as_host_arrays_and_others_as_they_are():
    with dask.config.set({"eugo.device": "emulated"}):
        device = get_device("emulated")
        value = device.to_device(np.arange(4.0), 0)
    written = []

    class Comm:
        peer_address = "inproc://peer"

        async def write(self, msg):
            written.append(msg)
            return len(written)

    message = {"status": "OK", "data": {("eugo-gpu-add-1", 0): to_serialize(value),
                                        ("user-cupy", 0): value, "plain": 3}}
    comm = _HostDataComm(Comm())
    assert comm.peer_address == "inproc://peer"  # everything else is the comm's own
    asyncio.run(comm.write(message))
    (sent,) = written
    host = sent["data"][("eugo-gpu-add-1", 0)].data
    assert type(host) is np.ndarray and host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sent["data"][("user-cupy", 0)] is value and sent["data"]["plain"] == 3
    assert message["data"][("eugo-gpu-add-1", 0)].data is value  # the worker's own copy stays
    other = {"op": "heartbeat"}
    asyncio.run(comm.write(other))
    assert written[-1] is other


def _device_value():
    with dask.config.set({"eugo.device": "emulated"}):
        return get_device("emulated").to_device(np.arange(3.0), 0)


@pytest.mark.timeout(120)
def test_an_in_process_cluster_checks_nothing_and_sends_host_arrays():
    """Beside its scheduler a worker has no settings of its own: nothing is checked at its
    start. Its get_data still sends eugo's device values as host arrays, a user's as they are."""
    assert running_schedulers() == []
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, timeout=60) as client:
        assert running_schedulers() == [cluster.scheduler]
        client.register_plugin(EugoWorkerPlugin(report=True))
        (worker,) = cluster.workers.values()
        assert worker.handlers["get_data"]._eugo_host
        assert not hasattr(worker, "eugo_device")  # returned before the checks
        ours = client.submit(_device_value, key=("eugo-gpu-x", 0), pure=False)
        theirs = client.submit(_device_value, key=("user-x", 0), pure=False)
        values = client.gather([ours, theirs], direct=True)
        assert type(values[0]) is np.ndarray and values[0].tolist() == [0.0, 1.0, 2.0]
        assert type(values[1]) is not np.ndarray
    assert running_schedulers() == []


@gen_cluster(client=True, nthreads=[gpu_worker()],
             config={**emulated_settings(), "eugo.device-idle-release": "50ms"})
async def test_the_idle_release_runs_off_the_event_loop(c, s, gpu):
    # issue 31: it ran on the worker's event loop, where cudaFree (which waits for the whole
    # device) stalled every comm of the worker
    from eugo_dask.plugin import EugoSchedulerPlugin
    from eugo_dask.runtime import get_device

    await c.register_plugin(EugoSchedulerPlugin())
    assert_eq(await c.compute(pipeline()), EXPECTED)
    device = get_device("emulated")
    threads = []
    release = device.release_memory

    def recording_release(**kwargs):
        threads.append(threading.get_ident())
        return release(**kwargs)

    device.release_memory = recording_release
    try:
        device._released_since_busy = False  # busy just now: due again after 50 ms
        for _ in range(200):
            if threads:
                break
            await asyncio.sleep(0.02)
    finally:
        del device.release_memory
    assert threads and threading.get_ident() not in threads  # the loop's thread is this one
