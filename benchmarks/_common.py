"""Shared by the benchmarks: timing, the devices available here, and the naive all-GPU baseline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dask
import numpy as np

import eugo_dask
from eugo_dask.devices import cupy_device_count

NOT_MEASURED = "not measured"


def best_of(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` calls (after none: the first call counts, as users pay it)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def has_gpu() -> bool:
    return bool(cupy_device_count())


def eugo_settings(profile: Any) -> dict[str, Any]:
    """eugo on, for the device this machine has: CuPy with a GPU, else the emulated device."""
    return {"optimizations": [eugo_dask.eugo], "eugo.device": "cupy" if has_gpu() else "emulated",
            "eugo.profile": profile}


def compute_plain(build: Callable[[], Any]) -> Any:
    with dask.config.set(optimizations=[]):
        return build().compute(scheduler="threads")


def compute_eugo(build: Callable[[], Any], profile: Any) -> Any:
    with dask.config.set(eugo_settings(profile)):
        return build().compute(scheduler="threads")


def naive_all_gpu(build_on: Callable[[Callable[[Any], Any]], Any]) -> Any:
    """What users write by hand today: every chunk ``map_blocks(cupy.asarray)``, the pipeline on
    CuPy, and ``cupy.asnumpy`` at the end. Needs CuPy and a GPU."""
    import cupy

    with dask.config.set(optimizations=[]):
        x = build_on(lambda a: a.map_blocks(cupy.asarray))
        return x.map_blocks(cupy.asnumpy).compute(scheduler="threads")


def fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


__all__ = ["NOT_MEASURED", "best_of", "compute_eugo", "compute_plain", "eugo_settings", "fmt",
           "has_gpu", "naive_all_gpu", "np"]
