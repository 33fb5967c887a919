"""Measuring this machine: timing helpers, the CPU (and with CuPy the GPU and its link), and
the per-machine cache of the CPU measurement.

Timings are the best of several repeats after a warm-up call, which measures what the hardware
does rather than what the machine's neighbours do. :func:`measure_local_cpu` takes under a
second and runs where a profile has no ``cpu`` section (its result is cached per machine);
:func:`measure_cpu` and :func:`measure_gpu` are what ``eugo-dask calibrate`` runs
(:mod:`eugo_dask.calibrate` turns them into a profile).

Elementwise rates are in the cost model's flop-equivalents (:data:`eugo_dask.ops.UFUNC_WEIGHTS`).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from eugo_dask.devices import cupy_device_name, import_cupy
from eugo_dask.files import cache_dir, machine_id, write_json_atomic
from eugo_dask.ops import UFUNC_WEIGHTS

Progress = Callable[[str], None]


def best_seconds(fn: Callable[[], Any], *, repeat: int = 5, budget_s: float = 1.0,
                 sync: Callable[[], None] = lambda: None) -> float:
    """Best of ``repeat`` timed calls after one warm-up call (stopping early past a budget).
    ``sync`` waits for asynchronous work (a CUDA stream) before the clock stops."""
    fn()
    sync()
    best, spent = float("inf"), 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return max(best, 1e-9)


def measure_local_cpu() -> dict[str, Any]:
    """Measure this machine's CPU rates in well under a second (one thread, except BLAS).

    Elementwise ``flops_per_s`` is in the cost model's flop-equivalents: ``np.sin`` counts as
    :data:`eugo_dask.cost_model.UFUNC_WEIGHTS` ``["sin"]`` per element.
    """
    from dask.system import CPU_COUNT

    big = np.ones(1 << 23)  # 64 MB: past the caches, as Dask chunks are
    add_s = best_seconds(partial(np.add, big, 1.0, out=np.empty_like(big)), repeat=3)
    bandwidth = 2 * big.nbytes / add_s  # read + write traffic
    n = 1 << 20
    x32 = np.random.default_rng(0).random(n, dtype=np.float32)
    x64 = x32.astype(np.float64)
    flops = {}
    for dtype, x in (("float32", x32), ("float64", x64)):
        out = np.empty_like(x)
        sin_s = best_seconds(partial(np.sin, x, out=out))
        flops[dtype] = UFUNC_WEIGHTS["sin"] * n / sin_s
    matmul = {}
    for dtype in ("float32", "float64"):
        m = np.random.default_rng(1).random((384, 384)).astype(dtype)
        matmul[dtype] = 2 * 384**3 / best_seconds(partial(np.matmul, m, m))
    fft = {}
    for dtype, ctype in (("float32", np.complex64), ("float64", np.complex128)):
        z = (np.random.default_rng(2).random((256, 256)) + 0j).astype(ctype)
        fft[dtype] = 5 * z.size * np.log2(z.size) / best_seconds(partial(np.fft.fft2, z))
    overhead = best_seconds(lambda: np.add(x32[:8], 1), repeat=50)
    return {
        "name": platform.processor() or platform.machine() or "local-cpu",
        "source": f"measured {time.strftime('%Y-%m-%d')} on {platform.node()} (quick)",
        "threads": int(CPU_COUNT),
        "memory_bandwidth_bytes_per_s": bandwidth,
        "flops_per_s": flops,
        "matmul_flops_per_s": matmul,
        "fft_flops_per_s": fft,
        "task_overhead_s": max(overhead, 1e-6),
    }


def cpu_cache_path() -> Path:
    """Where this machine's measured CPU section is cached."""
    return cache_dir() / f"cpu-{machine_id()}.json"


def cached_local_cpu(*, accept: Callable[[dict[str, Any]], bool] = lambda data: True,
                     ) -> dict[str, Any]:
    """The local CPU's profile section: read from the per-machine cache where ``accept``
    takes it, else measured and cached."""
    path = cpu_cache_path()
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and accept(data):
            return data
    except (OSError, ValueError):
        pass
    data = measure_local_cpu()
    try:
        write_json_atomic(path, data, indent=2)
    except OSError:  # read-only home: measure again next process
        pass
    return data


#: Sizes (elements or matrix order) the calibration measures; prediction accuracy is checked on
#: sizes not in these lists.
QUICK_SIZES = {"matmul": (64, 256, 512),
               "elementwise": (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 23),
               "fft": (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20),
               "reduction": (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)}
FULL_SIZES = {"matmul": (32, 64, 128, 256, 512, 1024, 2048),
              "elementwise": (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22,
                              1 << 23, 1 << 24),
              "fft": (1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20),
              "reduction": (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)}
#: Ufunc classes measured for the elementwise rate (one representative each).
UFUNC_CLASSES = {"memory": "add", "divide": "divide", "sqrt": "sqrt", "transcendental": "exp",
                 "trig": "sin", "power": "power"}


def _fit_inverse(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``rate(n) = peak * n / (n + half)`` to (n, rate) points: 1/rate = 1/peak + half/(peak n).

    Returns (peak, half), clamped to sane values."""
    xs = [1.0 / n for n, _ in points]
    ys = [1.0 / r for _, r in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    intercept = my - slope * mx
    if intercept <= 0:  # no saturation seen: take the best rate, no ramp
        return max(r for _, r in points), 1.0
    peak = 1.0 / intercept
    return peak, max(slope * peak, 1.0)


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def measure_cpu(*, quick: bool, threads: int | None = None, progress: Progress = print) -> dict[str, Any]:
    """The ``cpu`` section of a profile, measured here."""
    from dask.system import CPU_COUNT

    sizes = QUICK_SIZES if quick else FULL_SIZES
    repeat = 9 if quick else 15  # best of many: robust to a shared, noisy machine
    rng = np.random.default_rng(0)
    samples: dict[str, list] = {}

    progress("cpu: matmul")
    matmul: dict[str, float] = {}
    half = []
    for dtype in ("float32", "float64"):
        points: list[tuple[float, float]] = []
        for n in sizes["matmul"]:
            a = rng.random((n, n)).astype(dtype)
            points.append((n, 2.0 * n**3 / best_seconds(partial(np.matmul, a, a), repeat=repeat)))
        matmul[dtype], h = _fit_inverse(points)
        half.append(h)
        samples[f"matmul {dtype}"] = points

    progress("cpu: elementwise (memory-bound, divide, sqrt, exp, sin, power)")
    flops: dict[str, float] = {}
    per_element: dict[str, dict[str, list[list[float]]]] = {}
    bandwidths = []
    for dtype in ("float32", "float64"):
        rates = []
        per_element[dtype] = {}
        for name in UFUNC_CLASSES.values():
            ufunc = getattr(np, name)
            per_n: list[list[float]] = []
            for n in sizes["elementwise"]:
                x = rng.random(n).astype(dtype) + 0.5
                # two operands for every class, so classes compare at the same memory traffic
                args = (x, x) if ufunc.nin == 2 else (x, x)[: ufunc.nin]
                seconds = best_seconds(partial(ufunc, *args), repeat=repeat)
                per_n.append([n, seconds / n * (3 / (ufunc.nin + 1))])
                if n >= 1 << 20:  # past the caches, as most chunks are
                    if name == "add":
                        bandwidths.append(3 * x.nbytes / seconds)
                    else:
                        rates.append(UFUNC_WEIGHTS[name] * n / seconds)
            per_element[dtype][name] = per_n
        flops[dtype] = statistics.median(rates)

    progress("cpu: fft")
    fft: dict[str, float] = {}
    fft_table: dict[str, dict[str, list[list[float]]]] = {}
    for dtype, ctype in (("float32", np.complex64), ("float64", np.complex128)):
        per_flop: list[list[float]] = []
        for n in sizes["fft"]:
            z = (rng.random(n) + 1j * rng.random(n)).astype(ctype)
            flop = 5 * n * math.log2(n)
            per_flop.append([n, best_seconds(partial(np.fft.fft, z), repeat=repeat) / flop])
        fft[dtype] = 1.0 / statistics.median(p[1] for p in per_flop)
        fft_table[dtype] = {"fft": per_flop}

    progress("cpu: reductions")
    reduction_bw = []
    reduction_table: dict[str, dict[str, list[list[float]]]] = {}
    for dtype in ("float32", "float64"):
        per_element_sum: list[list[float]] = []
        for n in sizes["reduction"]:
            x = rng.random(n).astype(dtype)
            seconds = best_seconds(x.sum, repeat=repeat)
            per_element_sum.append([n, seconds / n])
            if n >= 1 << 20 and dtype == "float64":
                reduction_bw.append(x.nbytes / seconds)
        reduction_table[dtype] = {"sum": per_element_sum}

    progress("cpu: per-task overhead of Dask's scheduler")
    overhead = _dask_task_overhead(100 if quick else 1000)
    return {
        "name": platform.processor() or platform.machine() or "local-cpu",
        "source": f"calibrated {time.strftime('%Y-%m-%d')} on {platform.node()}"
                  + (" (quick)" if quick else ""),
        "threads": int(threads or CPU_COUNT),
        "memory_bandwidth_bytes_per_s": statistics.median(bandwidths),
        "reduction_bandwidth_bytes_per_s": statistics.median(reduction_bw or bandwidths),
        "flops_per_s": flops,
        "matmul_flops_per_s": matmul,
        "matmul_half_n": statistics.median(half),
        "fft_flops_per_s": fft,
        "elementwise_s_per_element": per_element,
        "fft_s_per_flop": fft_table,
        "reduction_s_per_element": reduction_table,
        "task_overhead_s": overhead,
    }


def _dask_task_overhead(n_tasks: int) -> float:
    """Seconds per no-op task through Dask's synchronous scheduler (dispatch, bookkeeping)."""
    import dask

    graph = {("noop", i): (int, i) for i in range(n_tasks)}
    keys = list(graph)
    seconds = best_seconds(lambda: dask.get(graph, keys), repeat=3)
    return seconds / n_tasks


# ---------------------------------------------------------------------------------------------
# GPU and link (CuPy)
# ---------------------------------------------------------------------------------------------
def measure_gpu(*, quick: bool, progress: Progress = print) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``gpu`` and ``link`` sections, measured on CUDA device 0."""
    cupy = import_cupy()
    sync = cupy.cuda.Device().synchronize
    repeat = 5 if quick else 20
    props = cupy.cuda.runtime.getDeviceProperties(0)
    progress(f"gpu: {cupy_device_name()}")

    progress("link: host->device and device->host, pageable and pinned")
    sizes = (1 << 20, 1 << 24) if quick else (1 << 20, 1 << 24, 1 << 28)
    rates: dict[str, list[float]] = {"h2d": [], "d2h": [], "pinned_h2d": [], "pinned_d2h": []}
    for nbytes in sizes:
        host = np.ones(nbytes, dtype=np.uint8)
        dev = cupy.empty(nbytes, dtype=np.uint8)
        pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(pinned_mem, np.uint8, nbytes)
        pinned[:] = 1
        copies = {"h2d": partial(dev.set, host), "d2h": partial(dev.get, out=host),
                  "pinned_h2d": partial(dev.set, pinned), "pinned_d2h": partial(dev.get, out=pinned)}
        for kind, copy in copies.items():
            rates[kind].append(nbytes / best_seconds(copy, repeat=repeat, sync=sync))
    tiny = np.ones(8, dtype=np.uint8)
    tiny_dev = cupy.asarray(tiny)
    latency = best_seconds(lambda: tiny_dev.set(tiny), repeat=repeat * 5, sync=sync)

    progress("gpu: call and kernel-launch overhead")
    small = cupy.ones(8, dtype=np.float32)
    call = best_seconds(lambda: cupy.add(small, 1), repeat=repeat * 5, sync=sync)
    kernel = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x + 1", "eugo_noop")
    launch = best_seconds(lambda: kernel(small), repeat=repeat * 5, sync=sync)

    progress("gpu: memory bandwidth, elementwise and GEMM rates")
    n = 1 << (24 if quick else 27)
    x = cupy.ones(n, dtype=np.float32)
    bandwidth = 3 * x.nbytes / best_seconds(lambda: cupy.add(x, x), repeat=repeat, sync=sync)
    flops = {}
    matmul = {}
    for dtype in ("float16", "float32", "float64"):
        y = cupy.ones(n, dtype=dtype) * 0.5
        flops[dtype] = UFUNC_WEIGHTS["sin"] * n / best_seconds(partial(cupy.sin, y), repeat=repeat, sync=sync)
        m = 4096 if quick else 8192
        a = cupy.ones((m, m), dtype=dtype)
        matmul[dtype] = 2 * m**3 / best_seconds(partial(cupy.matmul, a, a), repeat=max(2, repeat // 4), sync=sync)
        del a, y

    progress("gpu: cuFFT plan creation")
    def plan_cost(shape: tuple[int, ...]) -> float:
        z = cupy.ones(shape, dtype=np.complex64)
        cupy.fft.config.get_plan_cache().clear()
        start = time.perf_counter()
        cupy.fft.fft2(z)
        sync()
        first = time.perf_counter() - start
        again = best_seconds(lambda: cupy.fft.fft2(z), repeat=repeat, sync=sync)
        return max(first - again, 0.0)

    fft_plan = statistics.median(plan_cost((s, s)) for s in (512, 1024, 2048))
    name = cupy_device_name() or "CUDA device 0"
    gpu = {
        "name": name,
        "count": int(cupy.cuda.runtime.getDeviceCount()),
        "memory_bytes": float(props["totalGlobalMem"]),
        "memory_bandwidth_bytes_per_s": bandwidth,
        "flops_per_s": flops,
        "matmul_flops_per_s": matmul,
        "call_overhead_s": max(call - launch, 0.0),
        "kernel_launch_s": launch,
        "fft_plan_s": fft_plan,
    }
    link = {
        "name": f"host link of {name}",
        "h2d_bytes_per_s": max(rates["h2d"]),
        "d2h_bytes_per_s": max(rates["d2h"]),
        "pinned_h2d_bytes_per_s": max(rates["pinned_h2d"]),
        "pinned_d2h_bytes_per_s": max(rates["pinned_d2h"]),
        "latency_s": latency,
    }
    return gpu, link
