"""The emulated device behaves like CuPy where placement depends on it; counters count."""

from __future__ import annotations

import types
from collections import Counter

import dask
import numpy as np
import pytest

from eugo_dask import EmulatedDeviceArray, EmulatedOutOfMemoryError, device_stats, reset_device_stats
from eugo_dask.devices import resolve_device_name
from eugo_dask.devices.emulated import EmulatedDevice
from eugo_dask.runtime import get_device


@pytest.fixture
def device():
    reset_device_stats()
    yield EmulatedDevice(10**6)
    reset_device_stats()


def test_numpy_calls_dispatch_and_stay_on_device(device):
    x = device.to_device(np.arange(12.0).reshape(3, 4))
    for result in (np.sin(x), x + 1, x @ x.T, np.sum(x, axis=0), np.concatenate([x, x]),
                   np.where(x > 3, x, 0), x.T, x[1:], x.reshape(4, 3), np.fft.fft(x)):
        assert isinstance(result, EmulatedDeviceArray)
    assert float(np.sum(x).get()) == 66.0


def test_implicit_conversion_raises_like_cupy(device):
    x = device.to_device(np.ones(3))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="does not mix host and device arrays"):
        x + np.ones(3)


def test_capacity_and_release(device):
    a = device.to_device(np.ones(100_000))  # 800 kB of 1 MB
    with pytest.raises(EmulatedOutOfMemoryError, match="Out of memory allocating"):
        device.to_device(np.ones(50_000))
    del a
    b = device.to_device(np.ones(50_000))  # freed memory is reusable
    assert device.used_bytes == b.nbytes


def test_counters(device):
    x = device.to_device(np.ones(10))
    device.to_device(np.ones(5, dtype="f4"))
    device.to_host(x)
    stats = device_stats()
    assert (stats["h2d_count"], stats["h2d_bytes"]) == (2, 80 + 20)
    assert (stats["d2h_count"], stats["d2h_bytes"]) == (1, 80)
    reset_device_stats()
    assert device_stats()["h2d_count"] == 0


def test_resolve_device_names():
    assert resolve_device_name("none") is None
    assert resolve_device_name("emulated") == "emulated"
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert resolve_device_name("auto") is None  # no CuPy: nothing to offload to
    with pytest.raises(ValueError, match="eugo.device must be one of"):
        resolve_device_name("tpu")


def test_emulated_capacity_from_config():
    with dask.config.set({"eugo.emulated.memory-limit": "1 kiB"}):
        dev = get_device("emulated")
        assert dev.memory_limit_bytes == 1024


def test_pickled_device_array_arrives_on_device():
    import pickle

    dev = get_device("emulated")
    x = dev.to_device(np.arange(3.0))
    with dask.config.set({"eugo.device": "emulated"}):  # a process that holds device arrays
        y = pickle.loads(pickle.dumps(x))
    assert isinstance(y, EmulatedDeviceArray)
    np.testing.assert_array_equal(y.get(), np.arange(3.0))


@pytest.mark.parametrize("setting", ["none", "auto"])
def test_device_array_arrives_as_host_array_where_no_device(setting):
    # a CPU worker (or a retiring GPU worker's peer) receives what the device array carried
    import pickle

    x = get_device("emulated").to_device(np.arange(3.0))
    with dask.config.set({"eugo.device": setting}):
        y = pickle.loads(pickle.dumps(x))
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, np.arange(3.0))


def test_device_array_arrives_as_host_array_when_the_device_is_full():
    import pickle

    x = get_device("emulated").to_device(np.arange(1000.0))
    reset_device_stats()
    with dask.config.set({"eugo.device": "emulated", "eugo.emulated.memory-limit": 100}):
        y = pickle.loads(pickle.dumps(x))
    assert type(y) is np.ndarray and y.sum() == np.arange(1000.0).sum()
    assert device_stats()["fallback_reasons"] == {"device error on receive: out of memory": 1}


# ---------------------------------------------------------------------------------------------
# Several devices, pools, errors, the task scope (the device interface the runtime calls)
# ---------------------------------------------------------------------------------------------
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from eugo_dask.devices import (  # noqa: E402
    COMPILE,
    LIBRARY,
    OUT_OF_MEMORY,
    RUNTIME,
    STICKY,
    UNAVAILABLE,
    DeviceDisabled,
    DeviceSettings,
    device_memory_stats,
    device_nbytes,
    install_device_accounting,
)
from eugo_dask.devices.emulated import EmulatedCudaError  # noqa: E402


def test_emulated_ufuncs_refuse_0d_numpy_arrays_as_cupy_does(device):
    # CuPy's _kernel._preprocess_arg wraps Python and NumPy scalars only: a 0-d NumPy array in an
    # elementwise call raises TypeError, except in comparisons (its __array_ufunc__ takes the value)
    x = device.to_device(np.arange(3.0))
    for call in (lambda: x + np.array(1.0), lambda: np.array(2.0) * x, lambda: np.maximum(x, np.array(1.0))):
        with pytest.raises(TypeError, match=r"Unsupported type <class 'numpy.ndarray'>.*0-d"):
            call()
    np.testing.assert_array_equal((x > np.array(0.5)).get(), [False, True, True])
    np.testing.assert_array_equal((x + np.float64(1.0)).get(), [1.0, 2.0, 3.0])  # NumPy scalars


@pytest.fixture
def three():
    reset_device_stats()
    yield EmulatedDevice(10**6, count=3)
    reset_device_stats()


def test_arrays_remember_their_device_and_results_stay_there(three):
    x = three.to_device(np.arange(6.0), ordinal=2)
    assert three.ordinal_of(x) == 2 and x.device == 2
    for result in (x + 1, np.sin(x), x.sum(), x[1:], np.concatenate([x, x])):
        assert three.ordinal_of(result) == 2
    assert three.used_bytes_on(2) > 0 and three.used_bytes_on(0) == three.used_bytes_on(1) == 0
    y = three.to_device(np.arange(6.0), ordinal=1)
    with pytest.raises(ValueError, match=r"different from the current device.*Peer access is unavailable"):
        x + y


def test_select_keeps_a_chain_on_its_device(three):
    small = three.to_device(np.ones(10), ordinal=0)
    big = three.to_device(np.ones(1000), ordinal=2)
    assert three.select((small, [big], {"k": 1})) == 2  # most resident bytes
    gathered = three.gather((small, [big]), 2)
    assert [three.ordinal_of(v) for v in (gathered[0], gathered[1][0])] == [2, 2]
    assert gathered[1][0] is big  # already there: not copied
    stats = device_stats()
    assert (stats["d2d_count"], stats["d2d_bytes"]) == (1, 80)
    np.testing.assert_array_equal((gathered[0] + gathered[1][0][:10]).get(), np.full(10, 2.0))


def test_select_spreads_tasks_over_devices_and_threads(three):
    # tasks without device inputs go to the least busy device
    with three.task() as first:
        with three.task() as nested:  # one thread, one scope: the same task
            assert nested is first
        # a second thread's task, while the first is in flight, goes elsewhere
        seen = []
        thread = threading.Thread(target=lambda: seen.append(three.select()))
        thread.start()
        thread.join()
        assert seen[0] != first.ordinal
    # each thread keeps a home device among equally busy ones
    homes = []

    def record():
        homes.append((three.select(), three.select()))

    threads = [threading.Thread(target=record) for _ in range(3)]
    for t in threads:
        t.start()
        t.join()
    assert all(a == b for a, b in homes) and sorted(a for a, _ in homes) == [0, 1, 2]


def test_copies_inside_a_task_land_on_its_device(three):
    with three.task(1) as clock:
        x = three.to_device(np.ones(4))
        y = x * 2
        assert three.select() == 1 and three.ordinal_of(y) == 1 and clock.ordinal == 1
    assert three.ordinal_of(three.to_device(np.ones(4), ordinal=0)) == 0


def test_task_clock_measures_phases_and_waits_for_the_device(three):
    with three.task(0) as clock:
        x = three.to_device(np.ones(1000))
        clock.mark("eugo-h2d")
        time.sleep(0.02)
        np.sin(x)
        clock.mark("eugo-device-compute")
    assert set(clock.seconds) == {"eugo-h2d", "eugo-device-compute"}
    assert clock.seconds["eugo-device-compute"] >= 0.015 > clock.seconds["eugo-h2d"]
    assert clock.wall_s >= clock.launch_s >= clock.device_s * 0.9
    assert device_stats()["device_seconds"] >= 0.015


def test_pool_limit_holds_freed_blocks_and_releases_them():
    reset_device_stats()
    dev = EmulatedDevice(10**6, settings=DeviceSettings(memory_fraction=0.5))
    assert dev.pool_limit_bytes == 500_000
    with pytest.raises(EmulatedOutOfMemoryError, match="on emulated device 0"):
        dev.to_device(np.ones(70_000))  # 560 kB > 50% of 1 MB
    a = dev.to_device(np.ones(40_000))  # 320 kB
    del a
    (entry,) = dev.memory_stats()["ordinals"]
    assert (entry["pool_used_bytes"], entry["pool_held_bytes"]) == (0, 320_000)  # CuPy keeps it
    b = dev.to_device(np.ones(20_000))  # reuses the held block
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 320_000
    c = dev.to_device(np.ones(30_000))  # past the limit with what is held: held blocks go first
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 400_000
    del b, c
    assert dev.release_memory() == 400_000
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 0
    assert device_stats()["released_bytes"] == 400_000


def test_idle_release_gives_pools_back():
    dev = EmulatedDevice(10**6, settings=DeviceSettings(idle_release_s=0.05))
    with dev.task():
        x = dev.to_device(np.ones(1000))
    del x
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 8000
    deadline = time.monotonic() + 5
    while dev.memory_stats()["ordinals"][0]["pool_held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 0


def _held(dev):
    entry = dev.memory_stats()["ordinals"][0]
    return entry["pool_held_bytes"] - entry["pool_used_bytes"]


def test_idle_release_waits_for_a_copy_outside_a_task():
    # issue 31: the releaser counted only task scopes, so a copy running outside one (a
    # to-host task, a transfer to a peer) looked idle and had the pool freed under it
    dev = EmulatedDevice(10**6, settings=DeviceSettings(idle_release_s=3600))  # ticked by hand
    with dev.task():
        x = dev.to_device(np.ones(1000))
        garbage = dev.to_device(np.ones(500))
    del garbage
    assert _held(dev) == 4000
    started, finish = threading.Event(), threading.Event()
    copy_back = dev._to_host

    def slow_copy(array):
        started.set()
        assert finish.wait(10)
        return copy_back(array)

    dev._to_host = slow_copy
    copier = threading.Thread(target=dev.to_host, args=(x,))
    copier.start()
    try:
        assert started.wait(10)
        dev._release_if_idle(0.0)
        assert _held(dev) == 4000  # the copy runs: not idle
    finally:
        finish.set()
        copier.join(10)
    dev._release_if_idle(0.0)
    assert _held(dev) == 0  # idle now


@pytest.mark.parametrize("fault, kind", [
    ("out-of-memory", OUT_OF_MEMORY),
    ("rmm-out-of-memory", OUT_OF_MEMORY),  # RMM raises a plain MemoryError
    ("library", LIBRARY),
    ("compile", COMPILE),
    ("runtime", RUNTIME),
    ("sticky", STICKY),
    ("unavailable", UNAVAILABLE),
])
def test_error_classes(device, fault, kind):
    device.inject_fault(fault, where="h2d")
    with pytest.raises(BaseException) as info:
        device.to_device(np.ones(3))
    assert device.classify_error(info.value) == kind and device.is_device_error(info.value)
    assert device.classify_error(TypeError("unsupported")) is None
    # a device error behind another exception is still one
    try:
        raise RuntimeError("wrapped") from info.value
    except RuntimeError as wrapped:
        assert device.classify_error(wrapped) == kind


def test_sticky_error_turns_the_device_off_for_the_process(device, caplog):
    device.inject_fault("sticky", where="sync")  # as CUDA: the fault shows at synchronisation
    with caplog.at_level(logging.WARNING, logger="eugo_dask.devices"):
        with pytest.raises(EmulatedCudaError, match="cudaErrorIllegalAddress"):
            with device.task():
                np.sin(device.to_device(np.ones(3)))  # launched fine
        assert "STICKY" not in caplog.text and "off in this process" in caplog.text
    assert device.unusable_reason.startswith("sticky error: EmulatedCudaError")
    with pytest.raises(DeviceDisabled, match="the emulated device is off in this process: sticky"):
        with device.task():
            pass
    stats = device_stats()
    assert stats["device_errors"] == {"sticky": 1}
    assert stats["disabled"]["emulated"].startswith("sticky error")
    # noting the same error again counts it once
    device.note_error(EmulatedCudaError(700, "x"))
    assert device_stats()["device_errors"] == {"sticky": 2}


def test_out_of_memory_releases_held_memory_and_keeps_the_device(device):
    x = device.to_device(np.ones(1000))
    del x
    assert device.memory_stats()["ordinals"][0]["pool_held_bytes"] == 8000
    device.inject_fault("rmm-out-of-memory")
    with pytest.raises(MemoryError):
        with device.task():
            device.to_device(np.ones(3)) + 1
    assert device.memory_stats()["ordinals"][0]["pool_held_bytes"] <= 24  # the task's own input
    assert device.unusable_reason is None
    with device.task():  # usable again
        device.to_device(np.ones(3)) + 1


def test_injected_faults_are_checked(device):
    with pytest.raises(ValueError, match=r"fault kind must be one of \["):
        device.inject_fault("meltdown")
    with pytest.raises(ValueError, match=r"fault place must be one of \['compute', 'sync', 'h2d', 'd2h'\]"):
        device.inject_fault("sticky", where="later")


def test_device_bytes_are_not_host_memory_in_a_worker_spill_buffer(tmp_path, device):
    from distributed.spill import SpillBuffer

    class Worker:
        data = SpillBuffer(str(tmp_path), target=50_000)

    worker = Worker()
    worker.data["before"] = device.to_device(np.ones(1_000))  # 8 kB on the device
    assert worker.data.fast.total_weight == 8_000  # distributed counts it as host memory
    assert install_device_accounting(worker) and install_device_accounting(worker)  # idempotent
    assert worker.data.fast.total_weight == 0  # re-weighed
    worker.data["device"] = device.to_device(np.ones(10_000))
    worker.data["host"] = np.ones(1_000)  # 8 kB
    assert set(worker.data.fast) == {"before", "device", "host"}  # nothing spilled
    worker.data["big-host"] = np.ones(10_000)  # 80 kB of host memory: past the target
    assert "big-host" in worker.data.slow
    assert device_nbytes({"a": [worker.data["device"], np.ones(3)]}) == 80_000


def test_device_accounting_in_a_real_worker():
    from distributed.utils_test import gen_cluster

    @gen_cluster(nthreads=[("127.0.0.1", 1)])
    async def check(scheduler, worker):
        assert install_device_accounting(worker)
        dev = EmulatedDevice(10**7)
        value = (dev.to_device(np.ones(100_000)), np.ones(10))
        assert worker.data.fast.weight("x", value) == worker.data.weight("x", value) < 1000

    check()


def _emulated_result(n):
    from eugo_dask.runtime import get_device

    return get_device("emulated").to_device(np.ones(n))  # as a GPU task's result


def test_host_spilling_leaves_device_values_in_memory():
    """Past the spill threshold distributed evicts the oldest values until process memory falls
    below target; a device value frees no host memory there (it would be copied back and
    pickled), so only host values go to disk, and evicting stops when only device values are
    left."""
    from distributed.utils_test import gen_cluster

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
                 worker_kwargs={"memory_limit": "1 GiB"},
                 config={"eugo.device": "emulated", "distributed.worker.memory.monitor-interval": "1h"})
    async def check(client, scheduler, worker):
        device = [client.submit(_emulated_result, 10_000 + i, pure=False) for i in range(3)]
        host = [client.submit(np.ones, 10_000 + i, pure=False) for i in range(2)]
        await client.gather(device + host)
        assert getattr(worker.data, "_eugo_device_accounting", False)
        worker.monitor.get_process_memory = lambda: 2**30  # stays at the limit whatever is spilled
        await worker.memory_manager._spill(worker, 2**30)
        assert {f.key for f in device} <= set(worker.data.fast)
        assert not {f.key for f in device} & set(worker.data.slow)
        assert {f.key for f in host} <= set(worker.data.slow)  # host values were spilled
        assert worker.data.evict() == -1  # nothing host-side left to evict
        results = await client.gather(device)
        assert [float(np.sum(r)) for r in results] == [10_000, 10_001, 10_002]

    check()


def test_device_metrics_on_the_process_registry(three):
    prometheus_client = pytest.importorskip("prometheus_client")
    x = three.to_device(np.ones(1000), ordinal=1)
    text = prometheus_client.generate_latest().decode()
    assert 'eugo_device_memory_bytes{device="emulated",kind="array",ordinal="1"} 8000.0' in text
    assert 'eugo_device_tasks_in_flight{device="emulated",ordinal="2"} 0.0' in text
    assert three.memory_stats() in device_memory_stats()
    assert three.memory_stats()["ordinals"][1]["array_bytes"] == 8000
    del x


# ---------------------------------------------------------------------------------------------
# CuPy installed without a GPU (CI's third venv): classification and honest detection
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def cupy_without_gpu():
    """CuPy where it is installed and finds no usable device (CI runs the suite so too)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed in this environment")
    from eugo_dask.devices import cupy_unusable_reason

    if cupy_unusable_reason() is None:
        pytest.skip("a usable CUDA device is here: tests/test_gpu.py covers it")
    return cupy


def test_cupy_error_classes(cupy_without_gpu):
    from eugo_dask.devices import CupyDevice

    cupy = cupy_without_gpu
    dev = CupyDevice(cupy, count=1)  # builds without touching CUDA
    runtime = cupy.cuda.runtime
    assert dev.classify_error(runtime.CUDARuntimeError(700)) == STICKY  # illegal address
    assert dev.classify_error(runtime.CUDARuntimeError(719)) == STICKY  # launch failure
    assert dev.classify_error(runtime.CUDARuntimeError(2)) == OUT_OF_MEMORY  # e.g. pinned memory
    assert dev.classify_error(runtime.CUDARuntimeError(701)) == RUNTIME  # out of resources
    assert dev.classify_error(runtime.CUDARuntimeError(35)) == UNAVAILABLE  # driver too old
    assert dev.classify_error(cupy.cuda.memory.OutOfMemoryError(1024, 0, 0)) == OUT_OF_MEMORY
    assert dev.classify_error(MemoryError("std::bad_alloc: out_of_memory: RMM failure")) == OUT_OF_MEMORY
    from cupy.cuda.compiler import CompileException

    assert dev.classify_error(CompileException("error", "src", "name", (), "nvrtc")) == COMPILE
    # CuPy 14 loads CUDA libraries lazily: a missing one is an ImportError at first use
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except ImportError as missing:
        assert dev.classify_error(missing) == UNAVAILABLE
    assert dev.classify_error(ValueError("axis out of range")) is None


def test_cupy_without_a_gpu_says_why(cupy_without_gpu):
    from eugo_dask.devices import cupy_device_count, cupy_unusable_reason, resolve_device_name

    reason = cupy_unusable_reason()
    assert reason.startswith("CuPy is installed but finds no usable CUDA device (cudaError")
    assert cupy_device_count() == 0 and resolve_device_name("auto") is None
    assert resolve_device_name("cupy") is None  # a worker: its tasks run their CPU path
    with pytest.raises(RuntimeError, match=r"eugo.device is 'cupy' but no CUDA device can run GPU "
                                           r"tasks here: CuPy is installed but finds no usable"):
        resolve_device_name("cupy", explicit_error=True)
    with dask.config.set({"eugo.device": "cupy"}):
        from eugo_dask.config import read_settings

        with pytest.raises(RuntimeError, match=r"Set eugo.device to 'auto' to run on the CPU"):
            read_settings().resolved()
        # planned for a cluster's GPU workers, this process needs no device
        assert read_settings().resolved(gpu_workers=True).device == "cupy"


# ---------------------------------------------------------------------------------------------
# CupyDevice's copy pipeline on a stand-in for CuPy with CUDA's ordering rules (tests/fake_cupy)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake(monkeypatch):
    import sys

    from eugo_dask.devices import CupyDevice

    from . import fake_cupy

    module = fake_cupy.module(device_count=2)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupy.fft", module.fft)
    monkeypatch.setitem(sys.modules, "cupy.fft.config", module.fft.config)
    fake_cupy.reset()
    reset_device_stats()
    dev = CupyDevice(module, DeviceSettings(staging_bytes=64 * 1024, fft_plan_cache_size=3,
                                            fft_plan_cache_bytes=1 << 20, gpus="all"))
    dev.direct_copy_bytes = 4096  # stage everything past 4 kB in 64 kB chunks
    yield dev, fake_cupy


@pytest.mark.parametrize("nbytes", [800, 64 * 1024, 3 * 64 * 1024, 3 * 64 * 1024 + 8 * 37])
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_staged_copies_round_trip_on_fake_cupy(fake, nbytes, layout):
    dev, _ = fake
    n = nbytes // 8
    host = np.arange(2 * n, dtype=np.float64).reshape(2, n)
    host = {"C": host[:, :n // 2 * 2].copy(), "F": np.asfortranarray(host), "strided": host[:, ::2]}[layout]
    back_outside = dev.to_host(dev.to_device(host))
    with dev.task(0):
        on_device = dev.to_device(host)
        back_inside = dev.to_host(on_device)
    for back in (back_outside, back_inside):
        np.testing.assert_array_equal(back, host)
    assert back_outside.flags.f_contiguous == (layout == "F")


def test_copies_in_a_task_are_asynchronous_until_it_ends(fake):
    dev, _ = fake
    first, second = np.arange(50_000.0), np.arange(50_000.0) * -1  # 400 kB: 7 chunks each
    with dev.task(0) as clock:
        a = dev.to_device(first)
        b = dev.to_device(second)  # reuses the staging buffers a's copies still read from
        assert not np.array_equal(b.peek(), second)  # b's last chunks have not run yet
        clock.mark("eugo-h2d")
    np.testing.assert_array_equal(a.peek(), first)  # the scope's end waited for both
    np.testing.assert_array_equal(b.peek(), second)
    assert list(clock.seconds) == ["eugo-h2d"]
    # outside a task a copy is complete when it returns
    c = dev.to_device(first)
    np.testing.assert_array_equal(c.peek(), first)
    assert device_stats()["h2d_count"] == 3 and device_stats()["h2d_bytes"] == 3 * 400_000


# --- the copy engine's host half (eugo_dask/devices/copies.py) ------------------------------------
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 4096 + 7, 5 * 4096 * 4 + 13, 1 << 20])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_host_copy_split_over_threads_lands_in_place(nbytes, threads):
    from eugo_dask.devices.copies import PIECE_ALIGN, HostCopier, split_bounds

    bounds = split_bounds(nbytes, threads)
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes and len(bounds) <= threads
    assert all(a % PIECE_ALIGN == 0 and a < b for a, b in bounds)
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))  # no gap, no overlap
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 2, np.uint8)
    HostCopier(threads, PIECE_ALIGN).copy(dst[1:-1], src)  # an odd offset, guards either side
    assert dst[0] == dst[-1] == 0
    np.testing.assert_array_equal(dst[1:-1], src)


def test_staged_copies_split_over_threads_on_fake_cupy(fake, monkeypatch):
    """Each 64 kB staging chunk is copied by four threads (16 kB pieces), both ways; odd sizes
    and layouts round-trip under CUDA's ordering rules."""
    import os

    dev, fake_cupy = fake
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # as on a GPU host (at most its cores)
    split = type(dev)(dev.cupy, DeviceSettings(staging_bytes=64 * 1024, copy_threads=4,
                                               copy_piece_bytes=16 * 1024))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert type(dev)(dev.cupy, DeviceSettings(copy_threads=4))._copier.threads == 2
    split.direct_copy_bytes = 4096
    threads = []
    copyto = np.copyto

    def spy(dst, src, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return copyto(dst, src, *args, **kwargs)

    monkeypatch.setattr(np, "copyto", spy)
    for n in (50_001, 3 * 8192 + 5):
        for host in (np.arange(n, dtype=np.float64), np.asfortranarray(np.arange(2 * n).reshape(2, n))):
            np.testing.assert_array_equal(split.to_host(split.to_device(host)), host)
            with split.task(0):
                back = split.to_host(split.to_device(host * 2))
            np.testing.assert_array_equal(back, host * 2)
    assert any(t.startswith("eugo-copy") for t in threads)
    assert split._copier.pieces(64 * 1024) == 4 and split._copier.pieces(20 * 1024) == 1


def test_results_land_in_pinned_blocks_from_a_bounded_pool(fake):
    """A result copied back of at least pinned-results-min is a pool block the device copies
    into straight (one DMA, waited for); the block serves the next result once its array is
    gone, and a full pool falls back to staging into a new array."""
    import gc

    dev, fake_cupy = fake
    pooled = type(dev)(dev.cupy, DeviceSettings(staging_bytes=64 * 1024, pinned_results_bytes=768 * 1024,
                                                pinned_results_min_bytes=64 * 1024))
    pooled.direct_copy_bytes = 4096
    host = np.arange(60_000, dtype=np.float64).reshape(300, 200)  # 480 kB
    out = pooled.to_host(pooled.to_device(host))
    assert pooled._results.owns(out) and fake_cupy._is_pinned(out.ctypes.data)
    np.testing.assert_array_equal(out, host)  # the DMA into pinned memory was waited for
    address = out.ctypes.data
    second = pooled.to_host(pooled.to_device(host + 1))  # 768 kB pool: no room for a second
    assert not pooled._results.owns(second)
    np.testing.assert_array_equal(second, host + 1)
    del out
    gc.collect()
    with pooled.task(0):
        again = pooled.to_host(pooled.to_device(np.asfortranarray(host * 3)))
    assert again.ctypes.data == address and again.flags.f_contiguous
    np.testing.assert_array_equal(again, host * 3)
    assert pooled.memory_stats()["pinned_result_bytes"] == pooled._results.held_bytes() == 512 * 1024
    assert dev._results.empty((1000,), np.float64) is None  # below pinned-results-min
    del again
    pooled._results.clear()

    def no_pinned_memory(nbytes):
        raise fake_cupy.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    pooled._results._allocate = no_pinned_memory
    np.testing.assert_array_equal(pooled.to_host(pooled.to_device(host)), host)  # staged instead


def test_a_result_pool_reuses_by_size_class_and_stays_bounded():
    import gc

    from eugo_dask.devices.copies import ResultPool, _size_class

    assert [_size_class(n) for n in (5000, 8192, 8193, 10_000, 12_289)] == [5120, 8192, 10240, 10240, 14336]
    made = []
    pool = ResultPool(lambda n: made.append(n) or np.zeros(n, np.uint8), 24 * 1024, min_bytes=4096)
    assert pool.empty((100,), np.uint8) is None  # below min_bytes
    a = pool.empty((1000,), np.float64)  # 8000 B -> an 8 kB block
    b = pool.empty((1200,), np.float64, order="F")  # 9600 B -> a 10 kB block
    assert pool.empty((1000,), np.float64) is None  # 18 kB held, 8 more would pass 24
    del a
    gc.collect()
    c = pool.empty((900,), np.float64)  # 7200 B: the 8 kB class, a's block again
    assert made == [8192, 10240] and pool.held_bytes() == 18 * 1024
    del b, c
    gc.collect()
    d = pool.empty((1600,), np.float64)  # 12.8 kB: free blocks dropped to make room
    # the 8 kB block was dropped (the first free one), the 10 kB one kept: 24 kB held
    assert d is not None and made[-1] == 14336 and pool.held_bytes() == 24 * 1024
    assert pool.free_bytes() == 10240 and pool.clear() == 10240 and pool.held_bytes() == 14336


def test_large_results_land_in_pinned_blocks_by_default(fake):
    """With the configured defaults, a result copied back of 64 MiB or more is a pinned pool
    block (one DMA, counted in d2h_pinned); one just below is staged into a new array."""
    from eugo_dask.config import device_settings

    dev, fake_cupy = fake
    settings = device_settings()
    assert (settings.pinned_results_bytes, settings.pinned_results_min_bytes) == (1 << 30, 64 << 20)
    default = type(dev)(dev.cupy, settings)
    big = np.arange(8 << 20, dtype=np.float64)  # 64 MiB
    out = default.to_host(default.to_device(big))
    assert default._results.owns(out) and fake_cupy._is_pinned(out.ctypes.data, out.nbytes)
    np.testing.assert_array_equal(out, big)
    small = default.to_host(default.to_device(big[:-512]))  # 4 kB short of 64 MiB
    assert not default._results.owns(small)
    np.testing.assert_array_equal(small, big[:-512])
    assert device_stats()["d2h_pinned"] == 1 and device_stats()["d2h_count"] == 2
    assert default.memory_stats()["pinned_result_bytes"] == 64 << 20
    assert default.memory_stats()["pinned_result_free_bytes"] == 0  # in a result
    prometheus_client = pytest.importorskip("prometheus_client")
    text = prometheus_client.generate_latest().decode()
    gauge = [line for line in text.splitlines()
             if line.startswith('eugo_device_pinned_result_bytes{device="cupy",kind="in_results"}')]
    assert 64 << 20 in {float(line.split()[-1]) for line in gauge}  # (other tests' devices may live on)


def _spill_until_below_target(worker_data, process_memory, limit):
    """distributed's memory monitor on ``worker_data``: past the spill threshold (70% of
    ``limit``) evict until process memory is below target (60%)."""
    import asyncio
    import gc

    from distributed.worker_memory import WorkerMemoryManager

    manager = types.SimpleNamespace(
        memory_limit=limit, memory_target_fraction=0.6, memory_spill_fraction=0.7, data=worker_data,
        memory_monitor_interval=3600, _throttled_gc=types.SimpleNamespace(collect=gc.collect),
        _maybe_pause_or_unpause=lambda *args: None)
    worker = types.SimpleNamespace(monitor=types.SimpleNamespace(get_process_memory=process_memory))
    asyncio.run(asyncio.wait_for(WorkerMemoryManager._spill(manager, worker, process_memory()), 30))


def test_spilling_a_pinned_result_gives_its_block_back_to_the_host(fake, tmp_path):
    """A result in a pinned block weighs its bytes in the spill buffer, and spilling it frees
    host memory: its block, free in the pool once the value is on disk, is given back before
    the next value is evicted (pinned_released_bytes). Without that the process's memory
    stayed where it was and distributed went on until every value was on disk."""
    from distributed.spill import SpillBuffer

    from eugo_dask.devices.accounting import release_host_caches

    dev, fake_cupy = fake
    pooled = type(dev)(dev.cupy, DeviceSettings(staging_bytes=64 * 1024, pinned_results_bytes=1 << 20,
                                                pinned_results_min_bytes=64 * 1024))
    pooled.direct_copy_bytes = 4096
    release_host_caches()  # other tests' devices' free blocks
    reset_device_stats()

    class Worker:
        data = SpillBuffer(str(tmp_path), target=10 << 20)

    worker = Worker()
    assert install_device_accounting(worker)
    for i in range(3):
        worker.data[f"r{i}"] = pooled.to_host(pooled.to_device(np.full(32 * 1024, float(i))))  # 256 kB
    assert pooled._results.held_bytes() == 768 * 1024 and worker.data.fast.total_weight == 768 * 1024
    limit = 1 << 20  # spill past 734 kB, down to 629 kB: one result's 256 kB is enough
    _spill_until_below_target(worker.data, lambda: pooled._results.held_bytes(), limit)
    assert len(worker.data.slow) == 1 and len(worker.data.fast) == 2
    assert pooled._results.held_bytes() == 512 * 1024
    assert device_stats()["pinned_released_bytes"] == 256 * 1024
    for i in range(3):
        np.testing.assert_array_equal(worker.data[f"r{i}"], np.full(32 * 1024, float(i)))


def test_a_copy_takes_the_path_nearest_its_size(monkeypatch):
    """choose_copy: the profile's point nearest the copy's size in log size (the larger of two
    as near) where the choice is per size; the config's rule where it is not (explicit config
    wins) or the profile has no point; never a pinned result where the pool's cap is 0."""
    from eugo_dask.devices import CopyChoice, choose_copy

    rules = dict(h2d_by_size=((1 << 20, "direct", None), (16 << 20, "staged", 8), (256 << 20, "registered", None)),
                 d2h_by_size=((4 << 20, "staged", 2), (64 << 20, "pinned", None)))
    every = DeviceSettings(per_size=frozenset({"threads", "h2d", "d2h"}), **rules)
    assert [choose_copy(every, "h2d", n << 20) for n in (1, 3, 4, 5, 63, 64, 1024)] == [
        ("direct", 8), ("direct", 8), ("staged", 8), ("staged", 8), ("staged", 8),
        ("registered", 8), ("registered", 8)]  # 4 MiB: as near 1 as 16 in log size: the larger
    assert choose_copy(every, "d2h", 16 << 20) == CopyChoice("pinned", 2)  # 16: as near 4 as 64
    assert choose_copy(every, "d2h", 15 << 20) == CopyChoice("staged", 2)
    # explicit threads, explicit paths: the config's rules at every size
    paths_only = DeviceSettings(per_size=frozenset({"h2d", "d2h"}), copy_threads=3, **rules)
    assert choose_copy(paths_only, "h2d", 16 << 20) == ("staged", 3)
    threads_only = DeviceSettings(per_size=frozenset({"threads"}), register_min_bytes=100 << 20, **rules)
    assert choose_copy(threads_only, "h2d", 200 << 20) == ("registered", 8)
    assert choose_copy(threads_only, "h2d", 2 << 20) == ("staged", 8)  # the nearest staged point's threads
    assert choose_copy(threads_only, "d2h", 63 << 20) == ("staged", 2)
    assert choose_copy(threads_only, "d2h", 64 << 20) == ("pinned", 2)  # pinned-results-min: 64 MiB
    none = DeviceSettings(**rules)
    assert choose_copy(none, "h2d", 1 << 30) == ("staged", 4) and choose_copy(none, "d2h", 1 << 30) == ("pinned", 4)
    assert choose_copy(DeviceSettings(per_size=every.per_size), "h2d", 1 << 30) == ("staged", 4)  # no points
    no_pool = DeviceSettings(per_size=every.per_size, pinned_results_bytes=0, **rules)
    assert choose_copy(no_pool, "d2h", 1 << 30) == ("staged", 2)
    assert choose_copy(every, "d2h", 1 << 30).name == "pinned" and CopyChoice("staged", 4).name == "staged-4"


def _copy_paths(dev, nbytes):
    """The paths a copy of ``nbytes`` each way took on ``dev``, read from the counters."""
    reset_device_stats()
    host = np.arange(nbytes // 8, dtype=np.float64)
    back = dev.to_host(dev.to_device(host))
    np.testing.assert_array_equal(back, host)
    stats = device_stats()
    h2d = ("registered" if stats["h2d_registered"] else "staged" if stats["h2d_staged"] else "direct")
    d2h = ("pinned" if stats["d2h_pinned"] else "staged" if stats["d2h_staged"] else "direct")
    return h2d, d2h, stats["staged_threads"]


def test_the_device_takes_the_path_the_profile_measured_best_at_each_size(fake, monkeypatch):
    """A CupyDevice with per-size copy paths copies each size the way its nearest point says
    (counted: h2d_registered, h2d_staged, d2h_pinned, d2h_staged, staged_threads), and where
    the choices are not per size (the config keys set), the config's way at every size."""
    import os

    dev, fake_cupy = fake
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    kb = 1024
    rules = dict(staging_bytes=64 * kb, copy_piece_bytes=16 * kb,
                 h2d_by_size=((128 * kb, "staged", 2), (512 * kb, "registered", None), (2048 * kb, "direct", None)),
                 d2h_by_size=((128 * kb, "staged", 4), (512 * kb, "pinned", None), (2048 * kb, "staged", 1)))
    per_size = type(dev)(dev.cupy, DeviceSettings(per_size=frozenset({"threads", "h2d", "d2h"}), **rules))
    per_size.direct_copy_bytes = 4096
    assert per_size._copier.threads == 4  # the most any point asks for
    assert _copy_paths(per_size, 128 * kb) == ("staged", "staged", {2: 1, 4: 1})
    assert _copy_paths(per_size, 512 * kb) == ("registered", "pinned", {})
    assert _copy_paths(per_size, 2048 * kb) == ("direct", "staged", {1: 1})
    assert not fake_cupy._registered and not fake_cupy.unpinned_copies
    # explicit config: no registration, pinned results from 1 MiB, 3 threads, at every size
    configured = type(dev)(dev.cupy, DeviceSettings(copy_threads=3, pinned_results_min_bytes=1 << 20, **rules))
    configured.direct_copy_bytes = 4096
    assert _copy_paths(configured, 128 * kb) == ("staged", "staged", {3: 2})
    assert _copy_paths(configured, 512 * kb) == ("staged", "staged", {3: 2})
    assert _copy_paths(configured, 2048 * kb) == ("staged", "pinned", {3: 1})


@pytest.fixture
def registering(fake):
    """A CupyDevice on the stand-in CuPy that page-locks host chunks of 64 kB and more in place."""
    dev, fake_cupy = fake
    dev = type(dev)(dev.cupy, DeviceSettings(staging_bytes=64 * 1024, register_min_bytes=64 * 1024))
    dev.direct_copy_bytes = 4096
    return dev, fake_cupy


def test_large_chunks_are_registered_in_place_for_one_dma(registering):
    """A contiguous chunk of register-in-place bytes or more is page-locked, copied in one DMA
    and unregistered only once the copy has run (the stand-in fills a copy whose host memory
    stopped being pinned with NaN bytes); in a task too, where the chunk may change or go as
    soon as to_device returns. Small and strided chunks are staged."""
    dev, fake_cupy = registering
    host = np.arange(40_000, dtype=np.float64).reshape(200, 200)  # 320 kB
    on_device = dev.to_device(host)
    assert fake_cupy.registrations == [(host.ctypes.data, host.nbytes)] and not fake_cupy._registered
    np.testing.assert_array_equal(on_device.peek(), host)
    with dev.task(0):
        chunk = np.asfortranarray(host * 2)
        inside = dev.to_device(chunk)
        chunk[:] = -1  # the copy has run: changing the chunk changes nothing on the device
    np.testing.assert_array_equal(dev.to_host(inside), host * 2)
    assert len(fake_cupy.registrations) == 2 and not fake_cupy._registered
    assert not fake_cupy.unpinned_copies
    dev.to_device(host[:, ::2].copy()[:4])  # 6.4 kB: below the threshold
    dev.to_device(host[:, ::2])  # strided: made contiguous (a new array) and staged
    assert len(fake_cupy.registrations) == 2
    stats = device_stats()
    assert stats["h2d_registered"] == 2 and stats["h2d_register_refused"] == 0
    assert dev.memory_stats()["pinned_bytes"] == 2 * 64 * 1024  # staging buffers for the strided one


@pytest.mark.parametrize("why", ["registered already", "refused"])
def test_a_chunk_cuda_will_not_register_is_staged(registering, why):
    """Pages registered already (another copy of the same chunk, a neighbouring view) or memory
    CUDA will not page-lock: the copy is staged, the other registration left alone."""
    dev, fake_cupy = registering
    host = np.arange(20_000, dtype=np.float64)  # 160 kB
    if why == "registered already":
        fake_cupy.host_register(host[1000:].ctypes.data, 8, 0)  # a page in the middle
    else:
        fake_cupy.refuse_registration[0] = 1  # cudaErrorInvalidValue (read-only memory, say)
    np.testing.assert_array_equal(dev.to_host(dev.to_device(host)), host)
    assert device_stats()["h2d_registered"] == 0 and device_stats()["h2d_register_refused"] == 1
    assert len(fake_cupy._registered) == (why == "registered already")


def test_a_registered_copy_that_fails_raises_its_error_and_unregisters(registering, monkeypatch):
    dev, fake_cupy = registering

    def fail(self, src, size, stream=None):
        raise fake_cupy.CUDARuntimeError(1)  # cudaErrorInvalidValue

    def unregister_and_complain(ptr):
        fake_cupy.host_unregister(ptr)
        raise fake_cupy.CUDARuntimeError(4)  # cudaErrorCudartUnloading, say

    monkeypatch.setattr(fake_cupy.MemoryPointer, "copy_from_host_async", fail)
    monkeypatch.setattr(dev.cupy.cuda.runtime, "hostUnregister", unregister_and_complain)
    with pytest.raises(fake_cupy.CUDARuntimeError) as raised:
        dev.to_device(np.ones(20_000))
    assert raised.value.status == 1  # the copy's error, not the unregistering's
    assert len(fake_cupy.registrations) == 1 and not fake_cupy._registered


def test_a_pinned_result_goes_back_to_the_device_without_staging(fake, monkeypatch):
    """A result in a pinned pool block copied to the device again is one DMA from it, finished
    before to_device returns (its block may serve another result next)."""
    dev, fake_cupy = fake
    sources = []
    dma = fake_cupy.MemoryPointer.copy_from_host_async
    monkeypatch.setattr(fake_cupy.MemoryPointer, "copy_from_host_async",
                        lambda self, src, size, stream=None: sources.append((src, size)) or dma(self, src, size, stream))
    pooled = type(dev)(dev.cupy, DeviceSettings(staging_bytes=64 * 1024, pinned_results_bytes=1 << 20,
                                                pinned_results_min_bytes=64 * 1024))
    pooled.direct_copy_bytes = 4096
    back = np.arange(30_000, dtype=np.float64)
    with pooled.task(0):
        result = pooled.to_host(pooled.to_device(back))  # staged there, into a pinned block
    staging = pooled.memory_stats()["pinned_bytes"]
    sources.clear()
    with pooled.task(0):
        again = pooled.to_device(result)
        assert sources == [(result.ctypes.data, result.nbytes)]  # one DMA, straight from the block
        result[:] = 0  # the DMA out of the block has run
    np.testing.assert_array_equal(pooled.to_host(again), back)
    assert pooled.memory_stats()["pinned_bytes"] == staging and not fake_cupy.unpinned_copies


def test_fake_cupy_registration_follows_cuda(fake):
    """The stand-in's cudaHostRegister: pinned in place, refused twice (whole pages), refused
    on pinned allocations; a copy queued from registered memory that runs after it is
    unregistered reads memory CUDA no longer holds."""
    _, fake_cupy = fake
    host = np.ones(3 * 4096)
    fake_cupy.host_register(host.ctypes.data, host.nbytes, 0)
    assert fake_cupy._is_pinned(host.ctypes.data, host.nbytes)
    for ptr, size in ((host.ctypes.data, 8), (host[-1:].ctypes.data, 8)):
        with pytest.raises(fake_cupy.CUDARuntimeError) as refused:
            fake_cupy.host_register(ptr, size, 0)
        assert refused.value.status == fake_cupy.ALREADY_REGISTERED
    pinned = fake_cupy.PinnedMemory(4096)
    with pytest.raises(fake_cupy.CUDARuntimeError, match="712"):
        fake_cupy.host_register(pinned.ptr, 16, 0)
    out = fake_cupy.empty(host.shape)
    stream = fake_cupy.Stream(non_blocking=True)
    out.data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)  # queued (pinned)
    fake_cupy.host_unregister(host.ctypes.data)  # too early: nothing waited for the copy
    stream.synchronize()
    assert fake_cupy.unpinned_copies == [(host.ctypes.data, host.nbytes)] and np.isnan(out.peek()).all()
    with pytest.raises(fake_cupy.CUDARuntimeError, match="713"):
        fake_cupy.host_unregister(host.ctypes.data)


def test_several_fake_gpus_select_and_move(fake):
    dev, fake_cupy = fake
    assert dev.count == 2
    x = dev.to_device(np.ones(1000), ordinal=1)
    assert dev.ordinal_of(x) == 1 and dev.select(([x], np.ones(3))) == 1
    moved = dev.move(x, 0)
    assert dev.ordinal_of(moved) == 0 and dev.move(moved, 0) is moved
    np.testing.assert_array_equal(dev.to_host(moved), np.ones(1000))
    assert device_stats()["d2d_count"] == 1
    # outside a task, with no device named: CuPy's current device, as code that chose none expects
    with fake_cupy.Device(1):
        assert dev.ordinal_of(dev.to_device(np.ones(3))) == 1
    assert dev.ordinal_of(dev.to_device(np.ones(3))) == 0


def _tasks_on_threads(dev, threads=8):
    """The ordinals of ``threads`` worker threads' tasks, all in flight at once."""
    import concurrent.futures

    barrier = threading.Barrier(threads, timeout=10)

    def run(_):
        with dev.task() as clock:
            barrier.wait()
            return clock.ordinal

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return set(pool.map(run, range(threads), timeout=30))


def test_one_gpu_per_process_unless_configured(fake, monkeypatch):
    """A process drives its current GPU (dask-cuda's processes each see all GPUs, rotated);
    every GPU it sees only with gpus-per-process all, and never under dask-cuda or RMM."""
    import sys

    dev, fake_cupy = fake
    module = fake_cupy.module(device_count=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one = type(dev)(module)
    assert one.ordinals == (0,) and _tasks_on_threads(one) == {0}
    with fake_cupy.Device(2):  # a process that made GPU 2 its own
        two = type(dev)(module)
    assert two.ordinals == (2,) and _tasks_on_threads(two) == {2}
    assert two.ordinal_of(two.to_device(np.ones(3))) == 2  # outside a task, no device named
    everything = type(dev)(module, DeviceSettings(gpus="all"))
    assert everything.ordinals == (0, 1, 2, 3) and _tasks_on_threads(everything) == {0, 1, 2, 3}
    assert [d["ordinal"] for d in everything.memory_stats()["ordinals"]] == [0, 1, 2, 3]
    # dask-cuda's worker: all configured, one driven
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,0,1")
    assert type(dev)(module, DeviceSettings(gpus="all")).ordinals == (0,)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert type(dev)(module, DeviceSettings(gpus="all")).count == 4
    monkeypatch.setitem(sys.modules, "dask_cuda", types.ModuleType("dask_cuda"))
    assert type(dev)(module, DeviceSettings(gpus="all")).ordinals == (0,)
    monkeypatch.delitem(sys.modules, "dask_cuda")
    monkeypatch.setattr(module.cuda, "get_allocator", lambda: object().__hash__)  # RMM's
    assert type(dev)(module, DeviceSettings(gpus="all")).ordinals == (0,)


def test_gpus_per_process_is_checked():
    from eugo_dask.config import device_settings

    with dask.config.set({"eugo.gpus-per-process": "all"}):
        assert device_settings().gpus == "all"
    assert device_settings().gpus == "one"
    with dask.config.set({"eugo.gpus-per-process": 2}):
        with pytest.raises(ValueError, match=r"eugo.gpus-per-process must be one of \['one', 'all'\]; got 2"):
            device_settings()


def test_fake_cupy_pool_limit_fft_caches_and_errors(fake):
    dev, fake_cupy = fake
    limited = type(dev)(dev.cupy, DeviceSettings(memory_fraction=1e-6))  # 80 kB of a fake 80 GB
    with pytest.raises(MemoryError) as info:
        limited.to_device(np.ones(20_000))
    assert limited.classify_error(info.value) == OUT_OF_MEMORY
    assert limited.memory_stats()["ordinals"][0]["pool_limit_bytes"] == 80_000
    fake_cupy.pool.limit = 0
    with dev.task(1):
        cache = fake_cupy.get_plan_cache()
    assert (cache.size, cache.memsize) == (3, 1 << 20)  # this thread's cache on device 1, bounded
    cache.plans = 2
    assert dev.memory_stats()["ordinals"][1]["fft_plans"] == 2
    dev.release_memory()
    assert cache.plans == 0
    assert dev.classify_error(fake_cupy.CUDARuntimeError(700)) == STICKY
    assert dev.memory_stats()["pinned_bytes"] == 0  # staging buffers come with a thread's first copy
    dev.to_device(np.ones(100_000))
    assert dev.memory_stats()["pinned_bytes"] == 2 * 64 * 1024  # this thread's two buffers


def test_copies_wait_for_work_queued_on_the_default_stream(fake):
    dev, fake_cupy = fake
    x = dev.to_device(np.zeros(100_000))
    # a kernel some code outside eugo's scopes queued on the legacy default stream, not run yet
    fake_cupy.Stream.null._enqueue(lambda: x.peek().__setitem__(slice(None), 5.0))
    np.testing.assert_array_equal(dev.to_host(x), np.full(100_000, 5.0))
    fake_cupy.Stream.null._enqueue(lambda: x.peek().__setitem__(slice(None), 7.0))
    with dev.task(0):
        back = dev.to_host(x)
    np.testing.assert_array_equal(back, np.full(100_000, 7.0))


def test_gpu_extra_lets_distributed_serialize_cupy_arrays(cupy_without_gpu):
    """Device arrays cross between GPU workers through distributed's CuPy serializers, which
    need numba (or rmm): the gpu extra brings numba, and the worker plugin's receive fallback
    wraps them."""
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    from eugo_dask.worker import install_receive_fallback

    cupy = cupy_without_gpu
    assert dask_serialize.dispatch(cupy.ndarray) is not None  # registers; ImportError without numba
    assert install_receive_fallback()
    assert getattr(dask_deserialize.dispatch(cupy.ndarray), "_eugo_receive", False)


# ---------------------------------------------------------------------------------------------
# Finalizers run by the cyclic collector inside a device's locked sections
# ---------------------------------------------------------------------------------------------
import gc  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


class _CollectingLock:
    """A device's lock that runs the cyclic collector as soon as it is taken: what any
    allocation inside a locked section may do, made certain."""

    def __init__(self, lock):
        self._inner = lock

    def __enter__(self):
        entered = self._inner.__enter__()
        gc.collect()
        return entered

    def __exit__(self, *exc_info):
        return self._inner.__exit__(*exc_info)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _collect_inside_locks(device):
    """From here on garbage waits (no automatic collection) and is collected inside every
    locked section of ``device``."""
    gc.disable()
    for name, value in list(vars(device).items()):
        if "lock" in name and hasattr(type(value), "__enter__"):
            setattr(device, name, _CollectingLock(value))


def _in_a_fresh_process(scenario, timeout=60):
    """Run ``scenario`` (a function of this module) in a new interpreter: a deadlock there
    fails the test at ``timeout`` and leaves no thread stuck on a lock in this process."""
    code = f"from tests.test_devices import {scenario.__name__}; {scenario.__name__}()"
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario.__name__} deadlocked: no end in {timeout} s")
    assert out.returncode == 0, out.stderr


def _free_an_emulated_array_under_the_pool_lock():
    device = EmulatedDevice(10**6)
    _collect_inside_locks(device)
    cycle = [device.to_device(np.ones(1000))]
    cycle.append(cycle)
    del cycle
    kept = device.to_device(np.ones(10))  # the collector frees the cycle's array in here
    # the cycle's array was freed (its block held by the pool, as CuPy's), the new one is live
    assert device.used_bytes == kept.nbytes == 80
    assert device.memory_stats()["ordinals"][0]["pool_held_bytes"] == 8000


def test_an_array_freed_by_the_collector_under_the_pool_lock_does_not_deadlock():
    # issue: a device array in a reference cycle, freed by the cyclic collector while its
    # thread held the pool lock, waited in its finalizer for that same lock for ever
    _in_a_fresh_process(_free_an_emulated_array_under_the_pool_lock)


def _free_staging_buffers_under_a_device_lock():
    from eugo_dask.devices import CupyDevice

    from . import fake_cupy

    module = fake_cupy.module(device_count=1)
    sys.modules.update({"cupy": module, "cupy.fft": module.fft, "cupy.fft.config": module.fft.config})
    dev = CupyDevice(module, DeviceSettings(staging_bytes=64 * 1024))
    dev.direct_copy_bytes = 4096  # stage everything past 4 kB
    x = dev.to_device(np.ones(100_000))  # this thread's two staging buffers
    _collect_inside_locks(dev)

    def fail(*args, **kwargs):
        raise RuntimeError("copy failed")

    fake_cupy.MemoryPointer.copy_to_host_async = fail

    def copy_back_and_keep_the_error():
        try:
            dev.to_host(x)  # staged: this thread's buffers are made, then the copy fails
        except RuntimeError as exc:
            error = exc  # noqa: F841 (the frame keeps its error: a reference cycle)

    thread = threading.Thread(target=copy_back_and_keep_the_error)
    thread.start()
    thread.join()
    # the collector frees the dead thread's buffers in here; the main thread's are left
    assert dev.memory_stats()["pinned_bytes"] == 2 * 64 * 1024


def test_staging_buffers_freed_by_the_collector_under_a_device_lock_do_not_deadlock():
    # the same shape on the CuPy path: a thread's staging buffers outlive it in a reference
    # cycle (an error kept by the frame that caught it, whose traceback holds the copy's frame)
    _in_a_fresh_process(_free_staging_buffers_under_a_device_lock)


# ---------------------------------------------------------------------------------------------
# The stand-in CuPy itself: CUDA's ordering rules, which the tests above rely on
# ---------------------------------------------------------------------------------------------
def test_fake_cupy_queues_kernels_until_something_waits(fake):
    _, fake_cupy = fake
    x = fake_cupy.empty((4,))
    x.peek()[...] = 1.0
    y = x * 2  # queued on the legacy default stream
    assert np.isnan(y.peek()).all()  # a fresh block: NaN until its kernel runs
    fake_cupy.Stream.null.synchronize()
    np.testing.assert_array_equal(y.peek(), 2.0)
    # a non-blocking stream has no ordering with the legacy stream; an event gives it one
    stream = fake_cupy.Stream(non_blocking=True)
    z = x + 1  # legacy stream
    with stream:
        w = x * 3
    stream.synchronize()
    assert np.isnan(z.peek()).all() and (w.peek() == 3.0).all()
    stream.wait_event(fake_cupy.Stream.null.record())
    with stream:
        v = x - 1
    stream.synchronize()  # runs the legacy stream's kernel first, through the event
    assert (z.peek() == 2.0).all() and (v.peek() == 0.0).all()


def test_fake_cupy_has_a_current_stream_per_device_and_refuses_0d_numpy(fake):
    _, fake_cupy = fake
    with fake_cupy.Device(1):
        stream = fake_cupy.Stream(non_blocking=True)
        with stream:
            assert fake_cupy.get_current_stream() is stream
            assert fake_cupy.get_current_stream(0) is fake_cupy.Stream.null  # device 0's own
    with pytest.raises(RuntimeError, match="does not match with the current device"):
        with stream:
            pass
    x = fake_cupy.empty((3,))
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        x + np.array(1.0)
    assert isinstance(x > np.array(1.0), fake_cupy.ndarray)  # comparisons take a 0-d array's value, as CuPy's __array_ufunc__ does
    assert isinstance(x + np.float64(1.0), fake_cupy.ndarray)  # NumPy scalars are fine


def test_fake_cupy_pool_reuses_a_block_only_on_the_stream_that_freed_it(fake):
    _, fake_cupy = fake
    other = fake_cupy.Stream(non_blocking=True)
    x = fake_cupy.empty((1000,))
    x.peek()[...] = 9.0
    a = fake_cupy.empty((1000,))
    a.peek()[...] = 5.0
    freed = a.data.ptr
    with other:
        copy = fake_cupy.empty((1000,))
        copy.data.copy_from_device_async(a.data, a.nbytes)  # reads a on another stream: queued
    del a  # back to the legacy stream's free list, though a copy on `other` still reads it
    with other:
        assert fake_cupy.empty((1000,)).data.ptr != freed  # not `other`'s to reuse
    b = x * 1  # a kernel on the legacy stream, in a's block
    assert b.data.ptr == freed
    fake_cupy.Stream.null.synchronize()  # it runs first...
    other.synchronize()
    np.testing.assert_array_equal(copy.peek(), 9.0)  # ...and the unordered copy reads its values


# ---------------------------------------------------------------------------------------------
# CupyDevice under those rules: copies back ordered after the kernels they read, waits that sleep
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["staged", "direct"])
def test_a_strided_view_copied_back_outside_a_task_follows_its_kernel(fake, path):
    # issue 31: the view was made contiguous on the legacy default stream and copied on eugo's
    # non-blocking stream with no ordering between them: all 200,000 values came back NaN
    dev, fake_cupy = fake
    if path == "direct":
        dev.direct_copy_bytes = 1 << 30
    host = np.arange(1000 * 400, dtype=np.float64).reshape(1000, 400)
    x = dev.to_device(host)
    doubled = x * 2  # a kernel queued on the legacy default stream (as code outside eugo runs)
    view = doubled[::2]  # 1000x400 -> every other row: not contiguous
    assert not (view.flags.c_contiguous or view.flags.f_contiguous)
    np.testing.assert_array_equal(dev.to_host(view), host[::2] * 2)
    # the same inside a task scope, and a transposed 3-D view
    cube = dev.to_device(np.arange(24.0).reshape(2, 3, 4))
    with dev.task(0):
        back = dev.to_host((cube + 1).transpose(2, 0, 1)[::2])
    np.testing.assert_array_equal(back, (np.arange(24.0).reshape(2, 3, 4) + 1).transpose(2, 0, 1)[::2])


def test_a_strided_view_moved_to_another_device_follows_its_kernel(fake):
    dev, fake_cupy = fake
    host = np.arange(200 * 300, dtype=np.float64).reshape(200, 300)
    x = dev.to_device(host, ordinal=1)
    with fake_cupy.Device(1):
        view = (x * 3)[:, ::3]  # queued on device 1's legacy stream
    moved = dev.move(view, 0)
    np.testing.assert_array_equal(dev.to_host(moved), host[:, ::3] * 3)


def test_every_wait_for_the_device_sleeps_on_a_blocking_sync_event(fake):
    # issue 31: waits spun a CPU core (default events, stream synchronisation); the events
    # eugo waits on are made with cudaEventBlockingSync
    dev, fake_cupy = fake
    big, small = np.arange(50_000.0), np.arange(100.0)  # staged (7 chunks) and direct
    with dev.task(0):
        a = dev.to_device(big)
        b = dev.to_device(small)
        back = dev.to_host(a * 2), dev.to_host(b)
    outside = dev.to_host(dev.to_device(big)[::2]), dev.to_host(dev.to_device(small))
    dev.move(dev.to_device(big, ordinal=1)[::5], 0)
    np.testing.assert_array_equal(back[0], big * 2)
    np.testing.assert_array_equal(outside[0], big[::2])
    assert len(fake_cupy.waits) > 10
    assert set(fake_cupy.waits) == {("event", True)}, Counter(fake_cupy.waits)


def test_idle_release_leaves_live_threads_fft_plans_to_them(fake):
    # issue 31: the idle release cleared every thread's cuFFT plan cache from its own thread;
    # CuPy's caches are not safe to clear from another thread
    dev, fake_cupy = fake
    ready, leave = threading.Event(), threading.Event()
    caches = {}

    def worker_thread(name):
        with dev.task(0):
            caches[name] = fake_cupy.get_plan_cache()
        caches[name].plans = 2
        if name == "live":
            ready.set()
            assert leave.wait(10)

    finished = threading.Thread(target=worker_thread, args=("finished",))
    finished.start()
    finished.join(10)
    live = threading.Thread(target=worker_thread, args=("live",))
    live.start()
    try:
        assert ready.wait(10)
        dev.release_memory(idle=True)
        assert caches["live"].plans == 2 and caches["live"].cleared_by == []
        assert caches["finished"].plans == 0  # its thread is gone: nobody else can use it
    finally:
        leave.set()
        live.join(10)


# ---------------------------------------------------------------------------------------------
# A child made by fork probes again
# ---------------------------------------------------------------------------------------------
def _in_a_forked_child(work, timeout=30):
    """Run ``work()`` in a child made by ``os.fork``; what it returns (a str) or raises."""
    import os
    import select

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on
        try:
            text = f"ok {work()}"
        except BaseException as exc:
            text = f"raised {type(exc).__name__}: {exc}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)
        assert ready, f"the forked child said nothing in {timeout} s"
        return os.read(read, 1 << 16).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("parent", ["probed", "used its device"])
def test_a_forked_child_probes_again_and_falls_back_to_the_cpu(fake, monkeypatch, parent):
    # issue 31: the child trusted the parent's probe and failed inside get_device (CUDA, used by
    # the parent, fails in a forked child), or took the parent's device and failed in its tasks
    from eugo_dask.devices import cuda
    from eugo_dask.runtime import DeviceCall, usable_device, why_no_device

    monkeypatch.setattr(cuda, "probe_cupy", lambda cupy, ordinal=0: None)  # the fake has no NVRTC
    monkeypatch.setattr("eugo_dask.runtime._devices", {})
    cuda.cupy_unusable_reason.cache_clear()
    cuda.cupy_device_count.cache_clear()

    def child():
        assert usable_device("cupy") is None
        assert DeviceCall(np.add, "cupy", "eugo-gpu-add")(np.ones(3), 1).tolist() == [2.0, 2.0, 2.0]
        return why_no_device("cupy")

    try:
        with dask.config.set({"eugo.device": "cupy"}):
            assert cuda.cupy_device_count() == 2  # the parent's probe passed
            if parent == "used its device":
                assert usable_device("cupy") is not None
            said = _in_a_forked_child(child)
    finally:
        cuda.cupy_unusable_reason.cache_clear()
        cuda.cupy_device_count.cache_clear()
    assert said == ("ok no CUDA device CuPy can use on this worker (CuPy is installed but finds "
                    "no usable CUDA device (cudaError 3))"), said


def test_the_emulated_device_keeps_its_high_water_of_live_arrays(device):
    first = device.to_device(np.ones(1000))
    second = device.to_device(np.ones(500))
    del first, second  # freed: the bytes in live arrays fall, the high water stays
    entry = device.memory_stats()["ordinals"][0]
    assert (entry["array_bytes"], entry["array_peak_bytes"]) == (0, 12_000)
    kept = device.to_device(np.ones(250))
    assert device.memory_stats()["ordinals"][0]["array_peak_bytes"] == 12_000
    device.reset_peak()  # from the bytes live now
    assert device.memory_stats()["ordinals"][0]["array_peak_bytes"] == 2_000
    del kept
