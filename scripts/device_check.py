"""The GPU checks ``scripts/gpu-check.sh`` runs, one subcommand each; every one prints what it
measured and appends one JSON record to ``--json`` (the script's ``results.jsonl``).

- ``env``: versions, the CUDA device(s), and whether eugo's probe takes the device (and why not);
- ``copies``: the runtime's copy path (:class:`eugo_dask.devices.CupyDevice`: pinned staging
  buffers, two per thread) against ``cupy.asarray``/``cupy.asnumpy`` (the old path), straight
  pageable copies and raw pinned DMA, 1 MiB to 1 GiB, first call (cold: buffers and pool
  allocated) and warm, copies back into a new (page-faulting) or a reused host array, and the
  staging buffer size swept at 256 MiB;
- ``engine``: the copy engine (copy threads 1, 4 and 8, capped at the cores, staged; results
  copied into pinned blocks from the result pool; chunks page-locked in place, and what
  registering alone costs; the defaults as shipped) against raw pinned DMA, 1 MiB to 1 GiB
  both ways, as rates and ratios, and whether chunks of 16 MiB and more reach 0.8 of the DMA
  rate; a column that fails is recorded with its error and the others still measure;
- ``paths``: the runtime's copies with the calibrated profile in force (``--profile``, what the
  ``calibrate`` step wrote), 1 MiB to 1 GiB both ways: the path the profile chose at each size
  (its per-size points), the path taken (device counters), the rate against raw pinned DMA, and
  the rate the planner prices that copy at;
- ``waits``: a slow kernel ahead of a copy back outside a task (a strided view, staged and
  direct: values wrong), and the thread CPU time while a task scope and a copy back wait for a
  0.5 s kernel (blocking-sync events: the thread sleeps);
- ``timing``: what an unsynchronised timer sees (launch) against the device's time (CUDA events
  in a task scope) for a GEMM, an elementwise chain and an FFT, and what the runtime's
  ``DeviceCall`` returns after;
- ``memory``: a long run of tasks with varied shapes on four threads, once through eugo's device
  (pool limit, bounded FFT plan caches, idle release) and once on CuPy's defaults, sampling pool,
  pinned memory, FFT plans and the process's RSS;
- ``threads``: copy-and-compute throughput with 1, 2, 4 and 8 worker threads;
- ``throughput``: device tasks per second through eugo's task scope and copies against plain
  CuPy calls on the same work (a 1-32 MiB float32 chunk in, ``x * 2``, out), on 1 and 4 threads,
  with 8 MiB staging buffers (the default), none, and 32 MiB; and each phase's time on one thread;
- ``distributed``: a scheduler with eugo's plugin, a GPU worker and a CPU worker (separate
  processes): where tasks ran, results against plain Dask, device counters per worker.

Without a usable CUDA device each GPU check says why and records ``skipped``; ``distributed``
then runs on the emulated device (the cluster's mechanics, not GPU speed).

    python scripts/device_check.py copies --json results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import eugo_dask
from eugo_dask.devices import CupyDevice, DeviceSettings, cupy_device_count, cupy_unusable_reason

MiB = 1 << 20


class NoGPU(Exception):
    pass


class NotRun(Exception):
    """A check skipped for a reason of its own (it says which)."""


def gpu() -> Any:
    reason = cupy_unusable_reason()
    if reason is not None or not cupy_device_count():
        raise NoGPU(reason or "no CUDA device")
    import cupy

    return cupy


def best(fn: Callable[[], Any], repeat: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


# ---------------------------------------------------------------------------------------------
def check_env() -> dict[str, Any]:
    import dask
    import distributed

    out: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__,
                           "dask": dask.__version__, "distributed": distributed.__version__,
                           "eugo_dask": eugo_dask.__version__, "machine": platform.machine(),
                           "cpus": os.cpu_count(), "load": os.getloadavg()[0],
                           "unusable_reason": cupy_unusable_reason()}
    try:
        import cupy
    except ImportError as e:
        out["cupy"] = f"not importable: {e}"
        return out
    out["cupy"] = cupy.__version__
    if out["unusable_reason"] is None:
        runtime = cupy.cuda.runtime
        out["devices"] = []
        for i in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(i)
            name = props["name"]
            out["devices"].append({"name": name.decode() if isinstance(name, bytes) else name,
                                   "memory_bytes": int(props["totalGlobalMem"])})
        out["driver"] = runtime.driverGetVersion()
        out["runtime"] = runtime.runtimeGetVersion()
        from eugo_dask.config import resolve_profile

        out["profile_auto"] = resolve_profile("auto", "cupy")
    return out


def _first_copies(cupy: Any, host: np.ndarray) -> tuple[float, float]:
    """A new thread's first copy each way (cold: its staging buffers, the pool's first block)."""
    first: list[float] = []

    def run() -> None:
        dev = CupyDevice(cupy, DeviceSettings())
        start = time.perf_counter()
        x = dev.to_device(host)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        dev.to_host(x)
        first.append(time.perf_counter() - start)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return first[0], first[1]


def _copies_at(cupy: Any, staged: CupyDevice, direct: CupyDevice, nbytes: int) -> dict[str, float]:
    from eugo_dask.devices.cuda import _host_bytes

    pinned_mod = cupy.cuda.pinned_memory
    stream = cupy.cuda.get_current_stream()
    host = np.ones(nbytes, dtype=np.uint8)
    row: dict[str, float] = {}
    row["eugo_h2d_first"], row["eugo_d2h_first"] = _first_copies(cupy, host)
    on_device = staged.to_device(host)
    warm_out = np.empty_like(host)
    pinned = pinned_mod.PinnedMemoryPointer(pinned_mod.PinnedMemory(nbytes), 0)

    def synchronised(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> None:
            fn()
            stream.synchronize()
        return run

    copies = {
        "eugo_h2d": lambda: staged.to_device(host),
        "eugo_d2h_new_array": lambda: staged.to_host(on_device),  # what a task does
        "eugo_d2h_reused_array": synchronised(
            lambda: staged._d2h(on_device.data, _host_bytes(warm_out), stream,
                                staged._copy_choice("d2h", nbytes))),
        "cupy_asarray": synchronised(lambda: cupy.asarray(host)),
        "cupy_asnumpy": lambda: cupy.asnumpy(on_device),
        "pageable_h2d": lambda: direct.to_device(host),
        "pageable_d2h_new_array": lambda: direct.to_host(on_device),
        "pinned_h2d": synchronised(lambda: on_device.data.copy_from_host_async(pinned.ptr, nbytes, stream)),
        "pinned_d2h": synchronised(lambda: on_device.data.copy_to_host_async(pinned.ptr, nbytes, stream)),
    }
    for name, copy in copies.items():
        row[name] = best(copy, repeat=3 if nbytes < 512 * MiB else 2)
    return row


def check_copies() -> dict[str, Any]:
    cupy = gpu()
    staged = CupyDevice(cupy, DeviceSettings())
    direct = CupyDevice(cupy, DeviceSettings(staging_bytes=0))
    rows = []
    for nbytes in (MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB):
        row = _copies_at(cupy, staged, direct, nbytes)
        rows.append({"MiB": nbytes // MiB, **row})
        print(f"{nbytes // MiB:>6} MiB  " + "  ".join(f"{k} {nbytes / v / 1e9:6.1f}" for k, v in row.items())
              + "  (GB/s)", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    sweep = {}
    host = np.ones(256 * MiB, dtype=np.uint8)
    for chunk_mib in (1, 2, 4, 8, 16, 32, 64):
        dev = CupyDevice(cupy, DeviceSettings(staging_bytes=chunk_mib * MiB))
        x = dev.to_device(host)
        sweep[chunk_mib] = {"h2d_GBps": host.nbytes / best(lambda dev=dev: dev.to_device(host)) / 1e9,
                            "d2h_GBps": host.nbytes / best(lambda dev=dev, x=x: dev.to_host(x)) / 1e9}
        print(f"staging {chunk_mib:>3} MiB at 256 MiB: h2d {sweep[chunk_mib]['h2d_GBps']:6.1f} GB/s, "
              f"d2h {sweep[chunk_mib]['d2h_GBps']:6.1f} GB/s", flush=True)
    return {"seconds_by_size": rows, "staging_sweep": sweep}


ENGINE_SIZES_MIB = (1, 4, 16, 64, 256, 1024)


def _engine_columns() -> dict[str, tuple[DeviceSettings, tuple[str, ...]]]:
    """The engine settings measured, each with the directions it changes: staged copies on 1, 4
    and 8 threads (no pinned results, no registration), every result into a pinned pool block,
    every contiguous chunk page-locked in place (to the device only), and the defaults as
    shipped (pinned results from 64 MiB)."""
    staged = {"pinned_results_bytes": 0, "register_min_bytes": None}
    columns = {f"threads{n}": (DeviceSettings(copy_threads=n, **staged), ("h2d", "d2h")) for n in (1, 4, 8)}
    columns["threads4_pinned"] = (DeviceSettings(copy_threads=4, pinned_results_bytes=2048 * MiB,
                                                 pinned_results_min_bytes=0), ("d2h",))
    columns["threads4_registered"] = (DeviceSettings(copy_threads=4, pinned_results_bytes=0,
                                                     register_min_bytes=0), ("h2d",))
    columns["defaults"] = (DeviceSettings(), ("h2d", "d2h"))
    return columns


def _engine_at(cupy: Any, engines: dict[str, tuple[CupyDevice, tuple[str, ...]]], nbytes: int,
               errors: dict[str, str]) -> dict[str, float]:
    """GB/s of each engine setting in the directions it changes at ``nbytes``, of raw pinned
    DMA, and of page-locking in place alone (``register_h2d``: cudaHostRegister and
    cudaHostUnregister of the chunk, no copy). A column that fails is left out of the row and
    its error kept in ``errors`` (the other columns still measure)."""
    stream = cupy.cuda.get_current_stream()
    pinned_mod = cupy.cuda.pinned_memory
    runtime = cupy.cuda.runtime
    host = np.ones(nbytes, dtype=np.uint8)
    pinned = pinned_mod.PinnedMemoryPointer(pinned_mod.PinnedMemory(nbytes), 0)
    repeat = 3 if nbytes < 512 * MiB else 2
    on_device = cupy.empty(nbytes, dtype=np.uint8)
    on_device.data.copy_from_host_async(host.ctypes.data, nbytes, stream)

    def synchronised(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> None:
            fn()
            stream.synchronize()
        return run

    def register() -> None:
        runtime.hostRegister(host.ctypes.data, nbytes, 0)
        runtime.hostUnregister(host.ctypes.data)

    runs: dict[str, Callable[[], Any]] = {
        "dma_h2d": synchronised(lambda: on_device.data.copy_from_host_async(pinned.ptr, nbytes, stream)),
        "dma_d2h": synchronised(lambda: on_device.data.copy_to_host_async(pinned.ptr, nbytes, stream)),
        "register_h2d": register}
    for name, (dev, ways) in engines.items():
        if "h2d" in ways:
            runs[f"{name}_h2d"] = lambda dev=dev: dev.to_device(host)
        if "d2h" in ways:
            runs[f"{name}_d2h"] = lambda dev=dev: dev.to_host(on_device)
    row = {}
    for name, run in runs.items():
        try:
            row[name] = nbytes / best(run, repeat) / 1e9
        except Exception as e:  # one column's failure leaves the others measured
            errors.setdefault(name, f"{nbytes // MiB} MiB: {type(e).__name__}: {e}")
    return row


def check_engine() -> dict[str, Any]:
    cupy = gpu()
    import eugo_dask

    cores = os.cpu_count() or 1
    engines = {name: (CupyDevice(cupy, settings, count=1), ways)
               for name, (settings, ways) in _engine_columns().items()}
    rows, errors = [], {}
    eugo_dask.reset_device_stats()
    for mib in ENGINE_SIZES_MIB:
        row = _engine_at(cupy, engines, mib * MiB, errors)
        ratios = {k: v / row["dma_" + k.rsplit("_", 1)[1]] for k, v in row.items()
                  if not k.startswith("dma") and "dma_" + k.rsplit("_", 1)[1] in row}
        rows.append({"MiB": mib, "GBps": row, "of_dma": ratios})
        print(f"{mib:>5} MiB  DMA h2d {row.get('dma_h2d', 0):5.1f} d2h {row.get('dma_d2h', 0):5.1f} GB/s; "
              + "  ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + "  (of DMA)", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    stats = eugo_dask.device_stats()
    paths = {k: stats[k] for k in ("h2d_registered", "h2d_register_refused", "d2h_pinned")}
    best_from_16 = {way: min((max((r["of_dma"][k] for k in r["of_dma"]
                                   if k.endswith(way) and not k.startswith("register")), default=0.0)
                              for r in rows if r["MiB"] >= 16), default=0.0) for way in ("h2d", "d2h")}
    print(f"best engine setting from 16 MiB, worst size: h2d {best_from_16['h2d']:.2f}, d2h "
          f"{best_from_16['d2h']:.2f} of raw pinned DMA (target 0.8); {cores} cores; copies by "
          f"path {paths}", flush=True)
    for name, error in errors.items():
        print(f"column {name} failed: {error}", flush=True)
    return {"cores": cores, "rows": rows, "best_of_dma_from_16MiB": best_from_16, "paths": paths,
            "errors": errors, "meets_0_8": all(v >= 0.8 for v in best_from_16.values())}


def _path_taken(way: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    """The path one copy took, from the device counters around it."""
    def grew(name: str) -> bool:
        return after[name] > before[name]

    if way == "h2d":
        return "registered" if grew("h2d_registered") else "staged" if grew("h2d_staged") else "direct"
    return "pinned" if grew("d2h_pinned") else "staged" if grew("d2h_staged") else "direct"


def _paths_at(cupy: Any, device: CupyDevice, copies: Any, nbytes: int) -> dict[str, Any]:
    """One size of :func:`check_paths`: each way the path chosen, the path taken, GB/s of the
    runtime's copy, of raw pinned DMA beside it, and the rate the planner prices."""
    stream = cupy.cuda.get_current_stream()
    pinned_mod = cupy.cuda.pinned_memory
    host = np.ones(nbytes, dtype=np.uint8)
    on_device = device.to_device(host)
    pinned = pinned_mod.PinnedMemoryPointer(pinned_mod.PinnedMemory(nbytes), 0)

    def dma(way: str) -> None:
        (on_device.data.copy_from_host_async if way == "h2d" else on_device.data.copy_to_host_async)(
            pinned.ptr, nbytes, stream)
        stream.synchronize()

    row: dict[str, Any] = {"MiB": nbytes // MiB}
    for way, copy in (("h2d", lambda: device.to_device(host)), ("d2h", lambda: device.to_host(on_device))):
        chosen = device._copy_choice(way, nbytes)
        before = eugo_dask.device_stats()
        copy()
        taken = _path_taken(way, before, eugo_dask.device_stats())
        rate = nbytes / best(copy, 3 if nbytes < 512 * MiB else 2) / 1e9
        dma_rate = nbytes / best(lambda way=way: dma(way), 3) / 1e9
        priced = copies.bytes_per_s(way, nbytes) if copies else None
        row[way] = {"chosen": chosen.name, "taken": taken, "GBps": rate, "dma_GBps": dma_rate,
                    "of_dma": rate / dma_rate, "priced_GBps": None if priced is None else priced / 1e9}
    return row


def check_paths(profile: str | None) -> dict[str, Any]:
    """The runtime's copies with a calibrated profile in force (``eugo.profile``: the
    ``calibrate`` step's): at each size each way, the path the profile chose (its nearest
    per-size point), the path the copy took (the device counters), its rate against raw pinned
    DMA measured beside it, and the rate the planner prices that copy at."""
    cupy = gpu()
    if not profile or not os.path.exists(profile):
        raise NotRun(f"no calibrated profile at {profile!r} (the calibrate step writes it)")
    import dask

    from eugo_dask.config import device_settings
    from eugo_dask.profile import copies_by_size

    with dask.config.set({"eugo.profile": profile}):
        settings = device_settings()
    copies = copies_by_size(profile)
    device = CupyDevice(cupy, settings, count=1)
    rows = []
    for mib in ENGINE_SIZES_MIB:
        row = _paths_at(cupy, device, copies, mib * MiB)
        rows.append(row)
        print(f"{mib:>5} MiB  " + "  ".join(
            f"{way} {r['chosen']}->{r['taken']} {r['GBps']:5.1f} GB/s ({r['of_dma']:.2f} of DMA "
            f"{r['dma_GBps']:.1f}; priced {r['priced_GBps'] or 0:.1f})"
            for way, r in ((w, row[w]) for w in ("h2d", "d2h"))), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    mismatches = [f"{r['MiB']} MiB {way}: chose {r[way]['chosen']}, took {r[way]['taken']}"
                  for r in rows for way in ("h2d", "d2h")
                  if r[way]["taken"] != r[way]["chosen"].split("-")[0]]
    from_16 = {way: min((r[way]["of_dma"] for r in rows if r["MiB"] >= 16), default=0.0) for way in ("h2d", "d2h")}
    print(f"runtime's copies from 16 MiB, worst size: h2d {from_16['h2d']:.2f}, d2h {from_16['d2h']:.2f} of raw "
          f"pinned DMA (target 0.8); paths as chosen: {not mismatches} {mismatches}", flush=True)
    device.release_memory()
    return {"profile": profile, "rows": rows, "of_dma_from_16MiB": from_16, "mismatches": mismatches,
            "taken_as_chosen": not mismatches, "meets_0_8": all(v >= 0.8 for v in from_16.values())}


def check_timing() -> dict[str, Any]:
    cupy = gpu()
    import dask

    from eugo_dask.runtime import DeviceCall

    dev = CupyDevice(cupy, DeviceSettings())
    a = cupy.random.random((8192, 8192), dtype=np.float32)
    v = cupy.random.random(1 << 27, dtype=np.float32)
    z = cupy.random.random((4096, 4096), dtype=np.float32).astype(np.complex64)
    cases = {"matmul 8192² f32": lambda: a @ a, "exp(sin(x))*2, 512 MiB f32": lambda: cupy.exp(cupy.sin(v)) * 2,
             "fft2 4096² c64": lambda: cupy.fft.fft2(z)}
    out = {}
    sync = cupy.cuda.get_current_stream().synchronize
    for name, fn in cases.items():
        fn()
        sync()
        start = time.perf_counter()
        fn()
        launch = time.perf_counter() - start
        sync()
        unsynced_total = time.perf_counter() - start
        with dev.task(0) as clock:
            fn()
            clock.mark("compute")
        out[name] = {"launch_s": launch, "launch_then_sync_s": unsynced_total,
                     "scope_launch_s": clock.launch_s, "scope_wall_s": clock.wall_s,
                     "scope_device_s": clock.device_s}
        print(f"{name}: launch {launch * 1e3:.2f} ms, synchronised {unsynced_total * 1e3:.2f} ms; task scope: "
              f"launch {clock.launch_s * 1e3:.2f} ms, device {clock.device_s * 1e3:.2f} ms, wall "
              f"{clock.wall_s * 1e3:.2f} ms", flush=True)
    # a whole device task as the runtime runs it: a 16 MiB host chunk in, four GEMMs, the result out
    host_a = np.ones((2048, 2048), dtype=np.float32)
    with dask.config.set({"eugo.device": "cupy"}):
        call = DeviceCall(lambda x: x @ x @ x @ x, "cupy", "timing")
        call(host_a)
        start = time.perf_counter()
        call(host_a)
        returned = time.perf_counter() - start
        cupy.cuda.Device(0).synchronize()
        finished = time.perf_counter() - start
    out["devicecall x@x@x@x 2048² f32 from host"] = {"returned_s": returned, "done_s": finished}
    print(f"runtime DeviceCall, x@x@x@x on a 2048² f32 host chunk (16 MiB in and out): returned after "
          f"{returned * 1e3:.2f} ms, done after {finished * 1e3:.2f} ms", flush=True)
    return out


_SLOW_DOUBLE = r"""
extern "C" __global__ void eugo_check_slow_double(const double* x, double* y, long long n,
                                                  long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        y[i] = 2 * x[i];
}
"""


def check_waits() -> dict[str, Any]:
    """A slow kernel ahead of a copy back outside a task (a strided view, staged and direct):
    wrong values; and the thread CPU time while a task scope, and a copy back, wait for a 0.5 s
    kernel (blocking-sync events: a small fraction of the wait)."""
    cupy = gpu()
    kernel = cupy.RawKernel(_SLOW_DOUBLE, "eugo_check_slow_double")
    rate = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000

    def slow_double(x: Any, seconds: float) -> Any:
        y = cupy.empty_like(x)
        kernel((64,), (256,), (x, y, np.int64(x.size), np.int64(seconds * rate)))
        return y

    out: dict[str, Any] = {}
    host = np.random.default_rng(1).random((1000, 400))
    for path, direct_bytes in (("staged", CupyDevice.direct_copy_bytes), ("direct", 1 << 30)):
        dev = CupyDevice(cupy, DeviceSettings(staging_bytes=1 * MiB))
        dev.direct_copy_bytes = direct_bytes
        x = cupy.asarray(host)
        cupy.cuda.get_current_stream().synchronize()
        back = dev.to_host(slow_double(x, 0.3)[::2])
        wrong = int(np.count_nonzero(back != host[::2] * 2))
        out[f"slow kernel, x[::2] copied back outside a task ({path})"] = {"wrong_values": wrong,
                                                                          "values": back.size}
        print(f"slow kernel ahead of a copy back of x[::2] outside a task, {path}: {wrong} of "
              f"{back.size} values wrong", flush=True)
    dev = CupyDevice(cupy, DeviceSettings())
    x = cupy.ones(1 << 20)
    cupy.cuda.get_current_stream().synchronize()
    for where in ("task scope", "copy back outside a task"):
        wall, cpu = time.perf_counter(), time.thread_time()
        if where == "task scope":
            with dev.task(0):
                slow_double(x, 0.5)
        else:
            dev.to_host(slow_double(x, 0.5))
        cpu_s, wall_s = time.thread_time() - cpu, time.perf_counter() - wall
        out[f"thread CPU while a {where} waits"] = {"cpu_s": cpu_s, "wall_s": wall_s,
                                                    "cpu_fraction": cpu_s / wall_s}
        print(f"thread CPU while a {where} waits for a 0.5 s kernel: {cpu_s * 1e3:.1f} ms in "
              f"{wall_s * 1e3:.1f} ms ({cpu_s / wall_s:.1%})", flush=True)
    bad = [k for k, v in out.items() if v.get("wrong_values") or v.get("cpu_fraction", 0) > 0.25]
    if bad:
        raise AssertionError(f"waits: {bad}")
    return out


def _memory_run(cupy: Any, seconds: float, device: CupyDevice | None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    hosts = [rng.random(int(n), dtype=np.float32) for n in rng.integers(1 << 18, 1 << 23, 24)]
    fft_lengths = [int(n) for n in rng.integers(1000, 50_000, 64)]
    pool = cupy.get_default_memory_pool()
    stop = time.monotonic() + seconds
    samples: list[dict[str, Any]] = []
    plans: dict[int, tuple[int, int]] = {}
    errors: list[str] = []
    tasks = [0]

    def task(i: int) -> None:
        host = hosts[i % len(hosts)]
        n = fft_lengths[(i * 7) % len(fft_lengths)]
        if device is not None:
            with device.task():
                x = device.to_device(host)
                y = cupy.fft.fft(x[:n].astype(cupy.complex64)).real
                device.to_host(y * 2 + x[:n])
        else:
            x = cupy.asarray(host)
            y = cupy.fft.fft(x[:n].astype(cupy.complex64)).real
            cupy.asnumpy(y * 2 + x[:n])
        tasks[0] += 1

    def worker(seed: int) -> None:
        i = seed
        try:
            while time.monotonic() < stop:
                task(i)
                i += 4
        except Exception as e:  # reported
            errors.append(f"{type(e).__name__}: {e}")
        cache = cupy.fft.config.get_plan_cache()
        plans[seed] = (int(cache.get_curr_size()), int(cache.get_curr_memsize()))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append({"t": round(seconds - (stop - time.monotonic()), 2), "pool_held": int(pool.total_bytes()),
                        "pool_used": int(pool.used_bytes()), "rss": rss_bytes(),
                        "pinned_pool_free_blocks": int(cupy.get_default_pinned_memory_pool().n_free_blocks()),
                        "eugo_pinned": device.memory_stats()["pinned_bytes"] if device else None})
        time.sleep(0.5)
    for t in threads:
        t.join()
    return {"tasks": tasks[0], "errors": errors[:3], "samples": samples,
            "fft_plans_per_thread": plans,
            "max_pool_held": max(s["pool_held"] for s in samples),
            "max_rss": max((s["rss"] or 0) for s in samples)}


def check_memory(seconds: float) -> dict[str, Any]:
    cupy = gpu()
    pool = cupy.get_default_memory_pool()
    device = CupyDevice(cupy, DeviceSettings(memory_fraction=0.8, fft_plan_cache_size=8,
                                             fft_plan_cache_bytes=1 << 30, idle_release_s=2.0))
    out = {"eugo": _memory_run(cupy, seconds, device)}
    time.sleep(3.0)  # idle: the releaser gives the pool back
    out["eugo"]["pool_held_after_idle"] = int(pool.total_bytes())
    out["eugo"]["memory_stats_after_idle"] = device.memory_stats()
    pool.free_all_blocks()
    pool.set_limit(size=0)
    out["cupy_defaults"] = _memory_run(cupy, seconds, None)
    time.sleep(3.0)
    out["cupy_defaults"]["pool_held_after_idle"] = int(pool.total_bytes())
    for name, run in out.items():
        print(f"{name}: {run['tasks']} tasks; pool held at most {run['max_pool_held'] / 2**30:.2f} GiB, "
              f"{run['pool_held_after_idle'] / 2**30:.2f} GiB after 3 s idle; RSS at most "
              f"{run['max_rss'] / 2**30:.2f} GiB; FFT plans per thread {run['fft_plans_per_thread']}; "
              f"errors {run['errors']}", flush=True)
    return out


def _tasks_per_second(task: Callable[[int], None], n_threads: int, seconds: float) -> float:
    """Calls of ``task`` per second from ``n_threads`` threads for ``seconds``; thread ``k`` calls
    it with ``k``, ``k + n_threads``, ``k + 2 n_threads`` ..."""
    stop = time.monotonic() + seconds
    done = [0] * n_threads

    def worker(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            task(i)
            i += n_threads
            done[k] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def _throughput(device: CupyDevice, host: np.ndarray, n_threads: int, seconds: float) -> float:
    """Tasks per second (copy in, compute, copy out) with ``n_threads`` worker threads."""
    def task(_: int) -> None:
        with device.task():
            device.to_host(device.to_device(host) * 2 + 1)

    return _tasks_per_second(task, n_threads, seconds)


def check_throughput(seconds: float = 2.5) -> dict[str, Any]:
    cupy = gpu()
    rng = np.random.default_rng(0)
    hosts = [rng.random(int(n), dtype=np.float32) for n in rng.integers(1 << 18, 1 << 23, 24)]
    local = threading.local()

    def plain(i: int) -> None:
        cupy.asnumpy(cupy.asarray(hosts[i % len(hosts)]) * 2)

    def plain_non_blocking(i: int) -> None:  # on a non-blocking stream per thread, as eugo's scope
        stream = getattr(local, "stream", None)
        if stream is None:
            stream = local.stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            plain(i)
            stream.synchronize()

    out: dict[str, Any] = {"mean_chunk_MiB": float(np.mean([h.nbytes for h in hosts])) / MiB}
    for label, staging in (("staging 8 MiB", 8 * MiB), ("no staging", 0), ("staging 32 MiB", 32 * MiB)):
        dev = CupyDevice(cupy, DeviceSettings(staging_bytes=staging))

        def eugo(i: int, dev: CupyDevice = dev) -> None:
            with dev.task():
                dev.to_host(dev.to_device(hosts[i % len(hosts)]) * 2)

        runs = {"eugo": eugo, "plain": plain, "plain_nb": plain_non_blocking}
        for task in runs.values():  # first use: kernels, handles, staging buffers
            task(0)
        cupy.cuda.Device().synchronize()
        entry: dict[str, Any] = {}
        for threads in (1, 4):
            entry[f"{threads} threads"] = {name: _tasks_per_second(task, threads, seconds)
                                           for name, task in runs.items()}
            print(f"{label}, {threads} thread(s): tasks/s "
                  f"{ {k: round(v, 1) for k, v in entry[f'{threads} threads'].items()} }", flush=True)
        phases = dict.fromkeys(("h2d", "op", "d2h", "scope exit"), 0.0)
        for i in range(48):
            t0 = time.perf_counter()
            with dev.task():
                x = dev.to_device(hosts[i % len(hosts)])
                t1 = time.perf_counter()
                y = x * 2
                t2 = time.perf_counter()
                dev.to_host(y)
                t3 = time.perf_counter()
            t4 = time.perf_counter()
            for name, spent in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name] += spent
        entry["phases_ms"] = {name: round(spent / 48 * 1e3, 3) for name, spent in phases.items()}
        print(f"{label}, eugo phases, ms per task on one thread: {entry['phases_ms']}", flush=True)
        out[label] = entry
    return out


def check_threads() -> dict[str, Any]:
    cupy = gpu()
    device = CupyDevice(cupy, DeviceSettings())
    host = np.ones(16 * MiB, dtype=np.float32)  # 64 MiB
    out = {}
    for n_threads in (1, 2, 4, 8):
        rate = _throughput(device, host, n_threads, 2.5)
        out[n_threads] = {"tasks_per_s": rate, "copied_GBps": rate * 2 * host.nbytes / 1e9,
                          "pinned_bytes": device.memory_stats()["pinned_bytes"]}
        print(f"{n_threads} threads: {rate:.1f} tasks/s, {out[n_threads]['copied_GBps']:.1f} GB/s copied "
              f"both ways, pinned staging {out[n_threads]['pinned_bytes'] // MiB} MiB", flush=True)
    return out


def check_distributed() -> dict[str, Any]:
    import dask
    import dask.array as da
    from distributed import Client, Nanny, Scheduler, SpecCluster

    device = "cupy" if cupy_unusable_reason() is None else "emulated"
    # a Nanny hands its own config to the worker process: each worker's eugo settings go there
    def eugo_config(worker_device: str) -> dict[str, Any]:
        return {"eugo": {**dask.config.get("eugo"), "device": worker_device, "device-idle-release": "5s"}}

    workers = {
        "gpu": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1},
                                          "config": eugo_config(device)}},
        "cpu": {"cls": Nanny, "options": {"nthreads": 2, "config": eugo_config("none")}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "preload": ["eugo_dask.plugin"]}}
    out: dict[str, Any] = {"device": device}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        names = {info["name"]: addr for addr, info in client.scheduler_info()["workers"].items()}

        def build():
            x = da.random.default_rng(0).random((4096, 4096), chunks=1024, dtype=np.float32)
            return (np.sin(x) @ x.T).sum(axis=0) + np.exp(x[0]).sum()

        with dask.config.set(optimizations=[]):
            start = time.perf_counter()
            expected = build().compute()
            out["plain_s"] = time.perf_counter() - start
        client.run(eugo_dask.reset_device_stats)
        with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": device, "eugo.min-speedup": 0}):
            start = time.perf_counter()
            result = build().compute()
            out["eugo_s"] = time.perf_counter() - start
        np.testing.assert_allclose(result, expected, rtol=1e-3)
        stats = client.run(eugo_dask.device_stats)
        memory = client.run(eugo_dask.devices.device_memory_stats)
        out["workers"] = {name: {"device_stats": stats[addr], "device_memory": memory[addr]}
                          for name, addr in names.items()}
        summary = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary())
        plugin = {"fallbacks": summary["fallbacks"],
                  "ran_on_device": sum(summary["tasks"].get("gpu", {}).values()),
                  "ran_on_cpu": sum(summary["tasks"].get("cpu", {}).values())}
        out["scheduler_plugin"] = plugin
    gpu_stats, cpu_stats = out["workers"]["gpu"]["device_stats"], out["workers"]["cpu"]["device_stats"]
    out["ok"] = bool(gpu_stats["tasks"] > 0 and cpu_stats["tasks"] == 0 and not plugin["fallbacks"])
    print(f"device {device}: plain Dask {out['plain_s']:.2f} s, eugo {out['eugo_s']:.2f} s; GPU worker "
          f"{gpu_stats['tasks']} device tasks, {gpu_stats['h2d_bytes'] / MiB:.0f} MiB h2d, "
          f"{gpu_stats['d2h_bytes'] / MiB:.0f} MiB d2h; CPU worker {cpu_stats['tasks']} device tasks; "
          f"scheduler: {plugin}; results match plain Dask; ok={out['ok']}", flush=True)
    return out


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "env": check_env, "copies": check_copies, "engine": check_engine, "timing": check_timing, "memory": check_memory,
    "threads": check_threads, "throughput": check_throughput, "distributed": check_distributed,
    "waits": check_waits, "paths": check_paths,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--json", help="append the record to this JSON-lines file")
    parser.add_argument("--seconds", type=float, default=18.0, help="memory: seconds per run")
    parser.add_argument("--profile", help="paths: the calibrated profile to copy with")
    args = parser.parse_args()
    start = time.perf_counter()
    record: dict[str, Any] = {"check": args.check}
    try:
        kwargs: dict[str, Any] = ({"seconds": args.seconds} if args.check == "memory" else
                                  {"profile": args.profile} if args.check == "paths" else {})
        record["result"] = CHECKS[args.check](**kwargs)
        record["status"] = "ok"
    except (NoGPU, NotRun) as e:
        record["status"] = "skipped"
        record["reason"] = f"no usable CUDA device: {e}" if isinstance(e, NoGPU) else str(e)
        print(f"{args.check}: skipped: {record['reason']}", flush=True)
    except Exception as e:  # recorded, and the exit status says so
        record["status"] = "failed"
        record["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(record["error"], file=sys.stderr, flush=True)
    record["seconds"] = round(time.perf_counter() - start, 2)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    sys.exit(1 if record["status"] == "failed" else 0)


if __name__ == "__main__":
    main()
