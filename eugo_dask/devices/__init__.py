"""Devices: the interface the runtime calls, the counters, and the devices that implement it.

Two devices implement one interface (:class:`~eugo_dask.devices.base.Device`):

- ``cupy`` (:class:`~eugo_dask.devices.cuda.CupyDevice`): real CUDA devices through CuPy,
  imported lazily the first time they are asked for.
- ``emulated`` (:class:`~eugo_dask.devices.emulated.EmulatedDevice`): NumPy-backed device arrays
  of their own type that behave like CuPy where placement depends on it, on one or several
  emulated devices.

The family, one concern a module (each imports only modules listed before it):

- :mod:`~eugo_dask.devices.errors`: the kinds of device error (:data:`ERROR_KINDS`), the CUDA
  statuses and library names that say which kind.
- :mod:`~eugo_dask.devices.stats`: counters of device work per process (:func:`device_stats`,
  :func:`reset_device_stats`, :func:`device_memory_stats`).
- :mod:`~eugo_dask.devices.clock`: the task clock (:class:`TaskClock`), a task's device time.
- :mod:`~eugo_dask.devices.metrics`: the process's ``/metrics`` (``eugo_device_*``).
- :mod:`~eugo_dask.devices.base`: the device interface (:class:`Device`), its settings
  (:class:`DeviceSettings`), :class:`DeviceDisabled`, :func:`map_arrays`, :class:`DeferringLock`.
- :mod:`~eugo_dask.devices.accounting`: device bytes kept apart from host memory
  (:func:`device_nbytes`, :func:`install_device_accounting`).
- :mod:`~eugo_dask.devices.copies`: the copy engine's host half (host memcpy split over
  threads, result arrays from a bounded pool of pinned blocks) and the choice of a copy's path
  by its size (:func:`choose_copy`, what calibration measures: :func:`copy_candidates`), free
  of CuPy.
- :mod:`~eugo_dask.devices.cuda`: the CuPy device, its staging buffers and the CuPy probe; the
  only module of eugo-dask that imports CuPy.
- :mod:`~eugo_dask.devices.emulated`: the emulated device.
- :mod:`~eugo_dask.devices.resolve`: ``eugo.device`` resolved to the device of this process.

This package decides no placement and reads no config: :mod:`eugo_dask.config` turns settings
into a :class:`DeviceSettings`, the planner chooses, the rewrite wires tasks and
:mod:`eugo_dask.runtime` calls the devices' methods inside tasks. What the rest of eugo-dask uses
of the family is importable from ``eugo_dask.devices`` itself (``__all__``); the emulated
device's names from its module.
"""

from eugo_dask.devices.accounting import DEVICE_ARRAY_TYPES, device_nbytes, install_device_accounting
from eugo_dask.devices.base import CopyRule, DeferringLock, Device, DeviceDisabled, DeviceSettings, map_arrays
from eugo_dask.devices.clock import TaskClock
from eugo_dask.devices.copies import CopyChoice, choose_copy, copy_candidates
from eugo_dask.devices.cuda import (
    CupyDevice,
    cupy_device_attributes,
    cupy_device_count,
    cupy_device_memory,
    cupy_device_name,
    cupy_probe_passed,
    cupy_unusable_reason,
    import_cupy,
    probe_cupy,
)
from eugo_dask.devices.errors import (
    COMPILE,
    ERROR_KINDS,
    FATAL_KINDS,
    LIBRARY,
    OUT_OF_MEMORY,
    RUNTIME,
    STICKY,
    UNAVAILABLE,
)
from eugo_dask.devices.metrics import DeviceMetricsCollector
from eugo_dask.devices.resolve import DEVICES, resolve_device_name
from eugo_dask.devices.stats import device_memory_stats, device_stats, reset_device_stats

__all__ = [
    "COMPILE",
    "DEVICES",
    "DEVICE_ARRAY_TYPES",
    "ERROR_KINDS",
    "FATAL_KINDS",
    "LIBRARY",
    "OUT_OF_MEMORY",
    "RUNTIME",
    "STICKY",
    "UNAVAILABLE",
    "CopyChoice",
    "CopyRule",
    "CupyDevice",
    "DeferringLock",
    "Device",
    "DeviceDisabled",
    "DeviceMetricsCollector",
    "DeviceSettings",
    "TaskClock",
    "choose_copy",
    "copy_candidates",
    "cupy_device_attributes",
    "cupy_device_count",
    "cupy_device_memory",
    "cupy_device_name",
    "cupy_probe_passed",
    "cupy_unusable_reason",
    "device_memory_stats",
    "device_nbytes",
    "device_stats",
    "import_cupy",
    "install_device_accounting",
    "map_arrays",
    "probe_cupy",
    "reset_device_stats",
    "resolve_device_name",
]
