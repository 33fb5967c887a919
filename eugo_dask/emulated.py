"""The emulated device: NumPy-backed device arrays that behave like CuPy where placement
depends on it.

NumPy functions dispatch to :class:`EmulatedDeviceArray` and return device arrays, implicit
conversion to NumPy raises ``TypeError`` as CuPy does, mixing host and device arrays in one call
raises as CuPy does, and allocations beyond a capacity raise :class:`EmulatedOutOfMemoryError`.
It lets CI prove placement and a laptop user dry-run a plan; it proves nothing about speed.

Arrays pickled across processes arrive on the receiving process's emulated device; the runtime
tells this module which one that is (:func:`set_rebuild_device`), since the capacity is a
setting and this module reads no config.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from eugo_dask.devices import Device


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


_rebuild_device: Callable[[], EmulatedDevice] | None = None


def set_rebuild_device(device_for_process: Callable[[], EmulatedDevice]) -> None:
    """Tell this module how to find the process's emulated device (the runtime does, at
    import): arrays unpickled here are rebuilt on it."""
    global _rebuild_device
    _rebuild_device = device_for_process


_receive: Callable[[np.ndarray], Any] | None = None


def set_receive(receive: Callable[[np.ndarray], Any]) -> None:
    """Tell this module what to make of a device array arriving from another process (the
    runtime does, at import): a device array where this process can hold one, else the host
    array it carried."""
    global _receive
    _receive = receive


def _rebuild_emulated(data: np.ndarray) -> Any:
    if _receive is not None:
        return _receive(data)
    if _rebuild_device is None:
        raise RuntimeError("eugo_dask.runtime was not imported: no emulated device to rebuild on")
    return _rebuild_device().wrap(data)


def _empty(*args: Any, **kwargs: Any) -> EmulatedDeviceArray:
    # as cupy.empty: a new array on the device
    if _rebuild_device is None:
        raise RuntimeError("eugo_dask.runtime was not imported: no emulated device")
    return _rebuild_device().wrap(np.empty(*args, **kwargs))


def _einsum(*args: Any, **kwargs: Any) -> Any:
    # as Dask's CuPy registration: CuPy's einsum takes no ``order`` or ``casting``
    kwargs.pop("casting", None)
    kwargs.pop("order", None)
    return np.einsum(*args, **kwargs)


def _register_with_dask() -> None:
    """Register emulated arrays with Dask's dispatches exactly where Dask registers CuPy's
    (``register_cupy`` in ``dask/array/backends.py``), so Dask's chunk functions treat both
    alike. NumPy's functions dispatch to device arrays through ``__array_function__``."""
    from dask.array.backends import _nannumel, _numel_arraylike
    from dask.array.dispatch import (
        concatenate_lookup,
        einsum_lookup,
        empty_lookup,
        nannumel_lookup,
        numel_lookup,
        take_lookup,
        tensordot_lookup,
        to_numpy_dispatch,
    )
    from dask.sizeof import sizeof

    concatenate_lookup.register(EmulatedDeviceArray, np.concatenate)
    take_lookup.register(EmulatedDeviceArray, np.take)
    tensordot_lookup.register(EmulatedDeviceArray, np.tensordot)
    einsum_lookup.register(EmulatedDeviceArray, _einsum)
    empty_lookup.register(EmulatedDeviceArray, _empty)
    numel_lookup.register(EmulatedDeviceArray, _numel_arraylike)
    nannumel_lookup.register(EmulatedDeviceArray, _nannumel)
    to_numpy_dispatch.register(EmulatedDeviceArray, lambda data, **kwargs: data.get())
    sizeof.register(EmulatedDeviceArray, lambda x: int(x.nbytes))


_register_with_dask()
