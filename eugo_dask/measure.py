"""Measuring this machine: timing helpers, the CPU (and with CuPy the GPU and its link), and
the per-machine cache of the CPU measurement.

One CPU measurer, :func:`measure_cpu`, serves at three levels (:data:`LEVELS`):

- ``probe`` (well under 2 s): what a profile without a ``cpu`` section uses, measured once per
  machine and cached (:func:`cached_local_cpu`; :func:`measure_local_cpu` is this level);
- ``quick`` (``eugo-dask calibrate --quick``, about 5-10 s) and ``full`` (a minute or two):
  tables over the chunk sizes that matter (matmul up to 2048² and 4096², elementwise, FFT and
  reductions up to 2^23-2^24 elements) that the cost model interpolates.

Measurements are robust against a busy machine: every rate is the best of a few timed calls
after a warm-up, measured in several rounds; a spread between rounds past
:data:`UNSTABLE_SPREAD` triggers another round after a pause, the figure is the best round
(another process only ever slows a round down), and a spread that stays says so (``progress``
and the section's ``warnings``), as does a load average above the core count.

:func:`measure_gpu` measures a CUDA device and its link on exactly the paths the runtime uses
(:class:`eugo_dask.devices.CupyDevice`'s copies, every path it can take at each size, and a
task's stream), corrects what the first
version got wrong (traffic of ``add``, a call overhead that was a difference of equal calls), and
records first-use costs. Elementwise rates are in the cost model's flop-equivalents
(:data:`eugo_dask.ops.UFUNC_WEIGHTS`). :mod:`eugo_dask.calibrate` turns these into a profile.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from eugo_dask.devices import (
    CopyChoice,
    CopyRule,
    CupyDevice,
    DeviceSettings,
    copy_candidates,
    cupy_device_name,
    device_stats,
    import_cupy,
)
from eugo_dask.files import cache_dir, machine_id, read_json, write_json_atomic
from eugo_dask.ops import UFUNC_WEIGHTS

Progress = Callable[[str], None]

#: Levels of :func:`measure_cpu`.
LEVELS = ("probe", "quick", "full")
#: Rounds whose best rates differ by more than this factor are measured again, then reported.
UNSTABLE_SPREAD = 1.3


def best_seconds(fn: Callable[[], Any], *, repeat: int = 5, budget_s: float = 1.0,
                 sync: Callable[[], None] = lambda: None, warm_up: bool = True) -> float:
    """Best of ``repeat`` timed calls after one warm-up call (stopping early past a budget).
    ``sync`` waits for asynchronous work (a CUDA stream) before the clock stops."""
    if warm_up:
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


class Stability:
    """Collects rounds of rates and says which measurements were unstable."""

    def __init__(self, progress: Progress, *, rounds: int, pause_s: float = 0.2,
                 retry_budget_s: float = 5.0) -> None:
        self.progress = progress
        self.rounds = rounds
        self.pause_s = pause_s
        self.retry_budget_s = retry_budget_s  # time all extra rounds together may take
        self.warnings: list[str] = []

    def rate(self, name: str, once: Callable[[], float]) -> float:
        """The best of ``rounds`` calls of ``once`` (each a rate: another process can only slow
        a round down, so the fastest round is the hardware's); one or two more rounds after a
        pause (within ``retry_budget_s``) where they spread past :data:`UNSTABLE_SPREAD`
        (:func:`_spread`), and a warning where they still do."""
        rates = [once() for _ in range(self.rounds)]
        extra = 0
        while _spread(rates) > UNSTABLE_SPREAD and extra < 2 and self.retry_budget_s > 0:
            start = time.perf_counter()
            time.sleep(self.pause_s)
            rates.append(once())
            self.retry_budget_s -= time.perf_counter() - start
            extra += 1
        if _spread(rates) > UNSTABLE_SPREAD:
            self.warn(f"{name} unstable: {len(rates)} rounds ranged {min(rates):.3g} to "
                      f"{max(rates):.3g}/s ({max(rates) / min(rates):.1f}x), took the best")
        return max(rates)

    def warn(self, message: str) -> None:
        """Keep ``message`` among the measurement's warnings and say it."""
        self.warnings.append(message)
        self.progress(f"warning: {message}")

    def summary(self) -> str | None:
        """One line on what was unstable, or None."""
        unstable = [w for w in self.warnings if " unstable: " in w]
        if not unstable:
            return None
        return (f"{len(unstable)} measurement(s) stayed unstable over repeated rounds (another "
                "process may be busy): the figures are the best rounds; calibrate again on an idle machine")


def _spread(rates: Sequence[float]) -> float:
    """How far rounds disagree: max/min, leaving out the one slowest round where there are
    three or more (a round another process interrupted, which extra rounds outvote)."""
    kept = sorted(rates)[1:] if len(rates) >= 3 else list(rates)
    return max(kept) / min(kept) if kept else 1.0


#: A share of a core below this, while measuring, means other processes took turns on it.
CONTENDED_SHARE = 0.7


def cpu_share(seconds: float = 0.05) -> float:
    """The share of a core this thread got over a short busy loop: its CPU time over the wall
    time, about 1 on a core of its own and lower where other processes take turns on it (what
    the load average, a minute's mean, misses when the competition is new)."""
    start, cpu_start = time.perf_counter(), time.thread_time()
    while (wall := time.perf_counter() - start) < seconds:
        sum(range(1000))
    return min((time.thread_time() - cpu_start) / wall, 1.0)


def _runqueue_wait_s() -> float | None:
    """Seconds this thread has waited for a CPU while runnable (Linux's schedstat), or None
    where the system does not say. Waiting for a lock (another thread's GIL) or sleeping does
    not count: only other work the scheduler ran in its place."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class CoreShare:
    """The share of a core the measuring thread had from its start to :meth:`share`: one minus
    the time it waited, runnable, for a CPU other work held (schedstat), over the wall time; so
    contention at any moment of a measurement counts, and a busy thread of this process (which
    holds the GIL, not the core) does not. Where the system does not say, the lower of two
    :func:`cpu_share` samples, at the start and at the end."""

    def __init__(self) -> None:
        self._start, self._waited = time.perf_counter(), _runqueue_wait_s()
        self._sampled = cpu_share() if self._waited is None else None

    def share(self) -> float:
        if self._sampled is not None:
            return min(self._sampled, cpu_share())
        waited = _runqueue_wait_s()
        wall = time.perf_counter() - self._start
        if waited is None or self._waited is None or wall <= 0:
            return 1.0
        return max(0.0, 1.0 - (waited - self._waited) / wall)


def contention_warning(share: float) -> str | None:
    """A warning where this process had less than :data:`CONTENDED_SHARE` of a core."""
    if share >= CONTENDED_SHARE:
        return None
    return (f"this process had {share:.0%} of a core while measuring: other processes compete "
            "for the CPU and the rates may be low")


def machine_load_warning() -> str | None:
    """A warning where the 1-minute load average is above the number of cores (another
    process competes for them), else None."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load > cores:
        return (f"load average {load:.1f} on {cores} cores when measuring: other processes compete "
                "for the CPU and the rates may be low")
    return None


#: Sizes (elements or matrix order) each level measures; prediction accuracy is checked on
#: sizes not in these lists (benchmarks/prediction_accuracy.py).
SIZES = {
    "probe": {"matmul": (256, 1024), "elementwise": (1 << 22,), "fft": (1 << 16,),
              "reduction": (1 << 22,)},
    "quick": {"matmul": (128, 512, 1024, 2048),
              "elementwise": (1 << 15, 1 << 19, 1 << 23),
              "fft": (1 << 10, 1 << 14, 1 << 18, 1 << 20),
              "reduction": (1 << 16, 1 << 20, 1 << 24)},
    "full": {"matmul": (64, 128, 256, 512, 1024, 2048, 4096),
             "elementwise": (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 23,
                             1 << 24),
             "fft": (1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20),
             "reduction": (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)},
}
QUICK_SIZES, FULL_SIZES = SIZES["quick"], SIZES["full"]
#: Ufunc classes measured for the elementwise rate (one representative each); the probe
#: measures the memory-bound and transcendental ones.
UFUNC_CLASSES = {"memory": "add", "divide": "divide", "sqrt": "sqrt", "transcendental": "exp",
                 "trig": "sin", "power": "power"}
_PROBE_CLASSES = ("add", "sin")
# (rounds, timed calls per round, seconds extra rounds may take) per level
_REPEATS = {"probe": (1, 2, 0.0), "quick": (2, 3, 4.0), "full": (3, 5, 30.0)}


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
def measure_cpu(*, level: str = "quick", quick: bool | None = None, threads: int | None = None,
                progress: Progress = print) -> dict[str, Any]:
    """The ``cpu`` section of a profile, measured here at ``level`` (:data:`LEVELS`).

    ``quick`` (True/False) is the older spelling of ``level="quick"``/``"full"``."""
    from dask.system import CPU_COUNT

    if quick is not None:
        level = "quick" if quick else "full"
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}; got {level!r}")
    sizes = SIZES[level]
    rounds, repeat, retry_s = _REPEATS[level]
    stable = Stability(progress, rounds=rounds, retry_budget_s=retry_s)
    load = machine_load_warning()
    if load is not None:
        stable.warn(load)
    core = CoreShare()
    rng = np.random.default_rng(0)  # (one generator, drawn from in the order below)

    def rate(name: str, work: float, fn: Callable[[], Any]) -> float:
        fn()  # one warm-up for all rounds
        return stable.rate(name, lambda: work / best_seconds(fn, repeat=repeat, budget_s=0.4,
                                                            warm_up=False))

    progress("cpu: matmul")
    matmul, half_n, matmul_table = _measure_matmul(rate, rng, sizes["matmul"])
    progress("cpu: elementwise (memory-bound, divide, sqrt, exp, sin, power)")
    classes = _PROBE_CLASSES if level == "probe" else tuple(UFUNC_CLASSES.values())
    flops, per_element, bandwidths = _measure_elementwise(rate, rng, sizes["elementwise"],
                                                          classes)
    progress("cpu: fft")
    fft, fft_table = _measure_fft(rate, rng, sizes["fft"])
    progress("cpu: reductions")
    reduction_table, reduction_bw = _measure_reductions(rate, rng, sizes["reduction"])
    progress("cpu: per-task overhead of Dask's scheduler")
    overhead = _dask_task_overhead({"probe": 50, "quick": 100, "full": 1000}[level])
    label = {"probe": "measured", "quick": "calibrated", "full": "calibrated"}[level]
    section: dict[str, Any] = {
        "name": platform.processor() or platform.machine() or "local-cpu",
        "source": f"{label} {time.strftime('%Y-%m-%d')} on {platform.node()}"
                  + ("" if level == "full" else f" ({level})"),
        "threads": int(threads or CPU_COUNT),
        "memory_bandwidth_bytes_per_s": statistics.median(bandwidths),
        "reduction_bandwidth_bytes_per_s": statistics.median(reduction_bw or bandwidths),
        "flops_per_s": flops,
        "matmul_flops_per_s": matmul,
        "matmul_half_n": half_n,
        "matmul_s_per_flop": matmul_table,
        "fft_flops_per_s": fft,
        "elementwise_s_per_element": per_element,
        "fft_s_per_flop": fft_table,
        "reduction_s_per_element": reduction_table,
        "task_overhead_s": max(overhead, 1e-6),
    }
    contended = contention_warning(core.share())
    if contended is not None:
        stable.warn(contended)
    if stable.warnings:
        section["warnings"] = stable.warnings
        summary = stable.summary()
        if summary is not None:
            progress(f"warning: {summary}")
    return section


#: ``rate(name, work, fn)``: the units of ``work`` per second one call of ``fn`` does, as
#: :func:`measure_cpu` measures it (warmed up, best of its level's calls, rounds until stable).
_Rate = Callable[[str, float, Callable[[], Any]], float]
#: A rate table of a profile: dtype -> name -> [[size, seconds per unit], ...].
_Table = dict[str, dict[str, list[list[float]]]]


def _measure_matmul(rate: _Rate, rng: np.random.Generator, sizes: Sequence[int]
                    ) -> tuple[dict[str, float], float, _Table]:
    """Square matmuls of each order in ``sizes``, float32 and float64: the peak FLOP rate per
    dtype (fitted where there are several sizes, never below the best seen), the matrix order
    at half the peak (the median of the dtypes'), and the seconds per FLOP at each order."""
    matmul: dict[str, float] = {}
    table: _Table = {}
    half = []
    for dtype in ("float32", "float64"):
        points: list[tuple[float, float]] = []
        for n in sizes:
            a = rng.random((n, n)).astype(dtype)
            points.append((n, rate(f"matmul {n}² {dtype}", 2.0 * n**3, partial(np.matmul, a, a))))
        peak, h = _fit_inverse(points)
        matmul[dtype] = max(peak if len(points) > 1 else 0.0, max(r for _, r in points))
        half.append(h)
        table[dtype] = {"matmul": [[n, 1.0 / r] for n, r in points]}
    return matmul, statistics.median(half), table


def _measure_elementwise(rate: _Rate, rng: np.random.Generator, sizes: Sequence[int],
                         classes: Sequence[str]) -> tuple[dict[str, float], _Table, list[float]]:
    """Each ufunc of ``classes`` on arrays of each size in ``sizes``, float32 and float64: the
    median FLOP rate per dtype past the caches (weighted by :data:`UFUNC_WEIGHTS`; ``add``
    aside), the seconds per element at each size, and the memory bandwidths ``add`` reached
    past the caches (two reads and one write an element)."""
    flops: dict[str, float] = {}
    per_element: _Table = {}
    bandwidths = []
    for dtype in ("float32", "float64"):
        rates = []
        per_element[dtype] = {}
        for name in classes:
            ufunc = getattr(np, name)
            per_n: list[list[float]] = []
            for n in sizes:
                x = rng.random(n).astype(dtype) + 0.5
                y = rng.random(n).astype(dtype) + 0.5
                # as Dask's chunk functions run: distinct operands, a new result each call
                args = (x, y) if ufunc.nin == 2 else (x,)
                elements = rate(f"{name} {n:,} {dtype}", float(n), partial(ufunc, *args))
                per_n.append([n, 1.0 / elements * (3 / (ufunc.nin + 1))])
                if n >= 1 << 20:  # past the caches, as most chunks are
                    if name == "add":
                        bandwidths.append(3 * x.itemsize * elements)  # two reads, one write
                    else:
                        rates.append(UFUNC_WEIGHTS[name] * elements)
            per_element[dtype][name] = per_n
        flops[dtype] = statistics.median(rates)
    return flops, per_element, bandwidths


def _measure_fft(rate: _Rate, rng: np.random.Generator, sizes: Sequence[int]
                 ) -> tuple[dict[str, float], _Table]:
    """Complex FFTs of each length in ``sizes``, single and double precision (by the float
    dtype): the FLOP rate per dtype (``5 n log2 n`` FLOPs; the median over the sizes) and the
    seconds per FLOP at each length."""
    fft: dict[str, float] = {}
    table: _Table = {}
    for dtype, ctype in (("float32", np.complex64), ("float64", np.complex128)):
        per_flop: list[list[float]] = []
        for n in sizes:
            z = (rng.random(n) + 1j * rng.random(n)).astype(ctype)
            per_flop.append([n, 1.0 / rate(f"fft {n:,} {dtype}", 5 * n * math.log2(n),
                                           partial(np.fft.fft, z))])
        fft[dtype] = 1.0 / statistics.median(p[1] for p in per_flop)
        table[dtype] = {"fft": per_flop}
    return fft, table


def _measure_reductions(rate: _Rate, rng: np.random.Generator, sizes: Sequence[int]
                        ) -> tuple[_Table, list[float]]:
    """Sums of arrays of each size in ``sizes``, float32 and float64: the seconds per element
    at each size, and the read bandwidths float64 reached past the caches."""
    table: _Table = {}
    bandwidths = []
    for dtype in ("float32", "float64"):
        per_element_sum: list[list[float]] = []
        for n in sizes:
            x = rng.random(n).astype(dtype)
            elements = rate(f"sum {n:,} {dtype}", float(n), x.sum)
            per_element_sum.append([n, 1.0 / elements])
            if n >= 1 << 20 and dtype == "float64":
                bandwidths.append(x.itemsize * elements)
        table[dtype] = {"sum": per_element_sum}
    return table, bandwidths


def measure_local_cpu() -> dict[str, Any]:
    """This machine's CPU at the ``probe`` level (well under 2 s): what a profile without a
    ``cpu`` section uses (cached per machine by :func:`cached_local_cpu`)."""
    return measure_cpu(level="probe", progress=lambda message: None)


def cpu_cache_path() -> Path:
    """Where this machine's measured CPU section is cached."""
    return cache_dir() / f"cpu-{machine_id()}.json"


def cached_local_cpu(*, accept: Callable[[dict[str, Any]], bool] = lambda data: True,
                     ) -> dict[str, Any]:
    """The local CPU's profile section: read from the per-machine cache where ``accept``
    takes it, else measured and cached. A reading with warnings (the machine was loaded, other
    processes took turns on the core, rounds disagreed) serves this process only: it is not
    cached, and one found in the cache is measured again, so a bad minute does not price every
    plan on this machine for good."""
    path = cpu_cache_path()
    try:
        data = read_json(path)
        if isinstance(data, dict) and not data.get("warnings") and accept(data):
            return data
    except (OSError, ValueError, RecursionError):  # none yet, refused, or not JSON: measure again
        pass
    data = measure_local_cpu()
    if data.get("warnings"):
        return data
    try:
        write_json_atomic(path, data, indent=2)
    except OSError:  # read-only or refused: measure again next process
        pass
    return data


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
#: Copy sizes (bytes) the link's copy paths are measured at, by level: 1 MiB to 256 MiB, and
#: 1 GiB in full (the chunk sizes Dask arrays have).
LINK_SIZES = {"quick": tuple(n << 20 for n in (1, 4, 16, 64, 256)),
              "full": tuple(n << 20 for n in (1, 4, 16, 64, 256, 1024))}

_FIRST_USE = """
import sys, time
import cupy
start = time.perf_counter()
x = cupy.arange(1024, dtype=cupy.float32)               # context, module load, allocation
kernel = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x * %r + 1",
                                "eugo_first_use_%d")   # a kernel no cache holds: NVRTC compiles it
y = kernel(x)
cupy.cuda.get_current_stream().synchronize()
print(time.perf_counter() - start)
"""


def measure_link(cupy: Any, settings: DeviceSettings, *, sizes: Sequence[int], repeat: int = 3,
                 cores: int | None = None, progress: Progress = print) -> dict[str, Any]:
    """The copies the runtime can take, measured by size: at each size in ``sizes`` (bytes)
    and each way, every copy :func:`~eugo_dask.devices.copy_candidates` allows with
    ``settings`` (all paths and 1-8 copy threads where the copy keys are ``auto``, the
    configured ones where they are set) run through :class:`~eugo_dask.devices.CupyDevice`
    exactly as a task's copy (a pageable, touched host chunk; a new result array, or a pinned
    pool block), and raw DMA from and to a warm pinned buffer; plus the latency of an 8-byte
    copy. A candidate that did not take its path (CUDA refused to register the chunk, the pool
    had no room) is left out. Returns ``{"copies_by_size": {"h2d": [point, ...], "d2h": [...]},
    "dma": {"h2d": [...], "d2h": [...]} (bytes per second, by size), "latency_s": ...}``, each
    point the fastest candidate's (``link.copies_by_size``) with every candidate's rate and the
    DMA's in ``measured``."""
    cores = cores or os.cpu_count() or 1
    devices: dict[tuple[str, CopyChoice], CupyDevice] = {}
    out: dict[str, Any] = {"copies_by_size": {"h2d": [], "d2h": []}, "dma": {"h2d": [], "d2h": []}}
    with cupy.cuda.Device(0):
        for nbytes in sizes:
            rates = _copy_rates(cupy, settings, devices, nbytes, repeat, cores)
            for way in ("h2d", "d2h"):
                dma = rates[way].pop("dma")
                out["dma"][way].append(dma)
                name, rate = max(rates[way].items(), key=lambda item: item[1])
                point: dict[str, Any] = {"bytes": int(nbytes), "bytes_per_s": rate,
                                         "path": name.split("-")[0]}
                if point["path"] == "staged":
                    point["threads"] = int(name.split("-")[1])
                point["measured"] = {**rates[way], "dma": dma}
                out["copies_by_size"][way].append(point)
            progress(f"link: {nbytes / (1 << 20):6.0f} MiB  " + "  ".join(
                f"{way} {p['bytes_per_s'] / 1e9:5.1f} GB/s {_choice_name(p)} "
                f"({p['bytes_per_s'] / p['measured']['dma']:.2f} of DMA)"
                for way, p in ((way, out["copies_by_size"][way][-1]) for way in ("h2d", "d2h"))))
        tiny = np.ones(1, dtype=np.float64)
        device = next(iter(devices.values()))
        out["latency_s"] = best_seconds(lambda: device.to_device(tiny, 0), repeat=20)
    for device in devices.values():
        device._results.clear()
        device.release_memory()
    return out


def _choice_name(point: dict[str, Any]) -> str:
    return f"staged-{point['threads']}" if point["path"] == "staged" else point["path"]


def _copy_device(cupy: Any, settings: DeviceSettings, way: str, choice: CopyChoice) -> CupyDevice:
    """A device whose copies that way take ``choice`` at every size (one point, per size)."""
    rule: tuple[CopyRule, ...] = ((1, choice.path, choice.threads if choice.path == "staged" else None),)
    forced = replace(settings, per_size=frozenset({way, "threads"}), copy_threads=choice.threads)
    forced = replace(forced, h2d_by_size=rule) if way == "h2d" else replace(forced, d2h_by_size=rule)
    return CupyDevice(cupy, forced, count=1)


def _copy_rates(cupy: Any, settings: DeviceSettings, devices: dict[tuple[str, CopyChoice], CupyDevice],
                nbytes: int, repeat: int, cores: int) -> dict[str, dict[str, float]]:
    """Bytes per second of each candidate copy of ``nbytes`` each way, and of raw pinned DMA."""
    pinned = cupy.cuda.pinned_memory
    stream = cupy.cuda.get_current_stream()
    host = np.ones(nbytes, dtype=np.uint8)  # a Dask chunk: pageable, already touched
    buffer = pinned.PinnedMemoryPointer(pinned.PinnedMemory(nbytes), 0)
    source = cupy.empty(nbytes, dtype=np.uint8)
    source.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
    stream.synchronize()
    budget = max(0.5, 4 * nbytes / 1e10)

    def rate(copy: Callable[[], Any]) -> float:
        return nbytes / best_seconds(copy, repeat=repeat, budget_s=budget)

    def dma(way: str) -> Callable[[], None]:
        def run() -> None:
            (source.data.copy_from_host_async if way == "h2d" else source.data.copy_to_host_async)(
                buffer.ptr, nbytes, stream)
            stream.synchronize()
        return run

    rates: dict[str, dict[str, float]] = {}
    direct = nbytes <= CupyDevice.direct_copy_bytes or settings.staging_bytes <= 0
    for way in ("h2d", "d2h"):
        rates[way] = {"dma": rate(dma(way))}
        choices = [CopyChoice("direct", 1)] if direct else copy_candidates(settings, way, nbytes, cores)
        for choice in choices:
            key = (way, choice)
            if key not in devices:
                devices[key] = _copy_device(cupy, settings, way, choice)
            device = devices[key]
            before = device_stats()
            measured = rate(partial(device.to_device, host) if way == "h2d" else partial(device.to_host, source))
            if _took(choice, before, device_stats()):
                rates[way][choice.name] = measured
    return rates


#: The counter each path that is not always taken adds to, and the one that says it was not.
_PATH_COUNTERS = {"registered": ("h2d_registered", "h2d_register_refused"), "pinned": ("d2h_pinned", None),
                  "staged": (None, None), "direct": (None, None)}


def _took(choice: CopyChoice, before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether every copy measured took ``choice``'s path (by the device's counters)."""
    taken, refused = _PATH_COUNTERS[choice.path]
    if refused is not None and after[refused] > before[refused]:
        return False
    if taken is None:
        return True
    calls = max(after["h2d_count"] - before["h2d_count"], after["d2h_count"] - before["d2h_count"])
    return after[taken] - before[taken] >= calls


def _copy_path(settings: DeviceSettings) -> str:
    """The copy path the link figures were measured on, in words."""
    words = [f"eugo's copies: {settings.staging_bytes >> 20} MiB pinned staging buffers"]
    if "d2h" in settings.per_size:
        words.append("results back by the path measured best per size")
    elif settings.pinned_results_bytes:
        words.append(f"results of {settings.pinned_results_min_bytes >> 20} MiB or more into pinned blocks")
    if "h2d" in settings.per_size:
        words.append("chunks to the device by the path measured best per size")
    elif settings.register_min_bytes is not None:
        words.append(f"chunks of {settings.register_min_bytes >> 20} MiB or more page-locked in place")
    words.append("staging threads measured best per size" if "threads" in settings.per_size
                 else f"{settings.copy_threads} staging threads")
    return ", ".join(words)


def measure_first_use(cupy: Any, device: CupyDevice) -> tuple[float, float]:
    """(first_use_s, thread_setup_s): a fresh process's CUDA context, module load and first
    NVRTC compile, timed in a subprocess; and what a new worker thread pays on its first task
    (its stream, cuBLAS handle and cuFFT plan) beyond the same work warm."""
    code = _FIRST_USE % (time.time() % 1, os.getpid())
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)
        first_use = float(done.stdout.split()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        first_use = float("nan")
    seconds: list[float] = []

    def first_task() -> None:
        a = cupy.ones((64, 64), dtype=np.float32)

        def work() -> None:
            with device.task(0):
                _ = a @ a
                _ = cupy.fft.fft(a[0])

        start = time.perf_counter()
        work()
        cold = time.perf_counter() - start
        seconds.append(max(cold - best_seconds(work, repeat=5), 0.0))

    thread = threading.Thread(target=first_task)
    thread.start()
    thread.join()
    return first_use, (seconds[0] if seconds else float("nan"))


def _device_rates(cupy: Any, n: int, m: int, points: int, stable: Stability, repeat: int,
                  sync: Callable[[], None]) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
    """Achieved bandwidth (bytes/s), sin rate, GEMM rate and FFT rate (flop-equivalents/s)."""
    def rate(name: str, work: float, fn: Callable[[], Any], calls: int = repeat) -> float:
        return stable.rate(name, lambda: work / best_seconds(fn, repeat=calls, sync=sync))

    x, y, z = (cupy.ones(n, dtype=np.float32) for _ in range(3))
    bandwidth = max(rate("gpu add", 3 * x.nbytes, partial(cupy.add, x, y, out=z)),  # two reads, a write
                    rate("gpu copy", 2 * x.nbytes, partial(cupy.copyto, z, x)))   # a read, a write
    flops: dict[str, float] = {}
    matmul: dict[str, float] = {}
    for dtype in ("float16", "float32", "float64"):
        v = cupy.ones(n, dtype=dtype) * 0.5
        flops[dtype] = rate(f"gpu sin {dtype}", UFUNC_WEIGHTS["sin"] * n, partial(cupy.sin, v))
        a = cupy.ones((m, m), dtype=dtype)
        matmul[dtype] = rate(f"gpu matmul {dtype}", 2.0 * m**3, partial(cupy.matmul, a, a),
                             max(2, repeat // 2))
    fft: dict[str, float] = {}
    for dtype, ctype in (("float32", np.complex64), ("float64", np.complex128)):
        w = cupy.ones(points, dtype=ctype)
        fft[dtype] = rate(f"gpu fft {dtype}", 5 * points * math.log2(points), partial(cupy.fft.fft, w))
    return bandwidth, flops, matmul, fft


def measure_gpu(*, quick: bool, progress: Progress = print,
                settings: DeviceSettings | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``gpu`` and ``link`` sections, measured on CUDA device 0 on the runtime's own paths.

    Bandwidth is that of ``add(x, y, out=z)`` (three arrays: two reads and a write) or of a copy
    (a read and a write), whichever is higher; ``call_overhead_s`` is the host's cost per call in
    a stream of back-to-back calls and ``kernel_launch_s`` what a lone call adds until its result
    is ready; the link's copies are measured by size on every path the runtime can take
    (:func:`measure_link`: ``copies_by_size``, the best path at each size; ``h2d``/``d2h`` the
    largest size's rates) and ``pinned_*`` is raw DMA; FFT rate,
    first use (context, NVRTC compile) and per-thread set-up are measured too. The figures are
    achieved rates: the section says ``measured: true`` and the cost model applies no
    efficiency factors."""
    cupy = import_cupy()
    device = CupyDevice(cupy, settings or DeviceSettings(), count=1)
    level = "quick" if quick else "full"
    stable = Stability(progress, rounds=1 if quick else 2)
    repeat = 5 if quick else 10
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = cupy_device_name() or "CUDA device 0"
    progress(f"gpu: {name}")

    progress("link: the runtime's copy paths by size, and raw pinned DMA")
    link_rates = measure_link(cupy, device.settings, sizes=LINK_SIZES[level], progress=progress)

    with cupy.cuda.Device(0):
        sync = cupy.cuda.get_current_stream().synchronize

        progress("gpu: call and kernel-launch overhead")
        small = cupy.ones(8, dtype=np.float32)
        small_out = cupy.empty_like(small)
        calls = 200

        def back_to_back() -> None:
            for _ in range(calls):
                cupy.add(small, 1, out=small_out)

        call = best_seconds(back_to_back, repeat=repeat, sync=sync) / calls
        lone = best_seconds(lambda: cupy.add(small, 1, out=small_out), repeat=repeat * 10, sync=sync)

        progress("gpu: memory bandwidth, elementwise, GEMM and FFT rates")
        n = 1 << (25 if quick else 27)
        bandwidth, flops, matmul, fft = _device_rates(cupy, n, 4096 if quick else 8192,
                                                      1 << (20 if quick else 22), stable, repeat, sync)

        progress("gpu: cuFFT plan creation, first use, a new thread's set-up")

        def plan_cost(shape: tuple[int, ...]) -> float:
            q = cupy.ones(shape, dtype=np.complex64)
            cupy.fft.config.get_plan_cache().clear()
            start = time.perf_counter()
            cupy.fft.fft2(q)
            sync()
            first = time.perf_counter() - start
            again = best_seconds(lambda: cupy.fft.fft2(q), repeat=repeat, sync=sync)
            return max(first - again, 0.0)

        fft_plan = statistics.median(plan_cost((s, s)) for s in (384, 768, 1536))
    first_use, thread_setup = measure_first_use(cupy, device)
    device.release_memory()
    gpu: dict[str, Any] = {
        "name": name,
        "source": f"calibrated {time.strftime('%Y-%m-%d')} on {platform.node()}"
                  + (" (quick)" if quick else ""),
        "measured": True,
        "count": int(cupy.cuda.runtime.getDeviceCount()),
        "memory_bytes": float(props["totalGlobalMem"]),
        "memory_bandwidth_bytes_per_s": bandwidth,
        "flops_per_s": flops,
        "matmul_flops_per_s": matmul,
        "fft_flops_per_s": fft,
        "call_overhead_s": call,
        "kernel_launch_s": max(lone - call, 0.0),
        "fft_plan_s": fft_plan,
    }
    if math.isfinite(first_use):
        gpu["first_use_s"] = first_use
    if math.isfinite(thread_setup):
        gpu["thread_setup_s"] = thread_setup
    copies = link_rates["copies_by_size"]
    link = {
        "name": f"host link of {name} ({_copy_path(device.settings)})",
        # the largest size's: what chunks of tens to hundreds of MiB see, where a planner
        # reads one rate each way (copies_by_size prices every size)
        "h2d_bytes_per_s": copies["h2d"][-1]["bytes_per_s"],
        "d2h_bytes_per_s": copies["d2h"][-1]["bytes_per_s"],
        "pinned_h2d_bytes_per_s": max(link_rates["dma"]["h2d"]),
        "pinned_d2h_bytes_per_s": max(link_rates["dma"]["d2h"]),
        "latency_s": link_rates["latency_s"],
        "copies_by_size": copies,
    }
    if stable.warnings:
        gpu["source"] += "; unstable: " + "; ".join(stable.warnings)
    return gpu, link
