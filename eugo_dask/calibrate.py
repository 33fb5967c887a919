"""Calibration: measure this machine and write a profile ``eugo.profile`` accepts.

The measuring itself is :mod:`eugo_dask.measure`'s; this module assembles the profile.

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

import time
from typing import Any

from eugo_dask.devices import cupy_device_count
from eugo_dask.measure import Progress, measure_cpu, measure_gpu
from eugo_dask.profile import profile_dict, validate_profile_dict


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
