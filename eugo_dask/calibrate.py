"""Calibration: measure this machine and write a profile ``eugo.profile`` accepts.

The measuring itself is :mod:`eugo_dask.measure`'s; this module assembles the profile.

The CPU is always measured (:func:`eugo_dask.measure.measure_cpu` at level ``quick`` or
``full``): matmul by dtype up to 2048² (``--quick``) or 4096², the chunk sizes Dask arrays have;
elementwise ufuncs by class (memory-bound add, divide/sqrt, transcendental exp/sin, power); FFTs;
reductions; and the per-task overhead of Dask's scheduler, each over several chunk sizes. Every
rate is measured in rounds; unstable rounds are measured again and, where they stay unstable, a
warning says so (on ``progress`` and in the CPU section's ``warnings``).

With CuPy and a usable CUDA device the GPU and its link are measured too, on the runtime's own
paths (:func:`eugo_dask.measure.measure_gpu`): its host<->device copies at sizes from 1 MiB to
256 MiB (1 GiB in full) on every path the runtime can take there — straight, staged on 1, 2,
4 and 8 copy threads, page-locked in place to the device, into pinned result blocks back —
where the copy keys are ``auto`` (the defaults; a key that is set is measured as set, since the
runtime then takes it), each size's best written to ``link.copies_by_size`` with every path's
rate and raw pinned DMA's beside it: the runtime takes that path at that size and the planner
prices copies from those rates. Also transfer latency, CuPy call and kernel-launch overhead,
cuFFT plan creation, first use and per-thread set-up, and achieved bandwidth, elementwise,
GEMM and FFT rates (``measured: true``).
Without one, the GPU and link sections come from a preset and say so (``source``).

``--quick`` takes about 5-10 s on a 2-core machine without a GPU (longer on a busy one, whose
unstable rounds are measured again); the full run a minute or two. Progress goes to a callback
(the CLI prints it).
"""

from __future__ import annotations

import time
from typing import Any

from eugo_dask.config import configured_device_settings
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
    cpu = measure_cpu(level="quick" if quick else "full", threads=threads, progress=progress)
    if cupy_device_count():
        # the copies the runtime can take here: the configured staging and pool, each copy key
        # as set, or every path and thread count where it is auto (not the per-size paths of
        # a profile in force: those are what this measures anew)
        gpu, link = measure_gpu(quick=quick, progress=progress, settings=configured_device_settings())
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
