"""A stand-in for the CuPy calls :class:`eugo_dask.devices.CupyDevice` makes, on host memory,
that follows CUDA's ordering rules, so that its copy pipeline and task scopes are tested without
a GPU.

What it keeps of CUDA (and of CuPy on top of it):

- **work is queued, not run**: kernels (elementwise operations, ``ascontiguousarray``),
  device-to-device copies and copies between device memory and *pinned* host memory are queued
  on a stream and run only when something waits for them: the stream is synchronised, an event
  recorded after them is synchronised, or work queued later that must follow them runs (the
  same stream, or a stream made to wait for an event). Whatever reads device memory earlier
  (:meth:`ndarray.peek`, a copy on another stream with no ordering) sees it as it was: a fresh
  block holds NaN bytes (``0xFF``). Copies from and to pageable memory wait for their stream
  and end before the call returns, as CUDA documents for ``cudaMemcpyAsync`` with pageable
  memory.
- **streams**: each device has its own legacy default stream (``Stream.null``, ``ptr`` 0);
  a blocking stream's work follows the legacy stream's earlier work and the legacy stream's
  follows every blocking stream's; a ``non_blocking`` stream has no implicit ordering with
  anything; ``wait_event`` orders two streams. Streams are found by ``ptr`` (a handle), as CUDA
  finds them.
- **current stream per thread and device** (CuPy's rule): ``with stream:`` needs the stream's
  device to be current and makes it that device's current stream on this thread.
- **events** with CuPy's flags (``block``: ``cudaEventBlockingSync``, ``disable_timing``);
  every wait the host makes is logged in :data:`waits` (what kind, and whether it blocks on an
  OS primitive or spins).
- **a caching pool with per-stream free lists** (CuPy's): a block is allocated on the current
  stream of its device and, when freed, is reused only by allocations on that same stream;
  used on another stream without ordering, its memory may be overwritten under the reader.
- **0-d NumPy arguments are refused** by elementwise operations (``TypeError: Unsupported
  type <class 'numpy.ndarray'>``), as CuPy's ``_kernel._preprocess_arg`` refuses them, except
  in comparisons, where CuPy's ``__array_ufunc__`` takes their value (``.item()``).
- **page-locking in place** (``runtime.hostRegister``/``hostUnregister``, CUDA's
  ``cudaHostRegister``): registered host memory is pinned (copies from and to it are queued);
  registering pages already registered or allocated pinned is refused
  (``cudaErrorHostMemoryAlreadyRegistered``, 712), unregistering what is not registered too
  (``cudaErrorHostMemoryNotRegistered``, 713), and :data:`refuse_registration` makes every
  registration fail with a status (as read-only or special memory does). A queued copy that
  runs after its host memory stopped being pinned (unregistered or freed before anything waited
  for it) reads or writes memory CUDA no longer holds: its destination gets NaN bytes and it is
  logged in :data:`unpinned_copies`.
- **fork**: a CUDA call in a child forked after the parent used CUDA fails with
  ``cudaErrorInitializationError`` (3), as CUDA does.
- a pool limit, per-thread cuFFT plan caches, CUDA errors with a status.

Device memory is host memory tagged with a device number.
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import os
import threading
import time
import types
import weakref
from collections import defaultdict

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

_local = threading.local()
_stream_ids = itertools.count(1)
_pinned_ranges: list[tuple[int, int]] = []  # allocated pinned (PinnedMemory)
#: Host memory registered in place: start address -> the pages it locked ([first, end) bytes).
_registered: dict[int, tuple[int, int]] = {}
#: Every registration: (address, bytes).
registrations: list[tuple[int, int]] = []
#: A status every hostRegister fails with (None: registration works).
refuse_registration: list[int | None] = [None]
#: Queued copies that ran after their host memory stopped being pinned: (address, bytes).
unpinned_copies: list[tuple[int, int]] = []
PAGE = 4096
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713  # cudaErrorHostMemory{Already,Not}Registered
_run_lock = threading.RLock()  # queued work runs under it (one order, no lock-order deadlock)
#: Every wait the host made: ("event", blocking flag) or ("stream", False) (a stream
#: synchronisation spins or yields as the device flags say: the default spins).
waits: list[tuple[str, bool]] = []
_COMPARISONS = {"greater", "greater_equal", "less", "less_equal", "equal", "not_equal"}
_init_pid: list[int] = []
INITIALIZATION_ERROR = 3  # cudaErrorInitializationError


def _cuda() -> None:
    """Every CUDA call: the first one initialises CUDA in this process; one in a child forked
    after that fails, as CUDA's do."""
    if not _init_pid:
        _init_pid.append(os.getpid())
    elif _init_pid[0] != os.getpid():
        raise CUDARuntimeError(INITIALIZATION_ERROR)


def _current_device() -> int:
    return getattr(_local, "device", 0)


def _is_pinned(ptr: int, size: int = 1) -> bool:
    """Whether host bytes ``[ptr, ptr + size)`` are pinned: in one pinned allocation or one
    registered range."""
    return any(start <= ptr and ptr + size <= end
               for start, end in [*_pinned_ranges, *_registered.values()])


def host_register(ptr: int, size: int, flags: int) -> None:
    """``cudaHostRegister``: page-lock ``size`` bytes at ``ptr`` in place (whole pages)."""
    _cuda()
    if refuse_registration[0] is not None:
        raise CUDARuntimeError(refuse_registration[0])
    first, end = ptr // PAGE * PAGE, -(-(ptr + size) // PAGE) * PAGE
    with _run_lock:
        if any(a < end and first < b for a, b in [*_pinned_ranges, *_registered.values()]):
            raise CUDARuntimeError(ALREADY_REGISTERED)
        _registered[ptr] = (first, end)
        registrations.append((ptr, size))


def host_unregister(ptr: int) -> None:
    """``cudaHostUnregister``: the pages registered at ``ptr`` are pageable again (no wait
    for copies queued on them)."""
    _cuda()
    with _run_lock:
        if _registered.pop(ptr, None) is None:
            raise CUDARuntimeError(NOT_REGISTERED)


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"cudaError {status}")
        self.status = status


class OutOfMemoryError(MemoryError):
    pass


# ---------------------------------------------------------------------------------------------
# Streams and events
# ---------------------------------------------------------------------------------------------
_legacy: dict[int, Stream] = {}
_blocking: dict[int, weakref.WeakSet] = defaultdict(weakref.WeakSet)  # device -> blocking streams
_by_ptr: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()


class Stream:
    """A queue of work on one device (see the module docstring for its ordering)."""

    null: _LegacyStream

    def __init__(self, non_blocking: bool = False, *, _legacy_of: int | None = None) -> None:
        _cuda()
        self.ptr = 0 if _legacy_of is not None else next(_stream_ids)
        self.device_id = _current_device() if _legacy_of is None else _legacy_of
        self.non_blocking = non_blocking
        self.ops: list = []  # (op, [(stream, upto)...]) queued; None once run
        self.done = 0
        self.synchronized = 0
        if _legacy_of is None:
            _by_ptr[self.ptr] = self
            if not non_blocking:
                _blocking[self.device_id].add(self)

    def _implicit(self) -> list[tuple[Stream, int]]:
        """What work queued now must follow besides this stream's own: CUDA's legacy default
        stream rules (none for a non-blocking stream)."""
        if self.non_blocking:
            return []
        if self.ptr == 0:
            return [(s, len(s.ops)) for s in list(_blocking[self.device_id])]
        legacy = _legacy_stream(self.device_id)
        return [(legacy, len(legacy.ops))]

    def _enqueue(self, op, after: list[tuple[Stream, int]] = ()) -> None:
        with _run_lock:
            self.ops.append((op, [*self._implicit(), *after]))

    def _run(self, upto: int | None = None) -> None:
        with _run_lock:
            upto = len(self.ops) if upto is None else upto
            while self.done < upto:
                op, after = self.ops[self.done]
                for stream, n in after:
                    stream._run(n)
                self.ops[self.done] = None  # drop what it held (blocks go back to the pool)
                self.done += 1
                op()

    def record(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        with _run_lock:
            event.stream, event.upto = self, len(self.ops)
        event.time = time.perf_counter()
        return event

    def synchronize(self) -> None:
        waits.append(("stream", False))
        self._run()
        self.synchronized += 1

    def wait_event(self, event: Event) -> None:
        # work queued on this stream from now on follows the event's work, and only it
        self._enqueue(lambda: None, [(event.stream, event.upto)])

    def __enter__(self) -> Stream:
        if self.device_id != _current_device():
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does "
                               f"not match with the current device ({_current_device()})")
        _stack(self.device_id).append(self)
        _local.__dict__.setdefault("entered", []).append(self.device_id)
        return self

    def __exit__(self, *args) -> None:
        _stack(_local.entered.pop()).pop()


def _legacy_stream(device: int) -> Stream:
    stream = _legacy.get(device)
    if stream is None:
        stream = _legacy[device] = Stream(_legacy_of=device)
    return stream


class _LegacyStream:
    """``Stream.null``: the legacy default stream of the current device (CuPy's ``ptr`` 0)."""

    ptr = 0
    device_id = -1

    def __getattr__(self, name: str):
        return getattr(_legacy_stream(_current_device()), name)

    def __enter__(self):
        _stack(_current_device()).append(self)
        _local.__dict__.setdefault("entered", []).append(_current_device())
        return self

    def __exit__(self, *args) -> None:
        _stack(_local.entered.pop()).pop()


Stream.null = _LegacyStream()


def _resolve(stream) -> Stream:
    """The stream a handle names (CUDA takes handles: any object with a ``ptr``)."""
    if stream is None:
        stream = get_current_stream()
    if stream.ptr == 0:
        return _legacy_stream(_current_device())
    return _by_ptr[stream.ptr]


def _stack(device: int) -> list:
    stacks = _local.__dict__.setdefault("streams", {})
    return stacks.setdefault(device, [])


def get_current_stream(device_id: int = -1):
    stack = _stack(_current_device() if device_id == -1 else device_id)
    return stack[-1] if stack else Stream.null


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        _cuda()
        self.block, self.disable_timing = block, disable_timing
        self.stream: Stream | None = None
        self.upto = 0
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        waits.append(("event", self.block))
        if self.stream is not None:
            self.stream._run(self.upto)
        self.time = max(self.time, time.perf_counter())


def get_elapsed_time(start: Event, end: Event) -> float:
    if start.disable_timing or end.disable_timing:
        raise CUDARuntimeError(600)  # cudaErrorInvalidResourceHandle: an event without timing
    return (end.time - start.time) * 1000.0


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        _cuda()
        _local.__dict__.setdefault("devices", []).append(_current_device())
        _local.device = self.id
        return self

    def __exit__(self, *args) -> None:
        _local.device = _local.devices.pop()


# ---------------------------------------------------------------------------------------------
# Memory: CuPy's pool with a free list per stream
# ---------------------------------------------------------------------------------------------
class _Block:
    """A live allocation: its bytes go back to the pool (on the stream it was allocated on)
    when the last array using it dies."""

    def __init__(self, buffer: np.ndarray, device: int) -> None:
        self.buffer, self.device = buffer, device


class _Pool:
    ROUND = 512

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.limit = 0
        self.used = 0
        self.held = 0
        self.free: dict[tuple[int, int], dict[int, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
        self.allocations = 0  # blocks allocated anew (not reused)

    def malloc(self, nbytes: int, device: int | None = None) -> _Block:
        """A block on ``device`` for the current stream: one this stream freed, else a new one."""
        _cuda()
        device = _current_device() if device is None else device
        size = -(-max(nbytes, 1) // self.ROUND) * self.ROUND
        key = (device, get_current_stream(device).ptr)
        with _run_lock:
            reusable = self.free[key][size]
            if reusable:
                buffer = reusable.pop()
                self.held -= size
            else:
                if self.limit and self.used + self.held + size > self.limit:
                    self.free_all_blocks()  # as CuPy: free the unused blocks and try again
                if self.limit and self.used + size > self.limit:
                    raise OutOfMemoryError(f"Out of memory allocating {nbytes:,} bytes")
                buffer = np.full(size, 0xFF, dtype=np.uint8)  # NaN until written
                self.allocations += 1
            self.used += size
        block = _Block(buffer, device)
        weakref.finalize(block, self._free, buffer, key, size)
        return block

    def _free(self, buffer: np.ndarray, key: tuple[int, int], size: int) -> None:
        with _run_lock:
            self.used -= size
            self.held += size
            self.free[key][size].append(buffer)

    def set_limit(self, size=None, fraction=None) -> None:
        self.limit = int(size if size is not None else fraction * 80e9)

    def get_limit(self) -> int:
        return self.limit

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used + self.held

    def free_all_blocks(self) -> None:
        with _run_lock:
            synchronize_device()  # cudaFree waits for the device
            self.free.clear()
            self.held = 0


pool = _Pool()


def _pinned_copy(dst: int, src: int, size: int, host: int, memory: np.ndarray) -> None:
    """A queued copy between device and pinned host memory, as it runs: where the host memory
    is no longer pinned, the DMA's bytes are undefined: logged, and a copy to the device leaves
    NaN bytes (one to the host writes nothing: its memory may be freed)."""
    if _is_pinned(host, size):
        ctypes.memmove(dst, src, size)
        return
    unpinned_copies.append((host, size))
    if dst != host:
        ctypes.memset(dst, 0xFF, size)


class MemoryPointer:
    def __init__(self, block: _Block, offset: int = 0) -> None:
        self.block, self.offset = block, offset
        self.device_id = block.device
        self.ptr = block.buffer.ctypes.data + offset

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.block, self.offset + offset)

    def _copy(self, dst: int, src: int, size: int, stream, host: int) -> None:
        _cuda()
        stream = _resolve(stream)
        memory = self.block.buffer  # the queued copy holds the memory, not the block (as CUDA)
        if _is_pinned(host, size):
            stream._enqueue(lambda: _pinned_copy(dst, src, size, host, memory))  # runs when waited for
        else:
            stream._run()  # pageable memory: the copy waits for the stream and ends on return
            ctypes.memmove(dst, src, size)

    def copy_from_host_async(self, src: int, size: int, stream=None) -> None:
        self._copy(self.ptr, int(src), size, stream, int(src))

    def copy_to_host_async(self, dst: int, size: int, stream=None) -> None:
        self._copy(int(dst), self.ptr, size, stream, int(dst))

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream=None) -> None:
        dst, memory = self.ptr, (self.block.buffer, src.block.buffer)
        source = src.ptr
        _resolve(stream)._enqueue(lambda: ctypes.memmove(dst, source, size) and memory)


# ---------------------------------------------------------------------------------------------
# Arrays and kernels
# ---------------------------------------------------------------------------------------------
class _Flags:
    def __init__(self, array: np.ndarray) -> None:
        self.c_contiguous = array.flags.c_contiguous
        self.f_contiguous = array.flags.f_contiguous


class ndarray(NDArrayOperatorsMixin):
    """A device array: a view (shape, strides, offset) of a pool block."""

    def __init__(self, shape, dtype, order="C", *, _block: _Block | None = None, _offset: int = 0,
                 _strides=None) -> None:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if _block is None:
            _block = pool.malloc(int(np.prod(shape)) * dtype.itemsize)
            _strides = np.empty(shape, dtype, order=order).strides if shape else ()
        self._block, self._offset = _block, _offset
        self.device = Device(_block.device)
        self._view = np.ndarray(shape, dtype, buffer=_block.buffer, offset=_offset, strides=_strides)
        self.shape, self.dtype, self.ndim = self._view.shape, self._view.dtype, self._view.ndim
        self.size, self.nbytes, self.strides = self._view.size, self._view.nbytes, self._view.strides
        self.flags = _Flags(self._view)
        self.data = MemoryPointer(_block, _offset)

    def peek(self) -> np.ndarray:
        """The device memory as it is now (for tests: work not yet run is not in it)."""
        return self._view

    def _view_of(self, view: np.ndarray) -> ndarray:
        """A view of this array's block (no kernel), as NumPy made it of the host view."""
        offset = view.__array_interface__["data"][0] - self._block.buffer.ctypes.data
        return ndarray(view.shape, view.dtype, _block=self._block, _offset=offset, _strides=view.strides)

    def __getitem__(self, index) -> ndarray:
        index = index if isinstance(index, tuple) else (index,)
        return self._view_of(self._view[(*index, Ellipsis)])  # 0-d arrays, never scalars

    def transpose(self, *axes) -> ndarray:
        return self._view_of(self._view.transpose(*axes))

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs:
            return NotImplemented
        args = []
        for x in inputs:
            if isinstance(x, np.ndarray):
                if ufunc.__name__ in _COMPARISONS and x.ndim == 0:
                    x = x.item()  # CuPy's __array_ufunc__ (numpy/numpy#12142)
                else:
                    raise TypeError(f"Unsupported type {type(x)}")  # _kernel._preprocess_arg
            elif isinstance(x, ndarray) and x.device.id != _current_device():
                raise ValueError(f"The device where the array resides ({x.device.id}) is different "
                                 f"from the current device ({_current_device()}). Peer access is "
                                 f"unavailable between these devices.")
            args.append(x)
        dtype = ufunc(*[np.empty(0, x.dtype) if isinstance(x, ndarray) else x for x in args]).dtype
        out = ndarray(np.broadcast_shapes(*[x.shape for x in args if isinstance(x, ndarray)]), dtype)

        # the kernel holds memory, not the arrays: they may go back to the pool meanwhile
        target, operands = out.peek(), [a.peek() if isinstance(a, ndarray) else a for a in args]
        _resolve(None)._enqueue(lambda: operator.setitem(target, Ellipsis, ufunc(*operands)))
        return out


def empty(shape, dtype=np.float64, order="C") -> ndarray:
    return ndarray(shape, dtype, order)


def ascontiguousarray(a: ndarray) -> ndarray:
    """``a`` itself where it is C-contiguous, else a copy made by a kernel on the current
    stream (queued: it runs when something waits for it)."""
    if a.flags.c_contiguous:
        return a
    out = ndarray(a.shape, a.dtype)
    target, source = out.peek(), a.peek()
    _resolve(None)._enqueue(lambda: operator.setitem(target, Ellipsis, source))
    return out


class _PinnedPool:
    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        pass


class PinnedMemory:
    """``cudaHostAlloc``: whole pages of its own (no other allocation shares one)."""

    def __init__(self, size: int, flags: int = 0) -> None:
        pages = -(-max(size, 1) // PAGE) * PAGE
        whole = np.zeros(pages + PAGE, dtype=np.uint8)
        start = -whole.ctypes.data % PAGE
        self.buffer = whole[start:start + size]
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
        self.owner = threading.get_ident()
        self.cleared_by: list[int] = []

    def set_size(self, size: int) -> None:
        self.size = size

    def set_memsize(self, memsize: int) -> None:
        self.memsize = memsize

    def get_curr_size(self) -> int:
        return self.plans

    def get_curr_memsize(self) -> int:
        return self.plans * 1024

    def clear(self) -> None:
        self.cleared_by.append(threading.get_ident())
        self.plans = 0


def get_plan_cache() -> PlanCache:
    caches = _local.__dict__.setdefault("plan_caches", {})
    return caches.setdefault(_current_device(), PlanCache())


def _get_device_count(count: int) -> int:
    _cuda()
    return count


def _get_device() -> int:
    _cuda()
    return _current_device()


def synchronize_device() -> None:
    """Run every stream's queued work (``cudaDeviceSynchronize``, and what ``cudaFree`` does)."""
    with _run_lock:
        for stream in [*_legacy.values(), *_by_ptr.values()]:
            stream._run()


def reset() -> None:
    """A fresh pool and wait log (between tests)."""
    synchronize_device()
    pool.reset()
    waits.clear()
    _registered.clear()
    registrations.clear()
    unpinned_copies.clear()
    refuse_registration[0] = None


def module(device_count: int = 1) -> types.SimpleNamespace:
    """The fake ``cupy`` module object CupyDevice is given, and the ``cupy.fft.config`` module
    its plan-cache bound imports (put it in ``sys.modules``)."""
    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, hostAllocPortable=1, eventBlockingSync=1,
        eventDisableTiming=2, getDeviceCount=lambda: _get_device_count(device_count),
        getDevice=_get_device, hostRegister=host_register, hostUnregister=host_unregister)
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
