"""What runs inside the rewritten tasks.

The rewrite (:mod:`eugo_dask.rewrite`) builds three kinds of tasks from these callables:

- ``to_device(value, device)``: a host->device transfer task (one per host chunk with GPU
  consumers);
- ``DeviceCall(func, device)(...)``: the original chunk function run on device arrays;
- ``to_host(value, device)``: a device->host transfer task, kept under the original key wherever a
  CPU consumer or an output needs NumPy.

Each carries its CPU path. Where the device is not usable in this process (a worker without CuPy
or a GPU) everything passes host arrays through and the original function runs on the CPU. Where
the device fails inside a task (out of memory, CUDA runtime error, a function that refuses device
arrays) the task re-runs its CPU path on host copies of its inputs, the fallback is counted and
logged once per task prefix, and the result is the same.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from dask._task_spec import DataNode, Task
from dask.utils import funcname

from eugo_dask.config import emulated_memory_limit, process_device
from eugo_dask.devices import CupyDevice, Device, _stats, cupy_device_count, import_cupy
from eugo_dask.emulated import EmulatedDevice, set_rebuild_device
from eugo_dask.graph import Fused, fused
from eugo_dask.ops import device_dtype_ok

logger = logging.getLogger(__name__)
_task_logger = logging.getLogger(__name__ + ".tasks")

_state = threading.local()
_logged_prefixes: set[str] = set()

#: Topic of the events GPU tasks send to the scheduler (fallbacks), read by the plugin.
EVENT_TOPIC = "eugo"


# ---------------------------------------------------------------------------------------------
# The devices of this process
# ---------------------------------------------------------------------------------------------
_devices: dict[tuple[str, int], Device] = {}
_devices_lock = threading.Lock()


def get_device(name: str) -> Device | None:
    """The device called ``name`` in this process, or None where it is not usable here.

    Tasks call this at run time: a GPU-planned task on a worker without the device runs its
    CPU path instead.
    """
    if name == "emulated":
        key = (name, emulated_memory_limit())
    elif name == "cupy":
        key = (name, 0)
    else:
        return None
    device = _devices.get(key)
    if device is not None:
        return device
    with _devices_lock:
        if key not in _devices:
            if name == "emulated":
                _devices[key] = EmulatedDevice(key[1])
            elif cupy_device_count():
                _devices[key] = CupyDevice(import_cupy())
            else:
                return None
        return _devices[key]


def _emulated_device() -> EmulatedDevice:
    device = get_device("emulated")
    assert isinstance(device, EmulatedDevice)
    return device


# device arrays unpickled in this process arrive on its emulated device
set_rebuild_device(_emulated_device)


def usable_device(name: str) -> Device | None:
    """The device a task planned for ``name`` may use in this process, or None.

    The process's own ``eugo.device`` decides: a worker set to ``none`` never uses a device; the
    emulated device runs only where ``eugo.device`` is ``emulated`` (a CPU worker does not
    pretend); CuPy runs where ``auto`` or ``cupy`` finds a CUDA device.
    """
    local = process_device()
    if local == "none" or (name == "emulated") != (local == "emulated"):
        return None
    return get_device(name)


_meter = None


def _context_meter():
    """distributed's context meter (Fine Performance Metrics on the dashboard); imported on
    first use so ``import eugo_dask`` stays light."""
    global _meter
    if _meter is None:
        from distributed.metrics import context_meter

        _meter = context_meter
    return _meter


def _metered_copy(label: str, copy: Callable[[Any], Any], value: Any, nbytes: int) -> Any:
    meter = _context_meter()
    with meter.meter(label):
        out = copy(value)
    meter.digest_metric(label, nbytes, "bytes")
    return out


def _report_fallback(prefix: str, reason: str) -> None:
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):  # not inside a distributed worker
        return
    worker.log_event(EVENT_TOPIC, {"fallback": reason, "prefix": prefix})


def _cpu_path_active() -> bool:
    return getattr(_state, "cpu_path", False)


@contextlib.contextmanager
def _cpu_path() -> Iterator[None]:
    previous = _cpu_path_active()
    _state.cpu_path = True
    try:
        yield
    finally:
        _state.cpu_path = previous


def _map_arrays(value: Any, convert: Callable[[Any], Any]) -> Any:
    """Apply ``convert`` to every array in a (possibly nested) task value."""
    if isinstance(value, list):
        return [_map_arrays(v, convert) for v in value]
    if type(value) is tuple:
        return tuple(_map_arrays(v, convert) for v in value)
    if type(value) is dict:
        return {k: _map_arrays(v, convert) for k, v in value.items()}
    return convert(value)


def _host_to_device(device: Device) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if (
            type(value) is np.ndarray
            and value.ndim > 0
            and device_dtype_ok(value.dtype)
            and not device.is_device_array(value)
        ):
            return _metered_copy("eugo-h2d", device.to_device, value, value.nbytes)
        return value

    return convert


def _device_to_host(device: Device) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if device.is_device_array(value):
            return _metered_copy("eugo-d2h", device.to_host, value, value.nbytes)
        return value

    return convert


class ZeroDimensionalResult(TypeError):
    """A device task produced a 0-d array: NumPy would have handed back either a scalar or a
    0-d array, and only the CPU path can say which (the planner keeps 0-d results on the host;
    this guards the rest)."""


def _check_no_0d(value: Any, device: Device) -> None:
    def check(v: Any) -> Any:
        if device.is_device_array(v) and v.ndim == 0:
            raise ZeroDimensionalResult("a 0-d device result; NumPy's type is the CPU path's")
        return v

    _map_arrays(value, check)


def to_device(value: Any, device_name: str) -> Any:
    """Host->device transfer task: every numeric array in ``value`` moves to the device.

    Where the device has no room, the value stays on the host and its consumers run their CPU
    path.
    """
    device = usable_device(device_name)
    if device is None or _cpu_path_active():
        return value
    try:
        return _map_arrays(value, _host_to_device(device))
    except Exception as exc:
        if not device.is_device_error(exc):
            raise
        return value


def to_host(value: Any, device_name: str) -> Any:
    """Device->host transfer task: every device array in ``value`` comes back as NumPy."""
    device = get_device(device_name)  # a device array here must come back, whatever the setting
    if device is None:
        return value
    return _map_arrays(value, _device_to_host(device))


class OnDevice:
    """A source inside a fused GPU task (an embedded chunk, ones/arange...): run it, then move
    its result to the device, so the rest of the fused task runs there."""

    __slots__ = ("func", "device_name")

    def __init__(self, func: Callable[..., Any], device_name: str) -> None:
        self.func = func
        self.device_name = device_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = self.func(*args, **kwargs)
        device = usable_device(self.device_name)
        if device is None or _cpu_path_active():
            return value
        # no room on the device raises here, and the enclosing DeviceCall falls back
        return _map_arrays(value, _host_to_device(device))

    def __reduce__(self):
        return (OnDevice, (self.func, self.device_name))

    def __repr__(self) -> str:
        return f"OnDevice({funcname(self.func)})"


def _identity(value: Any) -> Any:
    return value


def sources_on_device(inner_dsk: dict, is_source: Callable[[Any], bool], device_name: str) -> dict:
    """Rewrite the inner graph of a fused task so its sources land on the device."""
    out: dict[Any, Any] = {}
    for key, node in inner_dsk.items():
        parts = fused(node)
        if isinstance(node, DataNode) and is_source(node):
            out[key] = Task(key, OnDevice(_identity, device_name), DataNode(None, node.value))
        elif parts is not None:
            inner = sources_on_device(parts.inner, is_source, device_name)
            out[key] = Fused(inner, *parts[1:]).task(key)
        elif type(node) is Task and is_source(node):
            out[key] = Task(key, OnDevice(node.func, device_name), *node.args, **node.kwargs)
        else:
            out[key] = node
    return out


class DeviceCall:
    """Run a chunk function on the device, with its CPU path as the fallback.

    ``cpu_only`` (set when the scheduler re-routes the task for want of a GPU worker) runs the
    CPU path whatever device the process has."""

    __slots__ = ("func", "device_name", "prefix", "cpu_only")

    def __init__(self, func: Callable[..., Any], device_name: str, prefix: str,
                 cpu_only: bool = False) -> None:
        self.func = func
        self.device_name = device_name
        self.prefix = prefix
        self.cpu_only = cpu_only

    def __reduce__(self):
        return (DeviceCall, (self.func, self.device_name, self.prefix, self.cpu_only))

    def __repr__(self) -> str:
        return f"DeviceCall({funcname(self.func)}, {self.device_name!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = None if self.cpu_only else usable_device(self.device_name)
        if device is None or _cpu_path_active():
            return self._run_cpu_path(None, args, kwargs)
        try:
            convert = _host_to_device(device)
            args, kwargs = _map_arrays(args, convert), _map_arrays(kwargs, convert)
            with _context_meter().meter("eugo-device-compute"):
                result = self.func(*args, **kwargs)
            _check_no_0d(result, device)
        except Exception as exc:
            return self._fall_back(device, exc, args, kwargs)
        _stats.add(tasks=1)
        return result

    def _fall_back(self, device: Device, exc: Exception, args: tuple, kwargs: dict) -> Any:
        reason = "device error" if device.is_device_error(exc) else "unsupported on device"
        reason = f"{reason}: {type(exc).__name__}"
        _stats.add_fallback(reason)
        _report_fallback(self.prefix, reason)
        if self.prefix not in _logged_prefixes:
            _logged_prefixes.add(self.prefix)
            logger.warning(
                "eugo: %s tasks fell back to the CPU (%s: %s); later fallbacks of this prefix "
                "are logged at DEBUG on %s",
                self.prefix,
                reason,
                exc,
                _task_logger.name,
            )
        else:
            _task_logger.debug("%s fell back to the CPU: %s", self.prefix, reason)
        return self._run_cpu_path(device, args, kwargs)

    def _run_cpu_path(self, device: Device | None, args: tuple, kwargs: dict) -> Any:
        if device is not None:
            convert = _device_to_host(device)
            args, kwargs = _map_arrays(args, convert), _map_arrays(kwargs, convert)
        with _cpu_path():
            return self.func(*args, **kwargs)


def _host_value(value: Any, device_name: str) -> Any:
    """A re-routed host->device copy: the value stays on the host."""
    return value


def cpu_path_task(task: Any) -> Any:
    """``task`` (a GPU task or a copy to the device) rewritten to run its CPU path anywhere."""
    if type(task) is not Task:
        return task
    if isinstance(task.func, DeviceCall):
        func: Callable[..., Any] = DeviceCall(task.func.func, task.func.device_name,
                                              task.func.prefix, cpu_only=True)
    elif task.func is to_device:
        func = _host_value
    else:
        return task
    return Task(task.key, func, *task.args, **task.kwargs)


def is_eugo_callable(func: Any) -> bool:
    """Whether ``func`` is one of the callables this module puts into graphs."""
    return func in (to_device, to_host, _host_value) or isinstance(func, (DeviceCall, OnDevice))


__all__ = ["DeviceCall", "OnDevice", "get_device", "is_eugo_callable", "to_device", "to_host",
           "usable_device"]
