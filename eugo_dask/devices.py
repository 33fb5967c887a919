"""Devices: the interface the runtime needs, the counters, and the CuPy device.

Two devices implement one small interface (:class:`Device`):

- ``cupy`` (here): a real CUDA device through CuPy, imported lazily the first time it is asked
  for. This is the only module that imports CuPy.
- ``emulated`` (:mod:`eugo_dask.emulated`): NumPy-backed device arrays of their own type that
  behave like CuPy where it matters for placement.

Every host<->device transfer and every task run on a device is counted per process; read the
counters with :func:`device_stats` and clear them with :func:`reset_device_stats`.

This module decides nothing and reads no config: the planner chooses, the rewrite wires tasks,
and :mod:`eugo_dask.runtime` picks the device inside tasks.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: The values of ``eugo.device``.
DEVICES = ("auto", "cupy", "emulated", "none")


# ---------------------------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------------------------
class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.tasks = 0
        self.h2d_count = 0
        self.h2d_bytes = 0
        self.d2h_count = 0
        self.d2h_bytes = 0
        self.fallbacks: Counter[str] = Counter()

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def add_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tasks": self.tasks,
                "h2d_count": self.h2d_count,
                "h2d_bytes": self.h2d_bytes,
                "d2h_count": self.d2h_count,
                "d2h_bytes": self.d2h_bytes,
                "fallbacks": sum(self.fallbacks.values()),
                "fallback_reasons": dict(self.fallbacks),
            }


_stats = _Stats()


def device_stats() -> dict[str, Any]:
    """Counters of device work done in this process since start or the last reset.

    Returns
    -------
    dict
        ``tasks`` (tasks that ran on a device), ``h2d_count``/``h2d_bytes`` and
        ``d2h_count``/``d2h_bytes`` (array transfers host->device and device->host),
        ``fallbacks`` (GPU-planned tasks that ran their CPU path after a device error) and
        ``fallback_reasons`` (count by reason). In a distributed cluster each worker process
        has its own counters: read them with ``client.run(eugo_dask.device_stats)``.
    """
    return _stats.snapshot()


def reset_device_stats() -> None:
    """Set every counter of :func:`device_stats` in this process back to zero."""
    _stats.reset()


# ---------------------------------------------------------------------------------------------
# Device interface
# ---------------------------------------------------------------------------------------------
class Device:
    """What the runtime needs from a device: move arrays, recognise them, classify errors."""

    name: str

    def is_device_array(self, value: object) -> bool:
        raise NotImplementedError

    def _to_device(self, array: np.ndarray) -> Any:
        raise NotImplementedError

    def _to_host(self, array: Any) -> np.ndarray:
        raise NotImplementedError

    def is_device_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from the device (out of memory, runtime error)."""
        raise NotImplementedError

    def to_device(self, array: np.ndarray) -> Any:
        """Copy a host array to the device (counted)."""
        out = self._to_device(array)
        _stats.add(h2d_count=1, h2d_bytes=int(array.nbytes))
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to the host (counted)."""
        out = self._to_host(array)
        _stats.add(d2h_count=1, d2h_bytes=int(out.nbytes))
        return out


class CupyDevice(Device):
    """A CUDA device through CuPy."""

    name = "cupy"

    def __init__(self, cupy_module: Any) -> None:
        self.cupy = cupy_module

    def is_device_array(self, value: object) -> bool:
        return isinstance(value, self.cupy.ndarray)

    def _to_device(self, array: np.ndarray) -> Any:
        return self.cupy.asarray(array)

    def _to_host(self, array: Any) -> np.ndarray:
        return self.cupy.asnumpy(array)

    def is_device_error(self, exc: BaseException) -> bool:
        cuda = self.cupy.cuda
        errors: tuple[type[BaseException], ...] = (cuda.memory.OutOfMemoryError,
                                                    cuda.runtime.CUDARuntimeError)
        driver_error = getattr(getattr(cuda, "driver", None), "CUDADriverError", None)
        if driver_error is not None:
            errors += (driver_error,)
        return isinstance(exc, errors)


def import_cupy() -> Any:
    """Import CuPy or raise the error that tells the user how to install it."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError("eugo-dask GPU support needs CuPy: pip install 'eugo-dask[gpu]'") from e
    return cupy


@functools.lru_cache(maxsize=1)
def cupy_device_count() -> int:
    """Number of CUDA devices CuPy can use here (0 without CuPy, a driver or a device; the
    reason is logged once at INFO)."""
    try:
        cupy = import_cupy()
    except ImportError as e:
        logger.info("eugo: no CUDA device: %s", e)
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as e:  # no driver, no device, driver too old
        logger.info("eugo: CuPy is installed but finds no usable CUDA device: %s", e)
        return 0


def cupy_device_name() -> str | None:
    """The name of CUDA device 0, or None where there is none."""
    if not cupy_device_count():
        return None
    cupy = import_cupy()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def resolve_device_name(setting: str) -> str | None:
    """Map an ``eugo.device`` setting to the device that will run GPU tasks, or None.

    ``auto`` is ``cupy`` where CuPy has a working device and None otherwise; ``cupy`` raises
    when CuPy is missing (the user asked for it) and is None without a device.
    """
    if setting == "none":
        return None
    if setting == "emulated":
        return "emulated"
    if setting == "cupy":
        import_cupy()
        return "cupy" if cupy_device_count() else None
    if setting == "auto":
        return "cupy" if cupy_device_count() else None
    raise ValueError(f"eugo.device must be one of {list(DEVICES)}; got {setting!r}")
