"""Counters of device work: every transfer, task and error is counted per process.

:func:`device_stats` reads them, :func:`reset_device_stats` sets them back to zero, and
:func:`device_memory_stats` gives the memory of every device built in this process. In a
distributed cluster each worker process has its own: ``client.run(eugo_dask.device_stats)``.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Protocol


class _Stats:
    _FIELDS = ("tasks", "h2d_count", "h2d_bytes", "d2h_count", "d2h_bytes", "d2d_count",
               "d2d_bytes", "device_seconds", "launch_seconds", "memory_releases",
               "released_bytes", "h2d_registered", "h2d_register_refused", "d2h_pinned",
               "pinned_released_bytes", "h2d_staged", "d2h_staged")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            for name in self._FIELDS:
                setattr(self, name, 0)
            self.fallbacks: Counter[str] = Counter()
            self.errors: Counter[str] = Counter()
            self.disabled: dict[str, str] = {}
            self.staged_threads: Counter[int] = Counter()

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def add_staged(self, direction: str, threads: int) -> None:
        """A copy through the staging buffers (``direction``: h2d or d2h), its host memcpy
        split over ``threads`` threads."""
        with self._lock:
            setattr(self, f"{direction}_staged", getattr(self, f"{direction}_staged") + 1)
            self.staged_threads[threads] += 1

    def add_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def add_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {name: getattr(self, name) for name in self._FIELDS}
            out.update(fallbacks=sum(self.fallbacks.values()), fallback_reasons=dict(self.fallbacks),
                       device_errors=dict(self.errors), disabled=dict(self.disabled),
                       staged_threads=dict(self.staged_threads))
            return out


_stats = _Stats()


def device_stats() -> dict[str, Any]:
    """Counters of device work done in this process since start or the last reset.

    Returns
    -------
    dict
        ``tasks`` (tasks that ran on a device), ``h2d_count``/``h2d_bytes``,
        ``d2h_count``/``d2h_bytes`` and ``d2d_count``/``d2d_bytes`` (array copies host->device,
        device->host and between devices), ``h2d_registered`` (copies to the device from host
        chunks page-locked in place) and ``h2d_register_refused`` (registrations CUDA refused:
        those copies were staged), ``d2h_pinned`` (results copied back straight into pinned
        blocks of the result pool), ``h2d_staged``/``d2h_staged`` (copies through the pinned
        staging buffers) and ``staged_threads`` (those copies by the threads their host memcpy
        was split over), ``pinned_released_bytes`` (free pinned result blocks given
        back to the host while distributed spilled), ``device_seconds`` (synchronised device time of
        task scopes) and ``launch_seconds`` (their host time until the last launch),
        ``fallbacks`` (GPU-planned tasks that ran their CPU path) and ``fallback_reasons``,
        ``device_errors`` (count by kind, :data:`~eugo_dask.devices.errors.ERROR_KINDS`), ``disabled`` (device name ->
        why it is off in this process), ``memory_releases``/``released_bytes``. In a
        distributed cluster each worker process has its own counters: read them with
        ``client.run(eugo_dask.device_stats)``.
    """
    return _stats.snapshot()


def reset_device_stats() -> None:
    """Set every counter of :func:`device_stats` in this process back to zero."""
    _stats.reset()


class _ReportsMemory(Protocol):
    def memory_stats(self) -> dict[str, Any]: ...


#: Every device built in this process (:class:`~eugo_dask.devices.base.Device` adds itself).
_live_devices: weakref.WeakSet[_ReportsMemory] = weakref.WeakSet()


def device_memory_stats() -> list[dict[str, Any]]:
    """:meth:`~eugo_dask.devices.base.Device.memory_stats` of every device built in this process."""
    return [device.memory_stats() for device in list(_live_devices)]
