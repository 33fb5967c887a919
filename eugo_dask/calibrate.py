"""Calibration: measure this machine and write a profile ``eugo.profile`` accepts.

The CPU is always measured: matmul by dtype over a range of sizes (peak rate and the size at
which half of it is reached), elementwise ufuncs by class (memory-bound add, divide/sqrt,
transcendental exp/sin, power), FFTs, reductions, and the per-task overhead of Dask's scheduler,
each over several chunk sizes. With CuPy and a CUDA device the GPU and its link are measured too:
host->device and device->host copies from pageable and pinned memory, transfer latency, CuPy call
and kernel-launch overhead, cuFFT plan creation, GEMM and elementwise rates. Without one, the GPU
and link sections come from a preset and say so (``source``).

``--quick`` takes a few seconds on a 2-core machine; the full run about a minute or two. Progress
goes to a callback (the CLI prints it). Timings are the best of several repeats after a warm-up
call, which measures what the hardware does rather than what the machine's neighbours do.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from eugo_dask.cost_model import UFUNC_WEIGHTS
from eugo_dask.profile import best_seconds, profile_dict, validate_profile_dict

Progress = Callable[[str], None]

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


def _fit_inverse(points: list[tuple[float, float]]) -> tuple[float, float]:
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
        points = []
        for n in sizes["matmul"]:
            a = rng.random((n, n)).astype(dtype)
            points.append((n, 2.0 * n**3 / best_seconds(lambda a=a: a @ a, repeat=repeat)))
        matmul[dtype], h = _fit_inverse(points)
        half.append(h)
        samples[f"matmul {dtype}"] = points

    progress("cpu: elementwise (memory-bound, divide, sqrt, exp, sin, power)")
    flops: dict[str, float] = {}
    per_element: dict[str, dict[str, float]] = {}
    bandwidths = []
    for dtype in ("float32", "float64"):
        rates = []
        per_element[dtype] = {}
        for name in UFUNC_CLASSES.values():
            ufunc = getattr(np, name)
            per_n = []
            for n in sizes["elementwise"]:
                x = rng.random(n).astype(dtype) + 0.5
                # two operands for every class, so classes compare at the same memory traffic
                args = (x, x) if ufunc.nin == 2 else (x, x)[: ufunc.nin]
                seconds = best_seconds(lambda ufunc=ufunc, args=args: ufunc(*args), repeat=repeat)
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
    fft_table: dict[str, dict[str, list]] = {}
    for dtype, ctype in (("float32", np.complex64), ("float64", np.complex128)):
        points = []
        for n in sizes["fft"]:
            z = (rng.random(n) + 1j * rng.random(n)).astype(ctype)
            flop = 5 * n * math.log2(n)
            points.append([n, best_seconds(lambda z=z: np.fft.fft(z), repeat=repeat) / flop])
        fft[dtype] = 1.0 / statistics.median(p[1] for p in points)
        fft_table[dtype] = {"fft": points}

    progress("cpu: reductions")
    reduction_bw = []
    reduction_table: dict[str, dict[str, list]] = {}
    for dtype in ("float32", "float64"):
        points = []
        for n in sizes["reduction"]:
            x = rng.random(n).astype(dtype)
            seconds = best_seconds(lambda x=x: x.sum(), repeat=repeat)
            points.append([n, seconds / n])
            if n >= 1 << 20 and dtype == "float64":
                reduction_bw.append(x.nbytes / seconds)
        reduction_table[dtype] = {"sum": points}

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
def measure_gpu(*, quick: bool, progress: Progress = print) -> tuple[dict, dict]:
    """The ``gpu`` and ``link`` sections, measured on CUDA device 0."""
    from eugo_dask.devices import cupy_device_name, import_cupy

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
        copies = {"h2d": lambda: dev.set(host), "d2h": lambda: dev.get(out=host),
                  "pinned_h2d": lambda: dev.set(pinned), "pinned_d2h": lambda: dev.get(out=pinned)}
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
        flops[dtype] = UFUNC_WEIGHTS["sin"] * n / best_seconds(lambda y=y: cupy.sin(y), repeat=repeat, sync=sync)
        m = 4096 if quick else 8192
        a = cupy.ones((m, m), dtype=dtype)
        matmul[dtype] = 2 * m**3 / best_seconds(lambda a=a: a @ a, repeat=max(2, repeat // 4), sync=sync)
        del a, y

    progress("gpu: cuFFT plan creation")
    import cupy.fft  # noqa: F401

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


# ---------------------------------------------------------------------------------------------
# Profile
# ---------------------------------------------------------------------------------------------
def calibrate(*, quick: bool = False, gpu_preset: str = "h200", threads: int | None = None,
              progress: Progress = print) -> dict[str, Any]:
    """Measure this machine; return a validated profile dict (write it with YAML or JSON).

    Parameters
    ----------
    quick
        Fewer sizes and repeats (seconds instead of a minute or two).
    gpu_preset
        Where the GPU and link sections come from when no CUDA device is usable here.
    threads
        Worker threads running chunks side by side (default: this machine's cores).
    """
    from eugo_dask.devices import cupy_device_count

    started = time.perf_counter()
    cpu = measure_cpu(quick=quick, threads=threads, progress=progress)
    if cupy_device_count():
        gpu, link = measure_gpu(quick=quick, progress=progress)
        name, source = "calibrated", cpu["source"]
    else:
        preset = profile_dict(gpu_preset)
        gpu, link = preset["gpu"], preset["link"]
        name = f"{gpu_preset}-calibrated-cpu"
        source = (f"{cpu['source']}; no CUDA device here: gpu and link are the {gpu_preset} "
                  "preset's spec-sheet figures, not measured")
    profile = {"name": name, "source": source, "gpu": gpu, "link": link, "cpu": cpu}
    validate_profile_dict(profile)
    progress(f"done in {time.perf_counter() - started:.1f} s")
    return profile
