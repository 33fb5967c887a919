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


# ---------------------------------------------------------------------------------------------
# The copy path per size, from the process's profile
# ---------------------------------------------------------------------------------------------
MiB = 1 << 20
#: a calibration's finding: staged on 2 threads at 2 MiB, registered and pinned from 16 MiB
CALIBRATED = {"base": "h200", "link": {"copies_by_size": {
    "h2d": [{"bytes": 2 * MiB, "bytes_per_s": 9e9, "path": "staged", "threads": 2},
            {"bytes": 16 * MiB, "bytes_per_s": 3e10, "path": "registered"}],
    "d2h": [{"bytes": 2 * MiB, "bytes_per_s": 8e9, "path": "staged", "threads": 2},
            {"bytes": 16 * MiB, "bytes_per_s": 4e10, "path": "pinned"}]}}}


@pytest.fixture
def stand_in_cupy(monkeypatch):
    """The runtime's CuPy device on the stand-in CuPy (tests/fake_cupy.py), made as a worker
    makes it (get_device), on an 8-core machine; forgotten after."""
    import os
    import sys

    from eugo_dask import runtime

    from . import fake_cupy, stand_in_cupy

    stand_in_cupy.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module),
                          monkeypatch.setattr)
    fake_cupy.reset()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    runtime._forget_cuda_devices()
    yield fake_cupy
    runtime._forget_cuda_devices()


def _paths_taken(device, nbytes):
    eugo_dask.reset_device_stats()
    host = np.arange(nbytes // 8, dtype=np.float64)
    np.testing.assert_array_equal(device.to_host(device.to_device(host)), host)
    stats = device_stats()
    return (("registered" if stats["h2d_registered"] else "staged" if stats["h2d_staged"] else "direct"),
            ("pinned" if stats["d2h_pinned"] else "staged" if stats["d2h_staged"] else "direct"),
            stats["staged_threads"])


def test_the_runtime_copies_each_size_the_way_its_profile_measured_best(stand_in_cupy):
    """With the copy keys at auto (the defaults), a worker's device takes, for each chunk size,
    the path of the profile's nearest per-size point; with a preset (no such points) the
    defaults: staged on 4 threads, pinned results from 64 MiB."""
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": CALIBRATED}):
        device = get_device("cupy")
        assert device.settings.per_size == {"threads", "h2d", "d2h"}
        assert device.settings.h2d_by_size == ((2 * MiB, "staged", 2), (16 * MiB, "registered", None))
        assert _paths_taken(device, 2 * MiB) == ("staged", "staged", {2: 2})
        assert _paths_taken(device, 32 * MiB) == ("registered", "pinned", {})
    assert not stand_in_cupy._registered and not stand_in_cupy.unpinned_copies
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": "h200"}):
        preset = get_device("cupy")
        assert preset.settings.h2d_by_size == preset.settings.d2h_by_size == ()
        assert _paths_taken(preset, 32 * MiB) == ("staged", "staged", {4: 2})


def test_explicit_copy_settings_win_over_the_profiles_per_size_paths(stand_in_cupy):
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": CALIBRATED,
                          "eugo.register-in-place": None, "eugo.copy-threads": 3}):
        device = get_device("cupy")
        assert device.settings.per_size == {"d2h"}
        # staged where the profile registers, on the configured 3 threads; still pinned back
        assert _paths_taken(device, 32 * MiB) == ("staged", "pinned", {3: 1})
        assert _paths_taken(device, 4 * MiB) == ("staged", "staged", {3: 2})
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": CALIBRATED,
                          "eugo.pinned-results-min": "64 MiB", "eugo.register-in-place": "1 MiB"}):
        device = get_device("cupy")
        assert _paths_taken(device, 2 * MiB) == ("registered", "staged", {2: 1})
        assert _paths_taken(device, 32 * MiB) == ("registered", "staged", {2: 1})


def test_the_runtime_reads_its_profile_file_and_a_cluster_profile(stand_in_cupy, tmp_path):
    """A calibrated profile as a file (eugo.profile), or as the scheduler's eugo.cluster-profile
    where eugo.profile is auto (an in-process cluster shares it); a file that cannot be read
    leaves the defaults, said once in the log, and never fails a copy."""
    import yaml

    from eugo_dask.config import device_settings
    from eugo_dask.profile import profile_dict

    path = tmp_path / "calibrated.yaml"
    path.write_text(yaml.safe_dump(profile_dict(CALIBRATED)))
    with dask.config.set({"eugo.profile": str(path)}):
        assert device_settings().d2h_by_size[-1] == (16 * MiB, "pinned", None)
    with dask.config.set({"eugo.cluster-profile": [str(tmp_path / "not-yet.yaml"), str(path)]}):
        assert device_settings().h2d_by_size[-1] == (16 * MiB, "registered", None)
    assert device_settings().h2d_by_size == ()  # auto, no cluster profile: the defaults


def test_an_unreadable_profile_leaves_the_default_copy_paths(stand_in_cupy, tmp_path, caplog):
    from eugo_dask.config import device_settings

    bad = tmp_path / "bad.yaml"
    bad.write_text("link: {copies_by_size: {h2d: [{bytes: 1, bytes_per_s: 1, path: pinned}]}}\n")
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": str(bad)}):
        assert device_settings().h2d_by_size == ()
        device = get_device("cupy")
        assert device.unusable_reason is None
        assert _paths_taken(device, 32 * MiB) == ("staged", "staged", {4: 2})
    assert "cannot be read for its per-size copies" in caplog.text and "'gpu' is missing" in caplog.text


def test_a_device_made_under_settings_that_changed_goes_with_its_pinned_buffers(stand_in_cupy):
    """A process keeps one CuPy device: where its settings change (a worker's calibrated
    profile appears), the device made under the old ones is dropped, and once nothing holds
    it its threads' pinned staging buffers go with it (they stayed, 2 x eugo.staging-buffer a
    thread, while the process lived)."""
    import gc
    import weakref

    with dask.config.set({"eugo.device": "cupy", "eugo.profile": "h200"}):
        old = get_device("cupy")
        _paths_taken(old, 4 * MiB)  # staged: this thread's two pinned buffers made
        staging = weakref.ref(old._staging())
        gone = weakref.ref(old)
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": CALIBRATED}):
        new = get_device("cupy")
        assert new is not old
        assert get_device("cupy") is new
    with dask.config.set({"eugo.device": "cupy", "eugo.profile": "h200"}):
        assert get_device("cupy") is not old  # made again, not the dropped one
    del old
    gc.collect()
    assert gone() is None and staging() is None
