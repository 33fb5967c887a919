"""CUDA devices through CuPy (:class:`CupyDevice`), imported lazily the first time they are asked
for. This is the only module of eugo-dask that imports CuPy.

- **copies**: through two pinned staging buffers per worker thread (:class:`_Staging`), reused,
  in chunks (``staging_bytes``), with the copy of one chunk overlapping the host memcpy of the
  next, asynchronous on the task's stream inside a task scope and synchronised outside one.
  Each chunk's host memcpy is split over ``copy_threads`` threads, and a result copied back of
  ``pinned_results_min_bytes`` or more lands, where the pool's cap allows, in a pinned block
  the device copies straight into (:mod:`eugo_dask.devices.copies`); such a block going back
  to the device is one DMA. With ``register_min_bytes`` set, a large contiguous chunk is
  page-locked in place (``cudaHostRegister``) for one DMA and unregistered once it has run.
  Calibration measures this path (:mod:`eugo_dask.measure`), so the profile prices the copies
  that run. Outside a task a copy runs on this thread's own stream, made current for it, so
  what it queues first (a strided view made contiguous) is ordered ahead of it.
- **waits that sleep** (:class:`_BlockingWaits`): every wait for the device is on an event made
  with ``cudaEventBlockingSync``; CUDA's default events and stream synchronisation spin a core.
- **after fork** the child forgets the parent's probe (:func:`_forget_the_probe`) and probes
  again: CUDA initialised by a parent fails in its forked child.
- **honest detection** (:func:`probe_cupy`, :func:`cupy_unusable_reason`): a tiny kernel, a GEMM
  and an FFT once per process before ``auto`` trusts a device, and the reason when it cannot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np

from eugo_dask.devices.accounting import HOST_CACHES
from eugo_dask.devices.base import DeferringLock, Device, DeviceSettings, _MiB
from eugo_dask.devices.copies import CopyChoice, HostCopier, ResultPool, choose_copy
from eugo_dask.devices.errors import (
    CTK_HINT,
    OUT_OF_MEMORY,
    RUNTIME,
    STICKY,
    STICKY_CUDA_STATUSES,
    UNAVAILABLE,
    UNAVAILABLE_CUDA_STATUSES,
    _classify_by_name,
)
from eugo_dask.devices.stats import _stats

logger = logging.getLogger(__name__)


class _Staging:
    """Two pinned host buffers of one thread, reused for every copy it makes."""

    __slots__ = ("memory", "views", "events", "__weakref__")

    def __init__(self, cupy: Any, nbytes: int) -> None:
        pinned = cupy.cuda.pinned_memory
        # portable: usable with every device's context; allocated outside CuPy's pinned pool,
        # which rounds up and never frees
        self.memory = [pinned.PinnedMemoryPointer(
            pinned.PinnedMemory(nbytes, cupy.cuda.runtime.hostAllocPortable), 0) for _ in range(2)]
        self.views = [np.frombuffer(m, np.uint8, nbytes) for m in self.memory]
        self.events: list[Any] = [None, None]

    def wait(self, slot: int) -> None:
        event = self.events[slot]
        if event is not None:
            event.synchronize()
            self.events[slot] = None


def _host_bytes(array: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view (memory order)."""
    return array.reshape(-1, order="F" if array.flags.f_contiguous and not array.flags.c_contiguous
                         else "C").view(np.uint8)


def _forget_staging(device: weakref.ref[CupyDevice], nbytes: int) -> None:
    """A thread's staging buffers are gone: its device (where still alive) forgets their bytes,
    under its staging lock (:class:`DeferringLock`)."""
    alive = device()
    if alive is not None:
        alive._staging_lock.defer(alive._forget_staging, nbytes)


class CupyDevice(Device):
    """CUDA devices through CuPy: the process's current device, or every device it sees where
    ``gpus`` is ``"all"`` and no dask-cuda or RMM set the process up (:attr:`ordinals`)."""

    name = "cupy"
    #: Copies at most this large go straight from/to pageable memory (staging costs more).
    direct_copy_bytes = 1 * _MiB

    def __init__(self, cupy_module: Any, settings: DeviceSettings | None = None, *,
                 count: int | None = None) -> None:
        self.cupy = cupy_module
        settings = settings or DeviceSettings()
        if count is not None:
            self._ordinals = tuple(range(int(count)))
        else:
            self._ordinals = _process_ordinals(cupy_module, settings.gpus, self._pool() is None)
        self._count = len(self._ordinals)
        self._ready: set[int] = set()
        self._ready_lock = threading.Lock()
        self._fft_caches: dict[tuple[int, int], Any] = {}  # (thread ident, ordinal) -> PlanCache
        self._staging_lock = DeferringLock()  # a thread's buffers are forgotten by a finalizer
        self._staging_total = 0
        # never more copy threads than the machine has cores
        most = max([settings.copy_threads] + [rule[2] or 1 for rule in settings.h2d_by_size + settings.d2h_by_size])
        self._copier = HostCopier(min(most, os.cpu_count() or 1), settings.copy_piece_bytes)
        # which results get a block is choose_copy's (per size where the profile says)
        self._results = ResultPool(self._pinned_block, settings.pinned_results_bytes,
                                   min_bytes=0 if "d2h" in settings.per_size and settings.d2h_by_size
                                   else settings.pinned_results_min_bytes)
        HOST_CACHES.add(self._results)  # its free blocks go back first when distributed spills
        super().__init__(settings)  # last: the device is visible to metrics from here on

    @property
    def count(self) -> int:
        return self._count

    @property
    def ordinals(self) -> tuple[int, ...]:
        return self._ordinals

    def is_device_array(self, value: object) -> bool:
        return isinstance(value, self.cupy.ndarray)

    def ordinal_of(self, value: object) -> int | None:
        return int(value.device.id) if isinstance(value, self.cupy.ndarray) else None

    def _default_ordinal(self) -> int:
        # outside a task scope, where code that chose no device runs: CuPy's current device
        # where this process uses it, else its first
        current = int(self.cupy.cuda.runtime.getDevice())
        return current if current in self._ordinals else self._ordinals[0]

    # -- per-process and per-thread set-up ----------------------------------------------------
    def _pool(self) -> Any | None:
        """CuPy's default pool where it is CuPy's allocator (not RMM's, under dask-cuda)."""
        cupy = self.cupy
        pool = cupy.get_default_memory_pool()
        allocator = cupy.cuda.get_allocator()
        return pool if getattr(allocator, "__self__", None) is pool else None

    def _prepare(self, ordinal: int) -> None:
        """Once per device and process: the pool limit."""
        if ordinal in self._ready:
            return
        with self._ready_lock:
            if ordinal in self._ready:
                return
            pool = self._pool()
            if pool is not None and self.settings.memory_fraction is not None:
                with self.cupy.cuda.Device(ordinal):
                    pool.set_limit(fraction=self.settings.memory_fraction)
            self._ready.add(ordinal)

    def _stream(self, ordinal: int) -> Any:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(ordinal)
        if stream is None:
            with self.cupy.cuda.Device(ordinal):
                stream = streams[ordinal] = self.cupy.cuda.Stream(non_blocking=True)
            self._bound_fft_cache(ordinal)
        return stream

    def _bound_fft_cache(self, ordinal: int) -> None:
        """Bound this thread's cuFFT plan cache on ``ordinal`` (CuPy's is per thread and device)."""
        try:
            from cupy.fft.config import get_plan_cache
        except ImportError:  # no cuFFT here: FFT tasks fall back, the probe said why
            return
        with self.cupy.cuda.Device(ordinal):
            cache = get_plan_cache()
            cache.set_size(self.settings.fft_plan_cache_size)
            if self.settings.fft_plan_cache_bytes is not None:
                cache.set_memsize(self.settings.fft_plan_cache_bytes)
        with self._lock:
            # an entry under this thread's ident is a finished thread's (idents are reused):
            # its plans are nobody's now
            old = self._fft_caches.get((threading.get_ident(), ordinal))
            self._fft_caches[(threading.get_ident(), ordinal)] = cache
        if old is not None and old is not cache:
            old.clear()

    def _staging(self) -> _Staging:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = _Staging(self.cupy, self.settings.staging_bytes)
            with self._staging_lock:
                self._staging_total += 2 * self.settings.staging_bytes
            # (the device held weakly: a live thread's buffers must not keep a device the
            # runtime dropped alive, nor with it those buffers)
            weakref.finalize(staging, _forget_staging, weakref.ref(self),
                             2 * self.settings.staging_bytes)
        return staging

    def _pinned_block(self, nbytes: int) -> Any:
        """A block of pinned host memory for a result (:class:`ResultPool`), portable."""
        pinned = self.cupy.cuda.pinned_memory
        return pinned.PinnedMemoryPointer(
            pinned.PinnedMemory(nbytes, self.cupy.cuda.runtime.hostAllocPortable), 0)

    def _host_result(self, shape: tuple[int, ...], dtype: Any, order: Literal["C", "F"],
                     choice: CopyChoice) -> np.ndarray:
        """The host array a copy back lands in: where ``choice`` is a pinned result, a pinned
        block from the result pool (the device copies straight into it) where it has room and
        pinned memory can be had, else a new array."""
        out = None
        if choice.path == "pinned":
            try:
                out = self._results.empty(shape, dtype, order)
            except Exception as exc:  # no pinned memory left: stage into a new array
                if self._classify(exc) != OUT_OF_MEMORY:
                    raise
        return np.empty(shape, dtype=dtype, order=order) if out is None else out

    def _forget_staging(self, nbytes: int) -> None:
        """A dead thread's buffers are gone (under the staging lock, :class:`DeferringLock`)."""
        self._staging_total -= nbytes

    @contextlib.contextmanager
    def _scope(self, ordinal: int):
        cupy = self.cupy
        self._prepare(ordinal)
        with cupy.cuda.Device(ordinal):
            stream = self._stream(ordinal)
            _after_legacy_stream(cupy, stream)
            with stream:
                def synchronise() -> Any:
                    end = stream.record(cupy.cuda.Event(block=True))  # timed, and sleeps
                    end.synchronize()
                    return end

                try:
                    yield stream.record, _elapsed_seconds(cupy), synchronise
                except BaseException:
                    # drain the stream before the fallback reads anything; a sticky error
                    # raised here is classified with the original one
                    with contextlib.suppress(Exception):
                        _BlockingWaits(cupy, stream).synchronize()
                    raise

    @contextlib.contextmanager
    def _copy_stream(self, ordinal: int, in_task: bool) -> Iterator[Any]:
        """The stream a copy runs on: the task's, or outside a task this thread's own, made
        current for the copy (the arrays it allocates and the kernels it runs, such as making
        a strided view contiguous, are queued on it, ahead of the copy, as CuPy's
        ``ndarray.get()`` does inside ``with stream:``) and waited for at the end. Its waits
        sleep (:class:`_BlockingWaits`)."""
        cupy = self.cupy
        if in_task:
            yield _BlockingWaits(cupy, cupy.cuda.get_current_stream())
            return
        self._prepare(ordinal)
        with cupy.cuda.Device(ordinal):
            stream = self._stream(ordinal)
            _after_legacy_stream(cupy, stream)
            with stream:
                waits = _BlockingWaits(cupy, stream)
                yield waits
                waits.synchronize()

    # -- copies -------------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray, ordinal: int, in_task: bool) -> Any:
        cupy = self.cupy
        contiguous = array.flags.c_contiguous or array.flags.f_contiguous
        if not contiguous:
            array = np.ascontiguousarray(array)
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        with self._copy_stream(ordinal, in_task) as stream:
            out = cupy.empty(array.shape, dtype=array.dtype, order=order)
            self._h2d(_host_bytes(array), out.data, stream, register=contiguous)
        return out

    def _copy_choice(self, direction: str, nbytes: int) -> CopyChoice:
        """The path a copy of ``nbytes`` takes (:func:`~eugo_dask.devices.copies.choose_copy`):
        straight where small or staging is off, else per size from the profile or as the
        config says."""
        if nbytes <= self.direct_copy_bytes or self.settings.staging_bytes <= 0:
            return CopyChoice("direct", 1)
        return choose_copy(self.settings, direction, nbytes)

    def _h2d(self, src: np.ndarray, dst: Any, stream: Any, *, register: bool = True) -> None:
        """``src`` to device memory ``dst``: one DMA where it is pinned (a result pool block);
        else as :meth:`_copy_choice` says: straight, page-locked in place (where ``register``:
        contiguous), or through the staging buffers (a strided chunk made contiguous is one:
        its new pages are touched once by the gather, staged from there)."""
        nbytes, chunk = src.size, self.settings.staging_bytes
        choice = self._copy_choice("h2d", nbytes)
        if choice.path == "direct":
            dst.copy_from_host_async(src.ctypes.data, nbytes, stream)
            return
        if self._results.owns(src):  # a pinned result going back: one DMA, no staging
            self._pinned_dma(src, dst, stream)
            return
        if register and choice.path == "registered" and self._h2d_registered(src, dst, stream):
            return
        staging = self._staging()
        threads = self._copier.pieces(min(nbytes, chunk), choice.threads)
        for i, offset in enumerate(range(0, nbytes, chunk)):
            slot, size = i % 2, min(chunk, nbytes - offset)
            staging.wait(slot)  # the previous copy out of this buffer has finished
            self._copier.copy(staging.views[slot][:size], src[offset:offset + size], threads)
            (dst + offset).copy_from_host_async(staging.memory[slot].ptr, size, stream)
            staging.events[slot] = stream.record()
        _stats.add_staged("h2d", threads)

    def _pinned_dma(self, src: np.ndarray, dst: Any, stream: Any) -> None:
        """One DMA from pinned host memory, waited for: the source may be gone (its pages
        unregistered, its pool block serving another result) once this returns. The wait is
        on an event after the copy, on the copy's stream (in a task, the task's: behind what the
        task queued before it)."""
        dst.copy_from_host_async(src.ctypes.data, src.size, stream)
        stream.synchronize()

    def _h2d_registered(self, src: np.ndarray, dst: Any, stream: Any) -> bool:
        """``src`` page-locked in place (``cudaHostRegister``), one DMA, unregistered once the
        copy has finished; False, with nothing copied, where CUDA refuses to register it
        (pages registered already, by another copy of the same chunk or a neighbouring
        view; read-only or special memory; no pinnable memory left): the caller stages."""
        runtime = self.cupy.cuda.runtime
        ptr = int(src.ctypes.data)
        try:
            runtime.hostRegister(ptr, src.size, 0)
        except runtime.CUDARuntimeError as exc:
            if self._classify(exc) == STICKY:
                raise
            _stats.add(h2d_register_refused=1)
            return False
        try:
            self._pinned_dma(src, dst, stream)
        except BaseException:  # the copy's error is the one to tell, not the unregistering's
            with contextlib.suppress(Exception):
                runtime.hostUnregister(ptr)
            raise
        runtime.hostUnregister(ptr)
        _stats.add(h2d_registered=1)
        return True

    def _to_host(self, array: Any) -> np.ndarray:
        cupy = self.cupy
        ordinal = int(array.device.id)
        clock = self.current_task()
        with self._copy_stream(ordinal, clock is not None and clock.ordinal == ordinal) as stream:
            if not (array.flags.c_contiguous or array.flags.f_contiguous):
                array = cupy.ascontiguousarray(array)
            order: Literal["C", "F"] = (
                "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C")
            choice = self._copy_choice("d2h", int(array.nbytes))
            out = self._host_result(array.shape, array.dtype, order, choice)
            self._d2h(array.data, _host_bytes(out), stream, choice)
        return out

    def _d2h(self, src: Any, dst: np.ndarray, stream: Any, choice: CopyChoice) -> None:
        nbytes, chunk = dst.size, self.settings.staging_bytes
        pinned = self._results.owns(dst)
        if choice.path == "direct" or pinned:
            # pageable (small, no staging, or measured best so) or pinned (a pool block): one DMA
            src.copy_to_host_async(dst.ctypes.data, nbytes, stream)
            stream.synchronize()
            _stats.add(d2h_pinned=int(pinned))
            return
        staging = self._staging()
        threads = self._copier.pieces(min(nbytes, chunk), choice.threads)
        offsets = list(range(0, nbytes, chunk))

        def issue(i: int) -> None:
            slot = i % 2
            staging.wait(slot)
            size = min(chunk, nbytes - offsets[i])
            (src + offsets[i]).copy_to_host_async(staging.memory[slot].ptr, size, stream)
            staging.events[slot] = stream.record()

        for i in range(min(2, len(offsets))):
            issue(i)
        for i, offset in enumerate(offsets):
            slot, size = i % 2, min(chunk, nbytes - offset)
            staging.wait(slot)
            self._copier.copy(dst[offset:offset + size], staging.views[slot][:size], threads)
            if i + 2 < len(offsets):
                issue(i + 2)
        _stats.add_staged("d2h", threads)

    def _move(self, array: Any, ordinal: int) -> Any:
        cupy = self.cupy
        clock = self.current_task()
        with self._copy_stream(ordinal, clock is not None and clock.ordinal == ordinal) as stream:
            made = not (array.flags.c_contiguous or array.flags.f_contiguous)
            with cupy.cuda.Device(array.device.id):
                if made:
                    array = cupy.ascontiguousarray(array)
                # the copy follows the work queued on the source device (that kernel included)
                stream.wait_event(cupy.cuda.get_current_stream().record())
            order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
            out = cupy.empty(array.shape, dtype=array.dtype, order=order)
            out.data.copy_from_device_async(array.data, array.nbytes, stream)
            if made:  # the contiguous copy goes back to its stream's pool when this returns
                stream.synchronize()
        return out

    # -- errors -------------------------------------------------------------------------------
    def _classify(self, exc: BaseException) -> str | None:
        cuda = self.cupy.cuda
        if isinstance(exc, cuda.memory.OutOfMemoryError):
            return OUT_OF_MEMORY
        cuda_errors: tuple[type[BaseException], ...] = (cuda.runtime.CUDARuntimeError,)
        driver_error = getattr(getattr(cuda, "driver", None), "CUDADriverError", None)
        if driver_error is not None:
            cuda_errors += (driver_error,)
        if isinstance(exc, cuda_errors):
            status = int(getattr(exc, "status", -1))
            if status == 2:  # cudaErrorMemoryAllocation (pinned or driver memory)
                return OUT_OF_MEMORY
            if status in STICKY_CUDA_STATUSES:
                return STICKY
            if status in UNAVAILABLE_CUDA_STATUSES:
                return UNAVAILABLE
            return RUNTIME
        return _classify_by_name(exc)

    # -- memory -------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, Any]:
        cupy = self.cupy
        pool = self._pool()
        with self._lock:
            caches = dict(self._fft_caches)
        ordinals = []
        for ordinal in self._ordinals:
            entry: dict[str, Any] = {"ordinal": ordinal,
                                     "tasks_in_flight": self._in_flight[ordinal]}
            if ordinal in self._ready and pool is not None:
                with cupy.cuda.Device(ordinal):
                    entry.update(pool_used_bytes=int(pool.used_bytes()),
                                 pool_held_bytes=int(pool.total_bytes()),
                                 pool_limit_bytes=int(pool.get_limit()) or None)
            plans = [c for (_, o), c in caches.items() if o == ordinal]
            entry["fft_plans"] = sum(int(c.get_curr_size()) for c in plans)
            entry["fft_plan_bytes"] = sum(int(c.get_curr_memsize()) for c in plans)
            ordinals.append(entry)
        with self._staging_lock:
            pinned = self._staging_total
        return {"device": self.name, "disabled": self._disabled, "ordinals": ordinals,
                "pinned_bytes": pinned, "pinned_result_bytes": self._results.held_bytes(),
                "pinned_result_free_bytes": self._results.free_bytes(),
                "pinned_pool_free_blocks": int(cupy.get_default_pinned_memory_pool().n_free_blocks()),
                "threads": len({thread for thread, _ in caches}),
                "allocator": "cupy" if pool is not None else "external (RMM or another)"}

    def release_memory(self, *, idle: bool = False) -> int:
        cupy = self.cupy
        alive = {t.ident for t in threading.enumerate()}
        me = threading.get_ident()
        with self._lock:
            caches = dict(self._fft_caches)
        for key, cache in caches.items():
            thread, _ = key
            if thread == me or thread not in alive:  # never a live thread's (not thread-safe)
                cache.clear()
            if thread not in alive:
                with self._lock:
                    self._fft_caches.pop(key, None)
        released = 0
        pool = self._pool()
        if pool is not None:
            for ordinal in sorted(self._ready):
                with cupy.cuda.Device(ordinal):
                    before = int(pool.total_bytes())
                    pool.free_all_blocks()
                    released += before - int(pool.total_bytes())
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        _stats.add(memory_releases=1, released_bytes=released)
        return released

    # -- detection ----------------------------------------------------------------------------
    def probe(self) -> str | None:
        for ordinal in self._ordinals:
            reason = probe_cupy(self.cupy, ordinal)
            if reason is not None:
                return f"CUDA device {ordinal}: {reason}"
        return None


def _process_ordinals(cupy: Any, gpus: str, external_allocator: bool) -> tuple[int, ...]:
    """The CUDA devices a process drives: its current one; with ``gpus`` ``"all"`` every one
    it sees, unless dask-cuda or RMM set the process up for one (:func:`dask_cuda_reason`),
    where the others are its sibling processes' GPUs."""
    current = int(cupy.cuda.runtime.getDevice())
    if gpus != "all":
        return (current,)
    reason = dask_cuda_reason(external_allocator)
    if reason is not None:
        logger.info("eugo: gpus-per-process is 'all' but this process drives one GPU: %s", reason)
        return (current,)
    return tuple(range(int(cupy.cuda.runtime.getDeviceCount())))


def dask_cuda_reason(external_allocator: bool = False) -> str | None:
    """Why this process looks like one of dask-cuda's (one process per GPU), or None: dask-cuda
    is imported, an allocator other than CuPy's own pool is installed (RMM's pool lives on one
    device), or ``CUDA_VISIBLE_DEVICES`` is rotated (dask-cuda lists each process's own GPU
    first: ``2,3,0,1``)."""
    if "dask_cuda" in sys.modules:
        return "dask_cuda is imported (a dask-cuda worker drives one GPU per process)"
    if external_allocator:
        return "CuPy allocates through another allocator (RMM's pool is on one device)"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) > 1 and all(v.isdigit() for v in visible) and visible != sorted(visible, key=int):
        return (f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} is rotated, as "
                f"dask-cuda gives each worker process its own GPU first")
    return None


def _after_legacy_stream(cupy: Any, stream: Any) -> None:
    """Make ``stream`` (non-blocking: it does not wait for the legacy default stream by itself)
    start after the work already queued on the current device's default stream and on this
    thread's current stream, where CuPy code outside eugo's task scopes runs."""
    null = cupy.cuda.Stream.null
    stream.wait_event(null.record())
    current = cupy.cuda.get_current_stream()
    if current.ptr not in (null.ptr, stream.ptr):  # a per-thread default or user stream
        stream.wait_event(current.record())


class _BlockingWaits:
    """A stream as eugo's copies see it: every event recorded on it is created with
    ``cudaEventBlockingSync`` (and without timing), and synchronising it waits for such an
    event, so a thread waiting for the device sleeps instead of spinning a CPU core (CUDA's
    default events and stream synchronisation spin under its default device flags). The copy
    functions take it for the stream (``ptr`` is the stream's)."""

    __slots__ = ("_cupy", "stream", "ptr", "device_id")

    def __init__(self, cupy: Any, stream: Any) -> None:
        self._cupy, self.stream = cupy, stream
        self.ptr, self.device_id = stream.ptr, stream.device_id

    def record(self, event: Any = None) -> Any:
        if event is None:
            event = self._cupy.cuda.Event(block=True, disable_timing=True)
        return self.stream.record(event)

    def synchronize(self) -> None:
        self.record().synchronize()

    def wait_event(self, event: Any) -> None:
        self.stream.wait_event(event)


def _elapsed_seconds(cupy: Any) -> Callable[[Any, Any], float]:
    def elapsed(start: Any, end: Any) -> float:
        return float(cupy.cuda.get_elapsed_time(start, end)) / 1000.0

    return elapsed


def probe_cupy(cupy: Any, ordinal: int = 0) -> str | None:
    """Exercise CUDA device ``ordinal``: compile and run a kernel (NVRTC), a GEMM (cuBLAS) and
    an FFT (cuFFT), check their results; the reason it is unusable, or None."""
    steps = (
        ("a compiled kernel (NVRTC)", lambda a: cupy.ElementwiseKernel(
            "float32 x", "float32 y", "y = 2 * x + 1", "eugo_probe_kernel")(a), lambda h: 2 * h + 1),
        ("a GEMM (cuBLAS)", lambda a: a @ a, lambda h: h @ h),
        ("an FFT (cuFFT)", lambda a: cupy.fft.fft(a).real.astype(np.float32),
         lambda h: np.fft.fft(h).real.astype(np.float32)),
    )
    host = (np.arange(64, dtype=np.float32).reshape(8, 8) % 7) / 7
    try:
        with cupy.cuda.Device(ordinal):
            device = cupy.asarray(host)
            cupy.cuda.get_current_stream().synchronize()
    except Exception as e:
        return f"cannot copy to the device: {type(e).__name__}: {e}"
    for what, run, expect in steps:
        try:
            with cupy.cuda.Device(ordinal):
                result = run(device)
                got = cupy.asnumpy(result)
        except Exception as e:
            hint = f"; {CTK_HINT}" if _classify_by_name(e) == UNAVAILABLE or isinstance(e, ImportError) else ""
            return f"{what} failed: {type(e).__name__}: {e}{hint}"
        if not np.allclose(got, expect(host), rtol=1e-3, atol=1e-3):
            return f"{what} gave a wrong result"
    return None


def import_cupy() -> Any:
    """Import CuPy or raise the error that tells the user how to install it."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError("eugo-dask GPU support needs CuPy: pip install cupy-cuda12x (or, "
                          "from a checkout of eugo-dask, pip install -e '.[gpu]')") from e
    return cupy


@functools.lru_cache(maxsize=1)
def cupy_unusable_reason() -> str | None:
    """Why CuPy cannot run GPU tasks in this process, or None where it can: CuPy imports, finds
    a CUDA device, and device 0 runs a probe kernel, GEMM and FFT (:func:`probe_cupy`). Checked
    once per process; the reason is logged once at INFO."""
    reason: str | None
    try:
        cupy = import_cupy()
    except ImportError as e:
        reason = f"{e}"
    else:
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except cupy.cuda.runtime.CUDARuntimeError as e:  # no driver, no device, driver too old
            reason = f"CuPy is installed but finds no usable CUDA device ({e})"
        else:
            reason = "CuPy finds no CUDA device" if count == 0 else probe_cupy(cupy, 0)
            if reason is not None and count:
                reason = f"CUDA device 0 is not usable: {reason}"
    if reason is not None:
        logger.info("eugo: no CUDA device for GPU tasks: %s", reason)
    return reason


def cupy_probe_passed() -> bool:
    """Whether this process has probed CuPy (:func:`cupy_unusable_reason` ran) and device 0
    passed: its CUDA context is made and a kernel compiled."""
    return cupy_unusable_reason.cache_info().currsize > 0 and cupy_unusable_reason() is None


@functools.lru_cache(maxsize=1)
def cupy_device_count() -> int:
    """Number of CUDA devices CuPy can use here: 0 without CuPy, a driver or a device, and where
    device 0 fails the probe (:func:`cupy_unusable_reason` says why)."""
    if cupy_unusable_reason() is not None:
        return 0
    return int(import_cupy().cuda.runtime.getDeviceCount())


def _forget_the_probe() -> None:
    """In a child process made by ``fork``: the parent's probe says nothing about the child, in
    which CUDA, once initialised by the parent, fails (``cudaErrorInitializationError``). The
    child probes again on first use, and falls back to the CPU where it cannot use a device."""
    cupy_unusable_reason.cache_clear()
    cupy_device_count.cache_clear()


os.register_at_fork(after_in_child=_forget_the_probe)


def cupy_device_name(ordinal: int = 0) -> str | None:
    """The name of CUDA device ``ordinal``, or None where there is none."""
    if not cupy_device_count():
        return None
    cupy = import_cupy()
    name = cupy.cuda.runtime.getDeviceProperties(ordinal)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def cupy_device_memory(ordinal: int = 0) -> int | None:
    """Total memory of CUDA device ``ordinal`` in bytes, or None where there is none."""
    if not cupy_device_count():
        return None
    return int(import_cupy().cuda.runtime.getDeviceProperties(ordinal)["totalGlobalMem"])


#: CUDA device attributes an unknown model is priced from: our name -> (cudaDeviceProp field,
#: cudaDeviceAttr number). CUDA 13 dropped the clock fields from cudaDeviceProp; the attributes
#: remain.
_ATTRIBUTES = {"multiprocessors": ("multiProcessorCount", 16), "clock_khz": ("clockRate", 13),
               "memory_clock_khz": ("memoryClockRate", 36), "memory_bus_bits": ("memoryBusWidth", 37),
               "major": ("major", 75), "minor": ("minor", 76)}


def cupy_device_attributes(ordinal: int = 0) -> dict[str, Any]:
    """The attributes of CUDA device ``ordinal`` that price an unknown model
    (:func:`eugo_dask.profile.gpu_figures_from_attributes`): SMs, clock, memory clock and bus
    width, compute capability; those CUDA does not give are left out (empty without a device)."""
    if not cupy_device_count():
        return {}
    runtime = import_cupy().cuda.runtime
    props = runtime.getDeviceProperties(ordinal)
    found: dict[str, Any] = {}
    for ours, (field, attribute) in _ATTRIBUTES.items():
        value = props.get(field)
        if not value:
            with contextlib.suppress(Exception):
                value = runtime.deviceGetAttribute(attribute, ordinal)
        if value:
            found[ours] = int(value)
    if "major" in found and "minor" in found:
        found["compute_capability"] = (found.pop("major"), found.pop("minor"))
    return found

