"""The real CuPy device. Skipped where CuPy or a usable CUDA device is missing (never required).

What the emulated device cannot show is tested here: the staged copies through pinned buffers,
chunks page-locked in place and results in pinned blocks,
a task scope that synchronises (launch time against device time), a slow kernel ahead of a copy
back outside a task (ordered), a thread asleep while a scope waits (its CPU time), CuPy's pool
limit and FFT plan caches, a sticky CUDA error (in a subprocess: it ruins the process's
context), several GPUs, and calibration on the runtime's own paths. ``scripts/gpu-check.sh`` runs this file.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import eugo_dask
from eugo_dask.devices import (
    OUT_OF_MEMORY,
    STICKY,
    CupyDevice,
    DeviceSettings,
    cupy_device_count,
    cupy_unusable_reason,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def cupy():
    if not cupy_device_count():
        pytest.skip(f"needs CuPy and a usable CUDA device: {cupy_unusable_reason()}")
    import cupy

    return cupy


@pytest.fixture
def cupy_device(cupy):
    with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": "cupy",
                          "eugo.min-speedup": 0}):
        eugo_dask.reset_device_stats()
        yield


@pytest.fixture
def device(cupy):
    eugo_dask.reset_device_stats()
    dev = CupyDevice(cupy, DeviceSettings(staging_bytes=1 << 20))  # 1 MiB: many chunks
    yield dev
    dev.release_memory()


def test_auto_resolves_to_cupy(cupy_device):
    with dask.config.set({"eugo.device": "auto"}):
        assert eugo_dask.read_settings().resolved().device == "cupy"
    assert cupy_unusable_reason() is None  # the probe ran a kernel, a GEMM and an FFT


@pytest.mark.parametrize("shape, order", [((3,), "C"), ((1000, 300), "C"), ((1000, 300), "F"),
                                          ((2_500_000,), "C"), ((700, 900, 3), "F")])
@pytest.mark.parametrize("in_task", [False, True])
def test_staged_copies_round_trip(device, cupy, shape, order, in_task):
    host = np.asarray(np.random.default_rng(0).random(shape), order=order)
    with device.task(0) if in_task else contextlib.nullcontext():
        dev = device.to_device(host)
        doubled = dev * 2  # CuPy's elementwise kernels write C order, whatever the input's order
        back, same = device.to_host(doubled), device.to_host(dev)
    assert isinstance(dev, cupy.ndarray) and dev.flags.c_contiguous == (order == "C" or host.ndim == 1)
    np.testing.assert_array_equal(back, host * 2)
    np.testing.assert_array_equal(same, host)
    # both copies keep the layout of the array they copy
    assert back.flags.f_contiguous == doubled.flags.f_contiguous
    assert back.flags.c_contiguous == doubled.flags.c_contiguous
    assert same.flags.f_contiguous == host.flags.f_contiguous
    assert same.flags.c_contiguous == host.flags.c_contiguous


def test_non_contiguous_and_odd_sizes(device):
    host = np.arange(3 * (1 << 20) + 7, dtype=np.uint8)  # a remainder after whole chunks
    np.testing.assert_array_equal(device.to_host(device.to_device(host)), host)
    view = np.arange(4_000_000.0).reshape(2000, 2000)[::2, 1::3]
    np.testing.assert_array_equal(device.to_host(device.to_device(view)), view)
    stats = eugo_dask.device_stats()
    assert stats["h2d_count"] == stats["d2h_count"] == 2


def test_copies_while_other_threads_copy(device):
    errors = []

    def copy(seed):
        try:
            host = np.random.default_rng(seed).random(3_000_000)
            for _ in range(3):
                with device.task(0):
                    back = device.to_host(device.to_device(host) + 1)
                np.testing.assert_array_equal(back, host + 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert device.memory_stats()["pinned_bytes"] <= 4 * 2 * (1 << 20)  # two buffers per thread at most


@pytest.mark.parametrize("in_task", [False, True])
def test_registered_and_pinned_copies_on_cuda(cupy, in_task):
    """On CUDA: a 16 MiB chunk page-locked in place, one DMA, unregistered after (registering
    it again works); a chunk whose pages another registration holds is staged (CUDA refuses
    it: cudaErrorHostMemoryAlreadyRegistered); the result copied back into a pinned block."""
    eugo_dask.reset_device_stats()
    dev = CupyDevice(cupy, DeviceSettings(register_min_bytes=8 << 20, pinned_results_min_bytes=8 << 20))
    host = np.random.default_rng(0).random(2 << 20)  # 16 MiB
    scope = dev.task(0) if in_task else contextlib.nullcontext()
    with scope:
        on_device = dev.to_device(host)
        back = dev.to_host(on_device * 2)
    np.testing.assert_array_equal(back, host * 2)
    assert dev._results.owns(back)
    runtime = cupy.cuda.runtime
    runtime.hostRegister(host.ctypes.data, host.nbytes, 0)  # unregistered by the copy: free again
    try:
        np.testing.assert_array_equal(cupy.asnumpy(dev.to_device(host)), host)  # staged
    finally:
        runtime.hostUnregister(host.ctypes.data)
    stats = eugo_dask.device_stats()
    assert (stats["h2d_registered"], stats["h2d_register_refused"], stats["d2h_pinned"]) == (1, 1, 1)
    dev.release_memory()


def test_task_scope_waits_for_the_device(device, cupy):
    a = cupy.random.random((4096, 4096), dtype=np.float32)
    # first use in this thread (cuBLAS handle, the division's kernel) is paid before the scope:
    # it blocks the launch, and the check is about work the body only launched
    (a @ a / 4096).sum().item()
    with device.task(0) as clock:
        clock.mark("eugo-h2d")
        for _ in range(20):
            a = a @ a / 4096
        clock.mark("eugo-device-compute")
        launched = time.perf_counter()
    synced = time.perf_counter()
    # the scope's end waited for the work the body only launched
    assert clock.seconds["eugo-device-compute"] > 5 * clock.seconds["eugo-h2d"]
    assert clock.wall_s > clock.launch_s and synced - launched >= 0.5 * clock.seconds["eugo-device-compute"]
    assert eugo_dask.device_stats()["device_seconds"] >= clock.device_s > 0


_SLOW_DOUBLE = r"""
extern "C" __global__ void eugo_slow_double(const double* x, double* y, long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        y[i] = 2 * x[i];
}
"""


@pytest.fixture
def slow_double(cupy):
    """``slow_double(x, seconds)``: 2 * x from a kernel that first spins on the device for about
    ``seconds``, launched on the current stream and not waited for."""
    kernel = cupy.RawKernel(_SLOW_DOUBLE, "eugo_slow_double")
    rate = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000  # kHz -> cycles per s

    def run(x, seconds):
        y = cupy.empty_like(x)
        kernel((64,), (256,), (x, y, np.int64(x.size), np.int64(seconds * rate)))
        return y

    return run


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_a_slow_kernel_ahead_of_an_out_of_scope_copy_back(device, cupy, slow_double, path):
    # issue 31: the strided view was made contiguous on the legacy default stream, behind the
    # kernel, and copied on eugo's stream without waiting for it
    if path == "direct":
        device.direct_copy_bytes = 1 << 30
    host = np.random.default_rng(1).random((1000, 400))
    x = cupy.asarray(host)
    cupy.cuda.get_current_stream().synchronize()
    doubled = slow_double(x, 0.3)  # on the legacy default stream: still running below
    np.testing.assert_array_equal(device.to_host(doubled[::2]), host[::2] * 2)


def test_a_waiting_scope_leaves_its_thread_asleep(device, cupy, slow_double):
    # issue 31: waits spun a CPU core; blocking-sync events let the thread sleep
    x = cupy.ones(1 << 20)
    cupy.cuda.get_current_stream().synchronize()
    waits = {}
    for where in ("scope", "copy back"):
        wall, cpu = time.perf_counter(), time.thread_time()
        if where == "scope":
            with device.task(0):
                slow_double(x, 0.5)
                kernel_done = cupy.cuda.get_current_stream().record()
        else:
            y = slow_double(x, 0.5)  # the copy's stream waits for the legacy stream's kernel
            kernel_done = cupy.cuda.Stream.null.record()
            device.to_host(y)
        assert kernel_done.done  # it waited for the kernel
        waits[where] = (time.thread_time() - cpu, time.perf_counter() - wall)
    for where, (cpu_s, wall_s) in waits.items():
        assert cpu_s < 0.25 * wall_s, f"{where}: {cpu_s:.3f} s of CPU in {wall_s:.3f} s"


def test_pool_limit_and_release(cupy):
    total = cupy.cuda.Device(0).mem_info[1]
    dev = CupyDevice(cupy, DeviceSettings(memory_fraction=0.01))
    with dev.task(0):
        a = cupy.empty(int(total * 0.004), dtype=np.uint8)
    stats = dev.memory_stats()["ordinals"][0]
    assert stats["pool_limit_bytes"] == pytest.approx(total * 0.01, rel=0.01)
    with pytest.raises(Exception) as info:
        with dev.task(0):
            cupy.empty(int(total * 0.02), dtype=np.uint8)
    assert dev.classify_error(info.value) == OUT_OF_MEMORY
    stats = dev.memory_stats()["ordinals"][0]
    assert stats["pool_held_bytes"] == stats["pool_used_bytes"]  # free blocks released on OOM
    del a
    dev.release_memory()
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 0
    cupy.get_default_memory_pool().set_limit(size=0)


def test_fft_plan_cache_is_bounded(cupy):
    dev = CupyDevice(cupy, DeviceSettings(fft_plan_cache_size=2, fft_plan_cache_bytes=64 << 20))
    with dev.task(0):
        for n in (1000, 1200, 1400, 1600, 1800):
            cupy.fft.fft(cupy.ones(n, dtype=np.complex64))
    (entry,) = [o for o in dev.memory_stats()["ordinals"] if o["ordinal"] == 0]
    assert 1 <= entry["fft_plans"] <= 2
    dev.release_memory()
    assert dev.memory_stats()["ordinals"][0]["fft_plans"] == 0


def test_idle_release(cupy):
    dev = CupyDevice(cupy, DeviceSettings(idle_release_s=0.2))
    with dev.task(0):
        x = cupy.ones(50_000_000, dtype=np.float32)
    del x
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] >= 200_000_000
    deadline = time.monotonic() + 10
    while dev.memory_stats()["ordinals"][0]["pool_held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dev.memory_stats()["ordinals"][0]["pool_held_bytes"] == 0


_STICKY = """
import cupy, numpy as np
from eugo_dask.devices import CupyDevice, DeviceDisabled
dev = CupyDevice(cupy)
bad = cupy.RawKernel(r'extern "C" __global__ void eugo_bad(float* p) { ((float*)16)[0] = p[0]; }',
                     "eugo_bad")
try:
    with dev.task(0):
        bad((1,), (1,), (cupy.zeros(1, dtype=cupy.float32),))  # launched: no error yet
except Exception as e:
    print("kind", dev.classify_error(e), flush=True)
try:
    with dev.task(0):
        pass
except DeviceDisabled as e:
    print("disabled", e, flush=True)
"""


def test_sticky_error_surfaces_in_the_task_and_turns_the_device_off(cupy):
    out = subprocess.run([sys.executable, "-c", _STICKY], capture_output=True, text=True, timeout=120)
    assert f"kind {STICKY}" in out.stdout, out.stdout + out.stderr
    assert "disabled the cupy device is off in this process: sticky error" in out.stdout


def test_several_gpus(cupy):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    dev = CupyDevice(cupy)
    x = dev.to_device(np.ones(1000), ordinal=1)
    assert dev.ordinal_of(x) == 1 and dev.select((x,)) == 1
    moved = dev.move(x, 0)
    assert dev.ordinal_of(moved) == 0
    np.testing.assert_array_equal(dev.to_host(moved), np.ones(1000))


def _cases():
    from .pipelines import CASES

    return sorted(CASES)


#: Cases known to run on the device without a fallback (the rest must match; a fallback there
#: is reported, not failed: a function CuPy lacks runs its CPU path by design).
NO_FALLBACK = {"chain", "matmul-chain", "fft2", "std", "cumsum", "rechunk", "fancy-index",
               "concatenate", "where", "einsum"}


@pytest.mark.parametrize("name", _cases())
def test_same_result_on_cupy(name, cupy_device):
    from .pipelines import CASES

    with dask.config.set(optimizations=[]):
        expected = CASES[name]().compute(scheduler="sync")
    result = CASES[name]().compute(scheduler="threads")
    assert type(result) is type(expected)
    assert_eq(result, expected)  # allclose: cuBLAS/cuFFT round differently from NumPy
    stats = eugo_dask.device_stats()
    if name in NO_FALLBACK:
        assert stats["tasks"] > 0 and stats["fallbacks"] == 0, stats
    elif stats["fallbacks"]:
        print(f"{name}: {stats['fallback_reasons']}")


def test_matmul_add_sum_counters_on_cupy(cupy_device):
    from .pipelines import MATMUL_A, MATMUL_B, matmul_add_sum

    assert_eq(matmul_add_sum().compute(scheduler="sync"), ((MATMUL_A @ MATMUL_B) + 1).sum())
    stats = eugo_dask.device_stats()
    assert stats["h2d_count"] == 10 and stats["d2h_count"] == 6


def test_out_of_memory_falls_back(cupy_device):
    import cupy

    pool = cupy.get_default_memory_pool()
    x = np.exp(da.ones((2000, 2000), chunks=1000)) * 2
    (planned,) = dask.optimize(x)
    pool.set_limit(size=1024)
    try:
        result = planned.compute(scheduler="sync")
    finally:
        pool.set_limit(size=0)
    np.testing.assert_allclose(result, np.exp(np.ones((2000, 2000))) * 2)
    assert eugo_dask.device_stats()["fallbacks"] > 0


def test_calibration_measures_the_runtime_paths(cupy):
    from eugo_dask import load_profile
    from eugo_dask.calibrate import calibrate
    from eugo_dask.profile import validate_profile_dict

    messages = []
    profile = calibrate(quick=True, progress=messages.append)
    validate_profile_dict(profile)
    gpu, link = profile["gpu"], profile["link"]
    assert gpu["measured"] is True and gpu["count"] >= 1
    assert gpu["memory_bytes"] == cupy.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"]
    assert gpu["call_overhead_s"] > 1e-7 and gpu["first_use_s"] > gpu["call_overhead_s"]
    assert link["h2d_bytes_per_s"] <= 1.2 * link["pinned_h2d_bytes_per_s"]
    # the link's name says which copy path its rates were measured on (staged, pinned results)
    assert "eugo's copies: " in link["name"] and "pinned staging buffers" in link["name"]
    assert any(m.startswith("link:") for m in messages)
    assert load_profile(profile).gpu.measured
