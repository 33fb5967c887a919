"""Device layer: the only module that knows CuPy.

Two devices implement one small interface (:class:`Device`):

- ``cupy``: a real CUDA device through CuPy, imported lazily the first time it is asked for.
- ``emulated``: NumPy-backed device arrays of their own type (:class:`EmulatedDeviceArray`) that
  behave like CuPy where it matters for placement: NumPy functions dispatch to them and return
  device arrays, implicit conversion to NumPy raises ``TypeError`` as CuPy does, and allocations
  beyond a configurable capacity raise an out-of-memory error. It lets CI prove placement and a
  laptop user dry-run a plan.

Every host<->device transfer and every task run on a device is counted per process; read the
counters with :func:`device_stats` and clear them with :func:`reset_device_stats`.

This module decides nothing: the planner chooses, the rewrite wires tasks, and the functions in
:mod:`eugo_dask.runtime` call :func:`get_device` inside tasks.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import Counter
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cupy", "emulated", "none")

#: dtype kinds a device can hold: bool, ints, unsigned, floats, complex.
DEVICE_DTYPE_KINDS = frozenset("biufc")


def device_dtype_ok(dtype: np.dtype) -> bool:
    """Whether arrays of ``dtype`` can live on a device (no object, string, structured,
    datetime, extended-precision or byte-swapped data)."""
    dtype = np.dtype(dtype)
    # non-native byte order: CuPy would reinterpret the bytes rather than convert them
    return (dtype.kind in DEVICE_DTYPE_KINDS and dtype.isnative and dtype.itemsize <= 16
            and dtype != np.longdouble)


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


class EmulatedOutOfMemoryError(MemoryError):
    """Raised when the emulated device has no room for an allocation (CuPy raises
    ``cupy.cuda.memory.OutOfMemoryError`` in the same place)."""


class EmulatedDevice(Device):
    """A device made of host memory, with a capacity and CuPy's conversion rules."""

    name = "emulated"

    def __init__(self, memory_limit_bytes: int) -> None:
        self.memory_limit_bytes = int(memory_limit_bytes)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def _allocate(self, nbytes: int) -> None:
        with self._lock:
            if self._used + nbytes > self.memory_limit_bytes:
                raise EmulatedOutOfMemoryError(
                    f"Out of memory allocating {nbytes:,} bytes on the emulated device "
                    f"(in use {self._used:,} of {self.memory_limit_bytes:,}; "
                    "raise eugo.emulated.memory-limit)"
                )
            self._used += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def wrap(self, data: np.ndarray) -> EmulatedDeviceArray:
        """Make ``data`` a device array without counting a transfer (results of device work)."""
        nbytes = int(data.nbytes)
        self._allocate(nbytes)
        arr = EmulatedDeviceArray(data, self)
        weakref.finalize(arr, self._release, nbytes)
        return arr

    def is_device_array(self, value: object) -> bool:
        return isinstance(value, EmulatedDeviceArray)

    def _to_device(self, array: np.ndarray) -> EmulatedDeviceArray:
        return self.wrap(np.array(array, copy=True))

    def _to_host(self, array: EmulatedDeviceArray) -> np.ndarray:
        return array.get()

    def is_device_error(self, exc: BaseException) -> bool:
        return isinstance(exc, EmulatedOutOfMemoryError)


def _unwrap(value: Any) -> Any:
    if isinstance(value, EmulatedDeviceArray):
        return value._data
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _reject_host_arrays(values: Any) -> None:
    # CuPy refuses to mix its arrays with NumPy arrays in one call.
    for value in values:
        if isinstance(value, np.ndarray) and value.ndim > 0:
            raise TypeError(
                "Unsupported type <class 'numpy.ndarray'>: the emulated device, like CuPy, "
                "does not mix host and device arrays in one call"
            )
        if isinstance(value, (list, tuple)):
            _reject_host_arrays(value)


class EmulatedDeviceArray(NDArrayOperatorsMixin):
    """A NumPy array that pretends to live on a device.

    NumPy ufuncs and functions dispatch to it (``__array_ufunc__``/``__array_function__``) and
    return device arrays; ``np.asarray(x)`` raises ``TypeError`` as CuPy does; ``x.get()``
    returns the host copy.
    """

    __array_priority__ = 1000

    def __init__(self, data: np.ndarray, device: EmulatedDevice) -> None:
        self._data = data
        self._device = device

    # -- CuPy-like conversion rules -----------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def get(self) -> np.ndarray:
        return np.array(self._data, copy=True)

    def _wrap(self, result: Any) -> Any:
        if isinstance(result, np.ndarray):
            return self._device.wrap(result)
        if isinstance(result, np.generic):  # CuPy returns 0-d device arrays, not scalars
            return self._device.wrap(np.asarray(result))
        if isinstance(result, tuple):
            return tuple(self._wrap(r) for r in result)
        if isinstance(result, list):
            return [self._wrap(r) for r in result]
        return result

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _reject_host_arrays(inputs)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o) for o in out)
            getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
            return out[0] if len(out) == 1 else out
        return self._wrap(getattr(ufunc, method)(*_unwrap(inputs), **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        _reject_host_arrays(args)
        return self._wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    # -- ndarray surface ----------------------------------------------------------------------
    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)
    nbytes = property(lambda self: self._data.nbytes)
    itemsize = property(lambda self: self._data.itemsize)
    strides = property(lambda self: self._data.strides)
    T = property(lambda self: self._wrap(self._data.T))
    real = property(lambda self: self._wrap(self._data.real))
    imag = property(lambda self: self._wrap(self._data.imag))

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self):
        return (self._wrap(x) for x in self._data)

    def __getitem__(self, index):
        return self._wrap(self._data[_unwrap(index)])

    def __setitem__(self, index, value):
        self._data[_unwrap(index)] = _unwrap(value)

    def __getattr__(self, name: str) -> Any:
        # Methods such as .sum(), .reshape(), .astype(): run NumPy's and keep results on device.
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._data, name)
        if callable(attr):

            @functools.wraps(attr)
            def method(*args, **kwargs):
                return self._wrap(attr(*_unwrap(args), **_unwrap(kwargs)))

            return method
        return self._wrap(attr)

    def __bool__(self) -> bool:
        return bool(self._data)

    def __float__(self) -> float:
        return float(self._data)

    def __int__(self) -> int:
        return int(self._data)

    def __index__(self) -> int:
        return self._data.__index__()

    def __repr__(self) -> str:
        return f"EmulatedDeviceArray({self._data!r})"

    def __reduce__(self):
        # Crossing a process boundary, a device array arrives on the same kind of device
        # (as CuPy arrays do over distributed's comms).
        return (_rebuild_emulated, (self._data,))

    def __sizeof__(self) -> int:
        return int(self._data.nbytes) + 64


def _rebuild_emulated(data: np.ndarray) -> EmulatedDeviceArray:
    device = get_device("emulated")
    assert isinstance(device, EmulatedDevice)
    return device.wrap(data)


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
        errors = (cuda.memory.OutOfMemoryError, cuda.runtime.CUDARuntimeError)
        driver_error = getattr(getattr(cuda, "driver", None), "CUDADriverError", None)
        if driver_error is not None:
            errors += (driver_error,)
        return isinstance(exc, errors)


def import_cupy() -> Any:
    """Import CuPy or raise the error that tells the user how to install it."""
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError("eugo-dask GPU support needs CuPy: pip install 'eugo-dask[gpu]'") from e
    return cupy


@functools.lru_cache(maxsize=1)
def cupy_device_count() -> int:
    """Number of CUDA devices CuPy can use here (0 without CuPy, a driver or a device)."""
    try:
        cupy = import_cupy()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, CUDARuntimeError (no driver/device), ...
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


_devices: dict[tuple[str, int], Device] = {}
_devices_lock = threading.Lock()


def get_device(name: str) -> Device | None:
    """The device called ``name`` in this process, or None where it is not usable here.

    Tasks call this at run time: a GPU-planned task on a worker without the device runs its
    CPU path instead.
    """
    import dask

    if name == "emulated":
        from dask.utils import parse_bytes

        limit = parse_bytes(dask.config.get("eugo.emulated.memory-limit", "16 GiB"))
        key = (name, limit)
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


def _register_with_dask() -> None:
    """Register emulated arrays with Dask's dispatches exactly where Dask registers CuPy's
    (``dask/array/backends.py``), so Dask's chunk functions treat both alike."""
    from dask.array.backends import _nannumel, _numel_arraylike
    from dask.array.dispatch import nannumel_lookup, numel_lookup, to_numpy_dispatch
    from dask.sizeof import sizeof

    numel_lookup.register(EmulatedDeviceArray, _numel_arraylike)
    nannumel_lookup.register(EmulatedDeviceArray, _nannumel)
    to_numpy_dispatch.register(EmulatedDeviceArray, lambda data, **kwargs: data.get())
    sizeof.register(EmulatedDeviceArray, lambda x: int(x.nbytes))


_register_with_dask()
