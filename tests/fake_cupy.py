"""A stand-in for the few CuPy calls :class:`eugo_dask.devices.CupyDevice` makes, on host memory,
with CUDA's ordering rules, so that its copy pipeline is tested without a GPU.

What it keeps of CUDA: asynchronous copies between device memory and *pinned* host memory run
only when their stream is synchronised (or an event recorded after them is waited for), so a
staging buffer reused too early, or a result read before its copy ran, shows up as wrong data;
copies from and to pageable memory finish before the call returns, as CUDA documents for
``cudaMemcpyAsync`` with pageable memory; streams, events, a current device and stream per
thread, a pool with a limit, and per-thread cuFFT plan caches. Device memory is host memory
tagged with a device number. Nothing here runs a kernel.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import types

import numpy as np

_local = threading.local()
_stream_ids = itertools.count(1)
_pinned_ranges: list[tuple[int, int]] = []


def _current_device() -> int:
    return getattr(_local, "device", 0)


def _is_pinned(ptr: int) -> bool:
    return any(start <= ptr < end for start, end in _pinned_ranges)


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"cudaError {status}")
        self.status = status


class OutOfMemoryError(MemoryError):
    pass


class Event:
    def __init__(self, stream: Stream, upto: int) -> None:
        self.stream, self.upto, self.time = stream, upto, time.perf_counter()

    def synchronize(self) -> None:
        self.stream._run(self.upto)
        self.time = max(self.time, time.perf_counter())


class Stream:
    null: Stream

    def __init__(self, non_blocking: bool = False, *, ptr: int | None = None) -> None:
        self.ptr = next(_stream_ids) if ptr is None else ptr
        self.device_id = _current_device()
        self.pending: list = []
        self.done = 0
        self.synchronized = 0
        self.lock = threading.Lock()

    def _enqueue(self, op) -> None:
        with self.lock:
            self.pending.append(op)

    def _run(self, upto: int | None = None) -> None:
        with self.lock:
            upto = len(self.pending) if upto is None else upto
            while self.done < upto:
                self.pending[self.done]()
                self.done += 1

    def record(self) -> Event:
        with self.lock:
            return Event(self, len(self.pending))

    def synchronize(self) -> None:
        self._run()
        self.synchronized += 1

    def wait_event(self, event: Event) -> None:
        event.synchronize()  # simplification: the dependency runs now

    def __enter__(self) -> Stream:
        stack = _local.__dict__.setdefault("streams", [])
        stack.append(self)
        return self

    def __exit__(self, *args) -> None:
        _local.streams.pop()


Stream.null = Stream(ptr=0)


def get_current_stream() -> Stream:
    stack = getattr(_local, "streams", None)
    return stack[-1] if stack else Stream.null


def get_elapsed_time(start: Event, end: Event) -> float:
    return (end.time - start.time) * 1000.0


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        _local.__dict__.setdefault("devices", []).append(_current_device())
        _local.device = self.id
        return self

    def __exit__(self, *args) -> None:
        _local.device = _local.devices.pop()


class MemoryPointer:
    def __init__(self, buffer: np.ndarray, device_id: int, offset: int = 0) -> None:
        self.buffer, self.device_id, self.offset = buffer, device_id, offset
        self.ptr = buffer.ctypes.data + offset

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.buffer, self.device_id, self.offset + offset)

    def _copy(self, dst: int, src: int, size: int, stream: Stream | None, host: int) -> None:
        stream = stream or get_current_stream()
        op = lambda: ctypes.memmove(dst, src, size)
        if _is_pinned(host):
            stream._enqueue(op)  # runs when the stream is synchronised
        else:
            stream._run()  # pageable memory: the copy waits for the stream and ends on return
            op()

    def copy_from_host_async(self, src: int, size: int, stream: Stream | None = None) -> None:
        self._copy(self.ptr, int(src), size, stream, int(src))

    def copy_to_host_async(self, dst: int, size: int, stream: Stream | None = None) -> None:
        self._copy(int(dst), self.ptr, size, stream, int(dst))

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream: Stream | None = None) -> None:
        (stream or get_current_stream())._enqueue(lambda: ctypes.memmove(self.ptr, src.ptr, size))


class _Flags:
    def __init__(self, array: np.ndarray) -> None:
        self.c_contiguous = array.flags.c_contiguous
        self.f_contiguous = array.flags.f_contiguous


class ndarray:
    def __init__(self, shape, dtype, order="C", device_id: int | None = None) -> None:
        self.device = Device(_current_device() if device_id is None else device_id)
        self._host = np.empty(shape, dtype=dtype, order=order)  # the device memory
        pool.allocate(self._host.nbytes)
        self.shape, self.dtype, self.nbytes = self._host.shape, self._host.dtype, self._host.nbytes
        self.flags = _Flags(self._host)
        raw = self._host.ravel(order="K").view(np.uint8)  # a view: the array is contiguous
        self.data = MemoryPointer(raw, self.device.id)

    def peek(self) -> np.ndarray:
        """The device memory as it is now (for tests; copies not yet run are not in it)."""
        return self._host


def empty(shape, dtype=np.float64, order="C") -> ndarray:
    return ndarray(shape, dtype, order)


def ascontiguousarray(a: ndarray) -> ndarray:
    out = ndarray(a.shape, a.dtype)
    out._host[...] = a._host
    return out


class _Pool:
    def __init__(self) -> None:
        self.limit = 0
        self.used = 0

    def allocate(self, nbytes: int) -> None:
        if self.limit and self.used + nbytes > self.limit:
            raise OutOfMemoryError(f"Out of memory allocating {nbytes:,} bytes")
        self.used += nbytes

    def malloc(self, nbytes: int) -> None:  # the allocator eugo compares with
        self.allocate(nbytes)

    def set_limit(self, size=None, fraction=None) -> None:
        self.limit = int(size if size is not None else fraction * 80e9)

    def get_limit(self) -> int:
        return self.limit

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used

    def free_all_blocks(self) -> None:
        pass


pool = _Pool()


class _PinnedPool:
    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        pass


class PinnedMemory:
    def __init__(self, size: int, flags: int = 0) -> None:
        self.buffer = np.zeros(size, dtype=np.uint8)
        self.ptr = self.buffer.ctypes.data
        self.size = size
        _pinned_ranges.append((self.ptr, self.ptr + size))

    def __del__(self) -> None:  # its address may serve pageable memory next
        _pinned_ranges.remove((self.ptr, self.ptr + self.size))


class PinnedMemoryPointer(np.ndarray):
    """A pinned buffer that is its own (buffer-protocol) view, as CuPy's pointer is."""

    def __new__(cls, mem: PinnedMemory, offset: int):
        view = mem.buffer[offset:].view(cls)
        view.mem = mem
        view.ptr = mem.ptr + offset
        return view


class PlanCache:
    def __init__(self) -> None:
        self.size, self.memsize, self.plans = 16, -1, 0

    def set_size(self, size: int) -> None:
        self.size = size

    def set_memsize(self, memsize: int) -> None:
        self.memsize = memsize

    def get_curr_size(self) -> int:
        return self.plans

    def get_curr_memsize(self) -> int:
        return self.plans * 1024

    def clear(self) -> None:
        self.plans = 0


def get_plan_cache() -> PlanCache:
    caches = _local.__dict__.setdefault("plan_caches", {})
    return caches.setdefault(_current_device(), PlanCache())


def module(device_count: int = 1) -> types.SimpleNamespace:
    """The fake ``cupy`` module object CupyDevice is given, and the ``cupy.fft.config`` module
    its plan-cache bound imports (put it in ``sys.modules``)."""
    runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError, hostAllocPortable=1,
                                    getDeviceCount=lambda: device_count, getDevice=_current_device)
    cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
        get_elapsed_time=get_elapsed_time, runtime=runtime,
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        pinned_memory=types.SimpleNamespace(PinnedMemory=PinnedMemory, PinnedMemoryPointer=PinnedMemoryPointer),
        get_allocator=lambda: pool.malloc)
    fft_config = types.SimpleNamespace(get_plan_cache=get_plan_cache)
    return types.SimpleNamespace(
        ndarray=ndarray, empty=empty, ascontiguousarray=ascontiguousarray, cuda=cuda,
        get_default_memory_pool=lambda: pool, get_default_pinned_memory_pool=_PinnedPool,
        fft=types.SimpleNamespace(config=fft_config))
