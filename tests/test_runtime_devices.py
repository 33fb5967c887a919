"""The runtime on the device interface: synchronised tasks, faults anywhere fall back, a sticky
error turns the device off, several devices keep chains, device bytes kept apart."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import eugo_dask
from eugo_dask import device_stats
from eugo_dask.devices.emulated import EmulatedDevice
from eugo_dask.runtime import DeviceCall, get_device, to_device

A = np.random.default_rng(0).random((400, 300))


def _device():
    from eugo_dask import runtime

    runtime._logged_prefixes.clear()  # other tests count their warnings
    device = get_device("emulated")
    device._faults.clear()
    device._lost = None
    device._disabled = None
    return device


@pytest.fixture
def fresh(emulated):
    device = _device()
    yield device
    _device()


def test_a_fault_at_synchronisation_falls_back(fresh):
    fresh.inject_fault("library", where="sync")
    x = np.exp(da.from_array(A, chunks=100)) * 2
    np.testing.assert_allclose(x.compute(scheduler="sync"), np.exp(A) * 2)
    stats = device_stats()
    assert stats["fallback_reasons"] == {"device error (library): EmulatedLibraryError": 1}
    assert stats["tasks"] == 11 and stats["device_errors"] == {"library": 1}


@pytest.mark.parametrize("fault", ["rmm-out-of-memory", "library", "compile"])
def test_copy_to_the_device_falls_back_on_device_errors(fresh, fault):
    fresh.inject_fault(fault, where="h2d")
    assert to_device(A, "emulated") is A


def test_a_sticky_error_turns_the_device_off_for_the_process(fresh, caplog):
    fresh.inject_fault("sticky", where="h2d")
    x = np.exp(da.from_array(A, chunks=100)) * 2
    np.testing.assert_allclose(x.compute(scheduler="sync"), np.exp(A) * 2)
    stats = device_stats()
    assert stats["disabled"]["emulated"].startswith("sticky error: EmulatedCudaError")
    assert stats["tasks"] == 0 and stats["h2d_count"] == 0  # nothing tried after it
    # the task that met the error, then every later one: they find the device off, and say so
    off = ("no device: the device is off in this process: sticky error: EmulatedCudaError: "
           "cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert stats["fallback_reasons"] == {"device error (sticky): EmulatedCudaError": 1,
                                         off: x.npartitions - 1}
    assert "off in this process" in caplog.text


def test_device_time_is_metered_after_synchronisation(fresh):
    from distributed.metrics import context_meter

    seen = {}
    with context_meter.add_callback(lambda label, value, unit: seen.setdefault((label, unit), value)):
        DeviceCall(np.sin, "emulated", "sin")(A)
    assert {("eugo-h2d", "seconds"), ("eugo-device-compute", "seconds"), ("eugo-h2d", "bytes")} <= set(seen)


def test_several_emulated_devices_share_the_work_and_keep_chains(emulated, monkeypatch):
    used = []
    wrap = EmulatedDevice.wrap

    def recording(self, data, ordinal=None):
        arr = wrap(self, data, ordinal)
        used.append(arr._ordinal)
        return arr

    monkeypatch.setattr(EmulatedDevice, "wrap", recording)
    with dask.config.set({"eugo.emulated.devices": 2}):
        x = da.from_array(A, chunks=100)
        result = ((np.sin(x) @ x.T) + 1).sum(axis=0).compute(scheduler="threads", num_workers=4)
        device = get_device("emulated")
    np.testing.assert_allclose(result, ((np.sin(A) @ A.T) + 1).sum(axis=0))
    assert device.count == 2 and set(used) == {0, 1}
    assert device_stats()["fallbacks"] == 0


def test_workers_keep_device_bytes_out_of_host_memory():
    from distributed.utils_test import gen_cluster

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], worker_kwargs={"resources": {"GPU": 1}},
                 config={"eugo.device": "emulated", "optimizations": [eugo_dask.eugo],
                         "eugo.min-speedup": 0})
    async def run(client, scheduler, worker):
        x = np.sin(da.from_array(A, chunks=100)) * 2
        assert np.allclose(await client.compute(x), np.sin(A) * 2)
        assert getattr(worker.data, "_eugo_device_accounting", False)

    run()


@pytest.mark.parametrize("key, value", [
    ("eugo.staging-buffer", [8]),
    ("eugo.device-idle-release", {"a": 1}),
    ("eugo.fft-plan-cache-memory", [1]),
    ("eugo.staging-buffer", 100),
])
def test_a_malformed_device_setting_means_no_device_never_a_failed_task(key, value):
    """A value of the wrong kind (a mis-indented YAML list, a mapping) is an invalid setting like
    any other: this process uses no device, and a GPU task runs its CPU path."""
    from eugo_dask.config import device_setting_problems
    from eugo_dask.runtime import usable_device, why_no_device

    with dask.config.set({"eugo.device": "emulated", key: value}):
        (problem,) = device_setting_problems()
        assert problem.startswith(f"{key} must be")
        assert usable_device("emulated") is None
        assert why_no_device("emulated") == f"invalid setting: {problem}"
        out = DeviceCall(np.add, "emulated", "add")(np.ones(2), 1)
        assert type(out) is np.ndarray and out.tolist() == [2.0, 2.0]
