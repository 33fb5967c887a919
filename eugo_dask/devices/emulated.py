"""The emulated device: NumPy-backed device arrays that behave like CuPy where placement
depends on it.

NumPy functions dispatch to :class:`EmulatedDeviceArray` and return device arrays, implicit
conversion to NumPy raises ``TypeError`` as CuPy does, mixing host and device arrays in one call
raises as CuPy does (a 0-d NumPy array in a ufunc other than a comparison too), and so does
mixing arrays of two devices. It lets CI prove placement and a
laptop user dry-run a plan; it proves nothing about speed.

What it emulates of a CUDA process, so the runtime's device mechanisms are testable without
CUDA (:class:`eugo_dask.devices.base.Device` documents them):

- several devices (``count``), each with its own capacity; arrays remember their device and
  results land on their inputs' device;
- CuPy's caching pool: freed blocks stay held until released (:meth:`EmulatedDevice.release_memory`
  or an allocation that would pass the pool limit), a pool limit (``memory_fraction`` of the
  capacity) past which allocations raise :class:`EmulatedOutOfMemoryError`;
- device errors on demand (:meth:`EmulatedDevice.inject_fault`): CuPy's out-of-memory error,
  RMM's plain ``MemoryError``, cuBLAS/NVRTC errors, a missing CUDA library, and sticky CUDA
  errors after which, as on CUDA, every later call on the device raises again; a fault may be
  raised where a kernel is launched or only when the task synchronises, as CUDA reports
  asynchronous faults.

Arrays pickled across processes arrive on the receiving process's emulated device; the runtime
tells this module which one that is (:func:`set_rebuild_device`), since the capacity is a
setting and this module reads no config.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from eugo_dask.devices.accounting import DEVICE_ARRAY_TYPES
from eugo_dask.devices.base import DeferringLock, Device, DeviceSettings
from eugo_dask.devices.errors import (
    COMPILE,
    LIBRARY,
    OUT_OF_MEMORY,
    RUNTIME,
    STICKY,
    STICKY_CUDA_STATUSES,
    UNAVAILABLE,
    _classify_by_name,
)
from eugo_dask.devices.stats import _stats


class EmulatedOutOfMemoryError(MemoryError):
    """Raised when the emulated device has no room for an allocation (CuPy raises
    ``cupy.cuda.memory.OutOfMemoryError`` in the same place)."""


class EmulatedCudaError(RuntimeError):
    """A CUDA runtime error on the emulated device (CuPy: ``CUDARuntimeError``), with its
    CUDA status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EmulatedLibraryError(RuntimeError):
    """A CUDA library's status error (CuPy: ``CUBLASError``, ``CuFFTError``...)."""


class EmulatedCompileError(RuntimeError):
    """A kernel that does not compile (CuPy: ``CompileException``, ``NVRTCError``)."""


#: What :meth:`EmulatedDevice.inject_fault` raises, by kind.
FAULTS: dict[str, Callable[[], BaseException]] = {
    "out-of-memory": lambda: EmulatedOutOfMemoryError("Out of memory allocating 1,048,576 bytes (injected)"),
    "rmm-out-of-memory": lambda: MemoryError(
        "std::bad_alloc: out_of_memory: RMM failure at: arena.hpp:400: Maximum pool size exceeded"),
    "sticky": lambda: EmulatedCudaError(700, "cudaErrorIllegalAddress: an illegal memory access was "
                                             "encountered"),
    "runtime": lambda: EmulatedCudaError(701, "cudaErrorLaunchOutOfResources: too many resources "
                                              "requested for launch"),
    "library": lambda: EmulatedLibraryError("CUBLAS_STATUS_EXECUTION_FAILED"),
    "compile": lambda: EmulatedCompileError("nvrtc: error: identifier \"half2\" is undefined"),
    "unavailable": lambda: ImportError("libcufft.so.11: cannot open shared object file: No such "
                                       "file or directory"),
}
#: Where an injected fault is raised.
FAULT_PLACES = ("compute", "sync", "h2d", "d2h")


class EmulatedDevice(Device):
    """Devices made of host memory, each with a capacity, a caching pool and CuPy's conversion
    rules.

    Parameters
    ----------
    memory_limit_bytes
        Capacity of each emulated device.
    count
        Number of emulated devices in this process.
    settings
        Pool limit (``memory_fraction`` of the capacity; none by default), idle release.
    """

    name = "emulated"

    def __init__(self, memory_limit_bytes: int, *, count: int = 1,
                 settings: DeviceSettings | None = None) -> None:
        if count < 1:
            raise ValueError(f"an emulated device count must be >= 1; got {count!r}")
        self.memory_limit_bytes = int(memory_limit_bytes)
        self._count = int(count)
        self._used = [0] * count
        self._held = [0] * count
        self._peak = [0] * count  # the most bytes in live arrays, since start or reset_peak()
        # arrays are freed by finalizers, which may run inside the pool's locked sections
        self._pool_lock = DeferringLock()
        self._faults: deque[tuple[str, str]] = deque()
        self._lost: BaseException | None = None
        fraction = (settings or DeviceSettings()).memory_fraction
        self.pool_limit_bytes = int(self.memory_limit_bytes * (fraction if fraction is not None else 1.0))
        super().__init__(settings)  # last: the device is visible to metrics from here on

    @property
    def count(self) -> int:
        return self._count

    @property
    def used_bytes(self) -> int:
        """Bytes in live arrays on all emulated devices."""
        with self._pool_lock:
            return sum(self._used)

    def used_bytes_on(self, ordinal: int) -> int:
        with self._pool_lock:
            return self._used[ordinal]

    # -- faults -------------------------------------------------------------------------------
    def inject_fault(self, kind: str, *, where: str = "compute", count: int = 1) -> None:
        """Raise a fault of ``kind`` (:data:`FAULTS`) at the next ``count`` ``where``
        (:data:`FAULT_PLACES`): ``compute`` where a result is made on the device, ``sync`` when
        a task scope synchronises, ``h2d``/``d2h`` in a copy."""
        if kind not in FAULTS:
            raise ValueError(f"fault kind must be one of {sorted(FAULTS)}; got {kind!r}")
        if where not in FAULT_PLACES:
            raise ValueError(f"fault place must be one of {list(FAULT_PLACES)}; got {where!r}")
        for _ in range(count):
            self._faults.append((kind, where))

    def _check(self, where: str) -> None:
        if self._lost is not None:
            raise self._lost  # as CUDA: a sticky error comes back at every later call
        with self._pool_lock:
            fault = next((f for f in self._faults if f[1] == where), None)
            if fault is not None:
                self._faults.remove(fault)
        if fault is not None:
            exc = FAULTS[fault[0]]()
            if fault[0] == "sticky":
                self._lost = exc
            raise exc

    # -- memory -------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, ordinal: int) -> None:
        with self._pool_lock:
            used, held = self._used[ordinal], self._held[ordinal]
            if held >= nbytes:  # a held block is reused
                self._held[ordinal] -= nbytes
            else:
                if used + held + nbytes > self.pool_limit_bytes:  # as CuPy: free held blocks first
                    self._held[ordinal] = held = 0
                if used + held + nbytes > self.pool_limit_bytes:
                    raise EmulatedOutOfMemoryError(
                        f"Out of memory allocating {nbytes:,} bytes on emulated device {ordinal} "
                        f"(in use {used:,} of {self.pool_limit_bytes:,}; raise "
                        "eugo.emulated.memory-limit)"
                    )
            self._used[ordinal] += nbytes
            if self._used[ordinal] > self._peak[ordinal]:
                self._peak[ordinal] = self._used[ordinal]

    def reset_peak(self) -> None:
        """Start the high-water gauge (``array_peak_bytes``) again from the bytes in live
        arrays now."""
        with self._pool_lock:
            self._peak = list(self._used)

    def _release(self, nbytes: int, ordinal: int) -> None:
        """A freed array's block goes back to the pool (under the pool lock: its finalizer
        defers this to the lock's next holder)."""
        self._used[ordinal] -= nbytes
        self._held[ordinal] += nbytes

    def memory_stats(self) -> dict[str, Any]:
        with self._pool_lock:
            ordinals = [{"ordinal": o, "array_bytes": self._used[o],
                         "array_peak_bytes": self._peak[o], "pool_used_bytes": self._used[o],
                         "pool_held_bytes": self._used[o] + self._held[o],
                         "pool_limit_bytes": self.pool_limit_bytes,
                         "capacity_bytes": self.memory_limit_bytes, "fft_plans": 0,
                         "fft_plan_bytes": 0, "tasks_in_flight": self._in_flight[o]}
                        for o in range(self._count)]
        return {"device": self.name, "disabled": self.unusable_reason, "ordinals": ordinals,
                "pinned_bytes": 0, "threads": 0, "allocator": "emulated"}

    def release_memory(self, *, idle: bool = False) -> int:
        with self._pool_lock:
            released = sum(self._held)
            self._held = [0] * self._count
        _stats.add(memory_releases=1, released_bytes=released)
        return released

    # -- arrays -------------------------------------------------------------------------------
    def wrap(self, data: np.ndarray, ordinal: int | None = None) -> EmulatedDeviceArray:
        """Make ``data`` a device array on ``ordinal`` (default: the open task scope's, else 0)
        without counting a transfer (results of device work)."""
        if ordinal is None:
            clock = self.current_task()
            ordinal = clock.ordinal if clock is not None else 0
        nbytes = int(data.nbytes)
        self._allocate(nbytes, ordinal)
        arr = EmulatedDeviceArray(data, self, ordinal)
        weakref.finalize(arr, self._pool_lock.defer, self._release, nbytes, ordinal)
        return arr

    def _result(self, data: np.ndarray, ordinal: int) -> EmulatedDeviceArray:
        self._check("compute")
        return self.wrap(data, ordinal)

    def is_device_array(self, value: object) -> bool:
        return isinstance(value, EmulatedDeviceArray)

    def ordinal_of(self, value: object) -> int | None:
        return value._ordinal if isinstance(value, EmulatedDeviceArray) else None

    def _to_device(self, array: np.ndarray, ordinal: int, in_task: bool) -> EmulatedDeviceArray:
        self._check("h2d")
        return self.wrap(np.array(array, copy=True), ordinal)

    def _to_host(self, array: EmulatedDeviceArray) -> np.ndarray:
        self._check("d2h")
        return array.get()

    def _move(self, array: EmulatedDeviceArray, ordinal: int) -> EmulatedDeviceArray:
        self._check("h2d")
        return self.wrap(np.array(array._data, copy=True), ordinal)

    @contextlib.contextmanager
    def _scope(self, ordinal: int):
        if self._lost is not None:
            raise self._lost

        def synchronise() -> float:
            self._check("sync")
            return time.perf_counter()

        yield time.perf_counter, lambda start, end: end - start, synchronise

    def _classify(self, exc: BaseException) -> str | None:
        if isinstance(exc, EmulatedOutOfMemoryError):
            return OUT_OF_MEMORY
        if isinstance(exc, EmulatedCudaError):
            return STICKY if exc.status in STICKY_CUDA_STATUSES else RUNTIME
        if isinstance(exc, EmulatedLibraryError):
            return LIBRARY
        if isinstance(exc, EmulatedCompileError):
            return COMPILE
        kind = _classify_by_name(exc)
        return kind if kind == UNAVAILABLE else None


def _unwrap(value: Any) -> Any:
    if isinstance(value, EmulatedDeviceArray):
        return value._data
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


#: The ufuncs whose 0-d NumPy arguments CuPy takes by value (``.item()``, numpy/numpy#12142).
_COMPARISONS = frozenset({"greater", "greater_equal", "less", "less_equal", "equal", "not_equal"})


def _reject_host_arrays(values: Any, ufunc: str | None = None) -> None:
    # CuPy refuses to mix its arrays with NumPy arrays in one call, and arrays of two devices
    # (without peer access, which the emulated devices do not have). A ufunc refuses 0-d NumPy
    # arrays too (CuPy's _kernel._preprocess_arg wraps only Python and NumPy scalars), except a
    # comparison, whose __array_ufunc__ takes their value; other functions vary in CuPy and take
    # them here.
    ordinals: set[int] = set()
    refuse_0d = ufunc is not None and ufunc not in _COMPARISONS

    def check(values: Any) -> None:
        for value in values:
            if isinstance(value, EmulatedDeviceArray):
                ordinals.add(value._ordinal)
            elif isinstance(value, np.ndarray) and (value.ndim > 0 or refuse_0d):
                raise TypeError(
                    "Unsupported type <class 'numpy.ndarray'>: the emulated device, like CuPy, "
                    "does not mix host and device arrays in one call"
                    + (" (a 0-d array included)" if value.ndim == 0 else "")
                )
            elif isinstance(value, (list, tuple)):
                check(value)

    check(values)
    if len(ordinals) > 1:
        raise ValueError(
            f"The device where the array resides ({max(ordinals)}) is different from the current "
            f"device ({min(ordinals)}). Peer access is unavailable between these devices."
        )


class EmulatedDeviceArray(NDArrayOperatorsMixin):
    """A NumPy array that pretends to live on a device.

    NumPy ufuncs and functions dispatch to it (``__array_ufunc__``/``__array_function__``) and
    return device arrays; ``np.asarray(x)`` raises ``TypeError`` as CuPy does; ``x.get()``
    returns the host copy.
    """

    __array_priority__ = 1000

    def __init__(self, data: np.ndarray, device: EmulatedDevice, ordinal: int = 0) -> None:
        self._data = data
        self._device = device
        self._ordinal = ordinal

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
            return self._device._result(result, self._ordinal)
        if isinstance(result, np.generic):  # CuPy returns 0-d device arrays, not scalars
            return self._device._result(np.asarray(result), self._ordinal)
        if isinstance(result, tuple):
            return tuple(self._wrap(r) for r in result)
        if isinstance(result, list):
            return [self._wrap(r) for r in result]
        return result

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _reject_host_arrays(inputs, ufunc.__name__)
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

    @property
    def device(self) -> int:
        """The emulated device this array lives on (CuPy: ``x.device.id``)."""
        return self._ordinal

    def __repr__(self) -> str:
        return f"EmulatedDeviceArray({self._data!r}, device={self._ordinal})"

    def __reduce__(self):
        # Crossing a process boundary, a device array arrives on the same kind of device
        # (as CuPy arrays do over distributed's comms: on the receiver's current device).
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
DEVICE_ARRAY_TYPES.add(EmulatedDeviceArray)
