"""Devices: the interface the runtime calls, the counters, and the CuPy device.

Two devices implement one interface (:class:`Device`):

- ``cupy`` (:class:`CupyDevice`, here): real CUDA devices through CuPy, imported lazily the first
  time they are asked for. This is the only module that imports CuPy.
- ``emulated`` (:mod:`eugo_dask.emulated`): NumPy-backed device arrays of their own type that
  behave like CuPy where placement depends on it, on one or several emulated devices.

What a device does for the runtime (each point is one method; the runtime decides when):

- **which device a task runs on** (:meth:`Device.select`): the one holding most of the task's
  device-resident input bytes, so a chain's data stays where it is; otherwise the least busy one,
  each worker thread preferring a device of its own. A process sees every GPU it is given
  (``--resources GPU=4``, four visible GPUs); dask-cuda's one process per GPU sees one.
- **a task's time on the device** (:meth:`Device.task`): a scope that makes the task's device
  and its thread's own stream current, and at its end synchronises that stream, so the scope's
  host time is the work's time and a kernel fault surfaces inside the task (where the runtime can
  fall back), not in a later copy. :class:`TaskClock` holds the device-side seconds between the
  marks the runtime sets (CUDA events on CuPy).
- **copies** (:meth:`Device.to_device`, :meth:`Device.to_host`, :meth:`Device.move`): on CuPy
  through two pinned staging buffers per worker thread, reused, in chunks (``staging_bytes``),
  with the copy of one chunk overlapping the host memcpy of the next, asynchronous on the task's
  stream inside a task scope and synchronised outside one. Calibration measures this path
  (:mod:`eugo_dask.measure`), so the profile prices the copies that run.
- **bounded memory**: a pool limit per device (``memory_fraction`` of its memory), cuFFT plan
  caches bounded in plans and bytes, pools and caches released after ``idle_release_s`` without
  tasks and on out-of-memory (:meth:`Device.release_memory`), all reported by
  :meth:`Device.memory_stats` and, where prometheus_client is installed, on the process's
  ``/metrics`` (``eugo_device_*``).
- **errors** (:meth:`Device.classify_error`, :meth:`Device.note_error`): out of memory (CuPy's,
  RMM's plain ``MemoryError``), library status errors (cuBLAS, cuFFT, cuRAND, cuSOLVER, cuSPARSE),
  kernel compilation (NVRTC), other CUDA errors, and two kinds after which the device is off for
  the process, with the reason kept (:attr:`Device.unusable_reason`): *sticky* CUDA errors (an
  illegal address, a launch failure: the context is lost) and *unavailable* (a CUDA library
  missing).
- **honest detection** (:meth:`Device.probe`, :func:`cupy_unusable_reason`): a tiny kernel, a
  GEMM and an FFT once per process before ``auto`` trusts a device, and the reason when it
  cannot.
- **device bytes kept apart from host memory** (:func:`device_nbytes`,
  :func:`install_device_accounting`): a worker's spill buffer weighs values by their host bytes
  only, so device results are not spilled to disk for the host's sake.

Every transfer, task and error is counted per process: :func:`device_stats`,
:func:`device_memory_stats`, :func:`reset_device_stats`.

This module decides no placement and reads no config: :mod:`eugo_dask.config` turns settings into
a :class:`DeviceSettings`, the planner chooses, the rewrite wires tasks and
:mod:`eugo_dask.runtime` calls these methods inside tasks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

#: The values of ``eugo.device``.
DEVICES = ("auto", "cupy", "emulated", "none")

#: Kinds of device error (:meth:`Device.classify_error`).
OUT_OF_MEMORY = "out-of-memory"
STICKY = "sticky"
UNAVAILABLE = "unavailable"
LIBRARY = "library"
COMPILE = "compile"
RUNTIME = "runtime"
ERROR_KINDS = (OUT_OF_MEMORY, STICKY, UNAVAILABLE, LIBRARY, COMPILE, RUNTIME)
#: Kinds after which the device is off for the rest of the process.
FATAL_KINDS = frozenset({STICKY, UNAVAILABLE})

#: CUDA errors after which the context is unusable (CUDA runtime API docs: "the process must be
#: terminated and relaunched"), plus uncorrectable hardware errors and cudaErrorUnknown.
STICKY_CUDA_STATUSES = frozenset({
    214,  # cudaErrorECCUncorrectable
    220,  # cudaErrorNvlinkUncorrectable
    700,  # cudaErrorIllegalAddress
    702,  # cudaErrorLaunchTimeout
    709,  # cudaErrorContextIsDestroyed
    710,  # cudaErrorAssert
    714,  # cudaErrorHardwareStackError
    715,  # cudaErrorIllegalInstruction
    716,  # cudaErrorMisalignedAddress
    717,  # cudaErrorInvalidAddressSpace
    718,  # cudaErrorInvalidPc
    719,  # cudaErrorLaunchFailure
    999,  # cudaErrorUnknown
})
#: CUDA errors that say the device cannot be used at all here.
UNAVAILABLE_CUDA_STATUSES = frozenset({
    3,    # cudaErrorInitializationError
    4,    # cudaErrorCudartUnloading
    35,   # cudaErrorInsufficientDriver
    46,   # cudaErrorDevicesUnavailable
    100,  # cudaErrorNoDevice
    101,  # cudaErrorInvalidDevice
    209,  # cudaErrorNoKernelImageForDevice
    222,  # cudaErrorUnsupportedPtxVersion
})
_LIBRARY_ERRORS = frozenset({"CUBLASError", "CuFFTError", "CURANDError", "CUSOLVERError",
                             "CUSPARSEError", "CUTENSORError"})
_CUDA_LIBRARIES = ("libcublas", "libcufft", "libcurand", "libcusolver", "libcusparse", "libnvrtc",
                   "libnvjitlink", "libcudart", "libcuda.")
#: How to get the CUDA libraries CuPy wheels leave out.
CTK_HINT = ("install the CUDA libraries CuPy loads: pip install 'cupy-cuda12x[ctk]' (or "
            "'cupy-cuda13x[ctk]' for CUDA 13), or use an image with the CUDA toolkit")

_MiB = 1 << 20


@dataclass(frozen=True)
class DeviceSettings:
    """How a process's device is built (:func:`eugo_dask.config.device_settings` reads them).

    Attributes
    ----------
    memory_fraction
        Pool limit per device as a fraction of its memory; None: no limit (CuPy's default).
    fft_plan_cache_size, fft_plan_cache_bytes
        Bound of each worker thread's cuFFT plan cache per device (CuPy: 16 plans, no byte
        bound).
    idle_release_s
        Release pools' unused blocks and cached FFT plans after this many seconds without a
        task; None: never.
    staging_bytes
        Size of each of a thread's two pinned staging buffers; 0: copy straight from and to
        pageable memory.
    """

    memory_fraction: float | None = None
    fft_plan_cache_size: int = 16
    fft_plan_cache_bytes: int | None = None
    idle_release_s: float | None = None
    staging_bytes: int = 8 * _MiB


class DeviceDisabled(RuntimeError):
    """The device is off for this process (a sticky CUDA error, a missing CUDA library)."""


# ---------------------------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------------------------
class _Stats:
    _FIELDS = ("tasks", "h2d_count", "h2d_bytes", "d2h_count", "d2h_bytes", "d2d_count",
               "d2d_bytes", "device_seconds", "launch_seconds", "memory_releases",
               "released_bytes")

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

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

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
                       device_errors=dict(self.errors), disabled=dict(self.disabled))
            return out


_stats = _Stats()


def device_stats() -> dict[str, Any]:
    """Counters of device work done in this process since start or the last reset.

    Returns
    -------
    dict
        ``tasks`` (tasks that ran on a device), ``h2d_count``/``h2d_bytes``,
        ``d2h_count``/``d2h_bytes`` and ``d2d_count``/``d2d_bytes`` (array copies host->device,
        device->host and between devices), ``device_seconds`` (synchronised device time of
        task scopes) and ``launch_seconds`` (their host time until the last launch),
        ``fallbacks`` (GPU-planned tasks that ran their CPU path) and ``fallback_reasons``,
        ``device_errors`` (count by kind, :data:`ERROR_KINDS`), ``disabled`` (device name ->
        why it is off in this process), ``memory_releases``/``released_bytes``. In a
        distributed cluster each worker process has its own counters: read them with
        ``client.run(eugo_dask.device_stats)``.
    """
    return _stats.snapshot()


def reset_device_stats() -> None:
    """Set every counter of :func:`device_stats` in this process back to zero."""
    _stats.reset()


_live_devices: weakref.WeakSet[Device] = weakref.WeakSet()


def device_memory_stats() -> list[dict[str, Any]]:
    """:meth:`Device.memory_stats` of every device built in this process."""
    return [device.memory_stats() for device in list(_live_devices)]


class DeferringLock:
    """A lock for books that finalizers change: the finalizer queues its change, the lock's
    next holder makes it.

    A finalizer (``weakref.finalize``) runs where its object dies, and an object in a reference
    cycle dies wherever the cyclic collector runs: inside any allocation, on any thread, also
    on a thread that holds this very lock. Waiting for the lock there would wait for ever (a
    plain lock is not reentrant; a reentrant one would let the finalizer change the books in
    the middle of its holder's update). So a finalizer never takes the lock: :meth:`defer`
    queues its change (an atomic deque append) and whoever takes the lock next makes the
    queued changes first, as CPython's and CuPy's memory pools defer frees that arrive under
    their locks. Use it as a context manager."""

    __slots__ = ("_lock", "_deferred")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()

    def defer(self, change: Callable[..., None], *args: Any) -> None:
        """Have the lock's next holder call ``change(*args)`` (from a finalizer: never blocks)."""
        self._deferred.append((change, args))

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            while self._deferred:
                change, args = self._deferred.popleft()
                change(*args)
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        self._lock.release()


# ---------------------------------------------------------------------------------------------
# Task clock
# ---------------------------------------------------------------------------------------------
class TaskClock:
    """Where one task's time went on its device, measured on the device.

    The runtime calls :meth:`mark` after each phase (say ``"eugo-h2d"`` after copying inputs,
    ``"eugo-device-compute"`` after the chunk function). When the task's scope ends
    (:meth:`Device.task`), ``seconds`` maps each mark's label to the device time since the
    previous mark (the first counts from the scope's start; time after the last mark is added to
    it; without marks everything is under ``"device"``); ``launch_s`` is the host time until
    the scope's body returned (what an unsynchronised timer sees) and ``wall_s`` the host time
    until the device finished.
    """

    __slots__ = ("ordinal", "seconds", "launch_s", "wall_s", "_marks", "_stamp")

    def __init__(self, ordinal: int, stamp: Callable[[], Any]) -> None:
        self.ordinal = ordinal
        self.seconds: dict[str, float] = {}
        self.launch_s = 0.0
        self.wall_s = 0.0
        self._stamp = stamp
        self._marks: list[tuple[str, Any]] = [("", stamp())]

    def mark(self, label: str) -> None:
        """End a phase called ``label`` here (a CUDA event on the task's stream)."""
        self._marks.append((label, self._stamp()))

    @property
    def device_s(self) -> float:
        """Device seconds of the whole scope (after it ended)."""
        return sum(self.seconds.values())

    def _finish(self, end: Any, elapsed: Callable[[Any, Any], float]) -> None:
        marks = self._marks
        labels = [label for label, _ in marks[1:]] or ["device"]
        stamps = [stamp for _, stamp in marks[1:]] or [end]
        stamps[-1] = end  # time after the last mark counts to it
        seconds: dict[str, float] = {}
        previous = marks[0][1]
        for label, stamp in zip(labels, stamps):
            seconds[label] = seconds.get(label, 0.0) + max(elapsed(previous, stamp), 0.0)
            previous = stamp
        self.seconds = seconds


# ---------------------------------------------------------------------------------------------
# Device interface
# ---------------------------------------------------------------------------------------------
def _walk(value: Any, visit: Callable[[Any], None]) -> None:
    if isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, visit)
    elif type(value) is dict:
        for v in value.values():
            _walk(v, visit)
    else:
        visit(value)


class Device:
    """What the runtime needs from a device: where a task runs, its time, copies, memory bounds,
    error classes and the process-wide switch-off. Subclasses implement the ``_``-prefixed
    methods and :meth:`is_device_array`, :meth:`ordinal_of`, :meth:`memory_stats`,
    :meth:`release_memory` and :meth:`probe`."""

    name: str = "device"

    def __init__(self, settings: DeviceSettings | None = None) -> None:
        self.settings = settings or DeviceSettings()
        self._local = threading.local()
        self._lock = threading.Lock()
        # held while an idle release runs: no task scope opens meanwhile (CuPy's FFT plan
        # caches belong to their threads and must not be cleared under a running task)
        self._release_lock = threading.Lock()
        self._in_flight: Counter[int] = Counter()
        self._next_home = 0
        self._disabled: str | None = None
        self._last_busy = time.monotonic()
        self._released_since_busy = True
        self._idle_thread: threading.Thread | None = None
        self._idle_ticks_external = False
        _live_devices.add(self)
        _register_metrics()

    # -- what a device implements ---------------------------------------------------------------
    @property
    def count(self) -> int:
        """Devices of this kind this process uses (ordinals ``0 .. count-1``)."""
        return 1

    def is_device_array(self, value: object) -> bool:
        raise NotImplementedError

    def ordinal_of(self, value: object) -> int | None:
        """The device ``value`` lives on, or None where it is no device array."""
        raise NotImplementedError

    def _to_device(self, array: np.ndarray, ordinal: int, in_task: bool) -> Any:
        raise NotImplementedError

    def _to_host(self, array: Any) -> np.ndarray:
        raise NotImplementedError

    def _move(self, array: Any, ordinal: int) -> Any:
        raise NotImplementedError

    def _classify(self, exc: BaseException) -> str | None:
        return None

    def _scope(self, ordinal: int) -> contextlib.AbstractContextManager[
            tuple[Callable[[], Any], Callable[[Any, Any], float], Callable[[], Any]]]:
        """Make ``ordinal`` (and its stream) current on this thread; yield (stamp, elapsed,
        synchronise): how to take a time stamp on the device, the seconds between two stamps,
        and how to wait for the device's work and take the final stamp."""
        raise NotImplementedError

    def memory_stats(self) -> dict[str, Any]:
        """Memory held by this device in this process (bytes per ordinal, caches)."""
        raise NotImplementedError

    def release_memory(self, *, idle: bool = False) -> int:
        """Give back what the pools hold beyond what is in use, and cached FFT plans: those of
        this thread and of finished threads, or with ``idle`` every thread's (only while no
        task runs, as the idle releaser makes sure). Returns the bytes given back."""
        raise NotImplementedError

    def probe(self) -> str | None:
        """Run a tiny kernel, GEMM and FFT on each device; the reason it is unusable, or None."""
        return None

    # -- placement ----------------------------------------------------------------------------
    def _home(self) -> int:
        home = getattr(self._local, "home", None)
        if home is None:
            with self._lock:
                home = self._next_home % self.count
                self._next_home += 1
            self._local.home = home
        return home

    def select(self, values: Any = ()) -> int:
        """The device for a task reading ``values`` (its arguments, nested).

        The device holding most of their device-resident bytes (a chain stays on its device);
        else, inside a task scope, the scope's; else the one with the fewest tasks in flight,
        this thread's own device among equals (worker threads spread over devices)."""
        count = self.count
        if count == 1:
            return 0
        resident: Counter[int] = Counter()

        def visit(value: Any) -> None:
            ordinal = self.ordinal_of(value)
            if ordinal is not None:
                resident[ordinal] += int(getattr(value, "nbytes", 0)) + 1

        _walk(values, visit)
        if resident:
            return max(resident, key=lambda o: (resident[o], -self._in_flight[o], -o))
        clock = getattr(self._local, "clock", None)
        if clock is not None:
            return clock.ordinal
        home = self._home()
        return min(range(count), key=lambda o: (self._in_flight[o], o != home, o))

    def gather(self, values: Any, ordinal: int) -> Any:
        """``values`` with every device array on another device moved to ``ordinal``."""
        def convert(value: Any) -> Any:
            where = self.ordinal_of(value)
            return self.move(value, ordinal) if where is not None and where != ordinal else value

        return map_arrays(values, convert)

    # -- the task scope -----------------------------------------------------------------------
    @contextlib.contextmanager
    def task(self, ordinal: int | None = None) -> Iterator[TaskClock]:
        """Run a task's device work on ``ordinal`` (default :meth:`select`) and wait for it.

        Inside, the device and this thread's stream are current and copies are asynchronous on
        it; at the end the stream is synchronised, so device faults raise here, and the
        :class:`TaskClock` yielded holds device-side seconds. Errors are classified
        (:meth:`note_error`) and re-raised. Nested scopes on one thread are one scope. Raises
        :class:`DeviceDisabled` when the device is off in this process."""
        if self._disabled is not None:
            raise DeviceDisabled(f"the {self.name} device is off in this process: {self._disabled}")
        outer = getattr(self._local, "clock", None)
        if outer is not None:
            yield outer
            return
        ordinal = self.select() if ordinal is None else ordinal
        with self._release_lock, self._lock:
            self._in_flight[ordinal] += 1
            self._released_since_busy = False
        start = time.perf_counter()
        clock: TaskClock | None = None
        try:
            with self._scope(ordinal) as (stamp, elapsed, synchronise):
                clock = TaskClock(ordinal, stamp)
                self._local.clock = clock
                try:
                    yield clock
                finally:
                    self._local.clock = None
                clock.launch_s = time.perf_counter() - start
                clock._finish(synchronise(), elapsed)
                clock.wall_s = time.perf_counter() - start
        except BaseException as exc:
            self.note_error(exc)
            raise
        finally:
            with self._lock:
                self._in_flight[ordinal] -= 1
                self._last_busy = time.monotonic()
            self._start_idle_release()
        assert clock is not None
        _stats.add(device_seconds=clock.device_s, launch_seconds=clock.launch_s)

    def current_task(self) -> TaskClock | None:
        """The clock of the task scope open on this thread, if any."""
        return getattr(self._local, "clock", None)

    # -- copies -------------------------------------------------------------------------------
    def _default_ordinal(self) -> int:
        return self.select()

    def to_device(self, array: np.ndarray, ordinal: int | None = None) -> Any:
        """Copy a host array to device ``ordinal`` (default: the open scope's, else this
        thread's current device on CuPy, :meth:`select` elsewhere), counted. Asynchronous
        inside a task scope, complete on return outside one."""
        clock = self.current_task()
        if ordinal is None:
            ordinal = clock.ordinal if clock is not None else self._default_ordinal()
        out = self._to_device(array, ordinal, clock is not None and clock.ordinal == ordinal)
        _stats.add(h2d_count=1, h2d_bytes=int(array.nbytes))
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to a new host array (counted); complete on return."""
        out = self._to_host(array)
        _stats.add(d2h_count=1, d2h_bytes=int(out.nbytes))
        return out

    def move(self, array: Any, ordinal: int) -> Any:
        """Copy a device array to device ``ordinal`` (counted; the same array if it is there)."""
        if self.ordinal_of(array) == ordinal:
            return array
        out = self._move(array, ordinal)
        _stats.add(d2d_count=1, d2d_bytes=int(array.nbytes))
        return out

    # -- errors -------------------------------------------------------------------------------
    def classify_error(self, exc: BaseException) -> str | None:
        """The kind of device error ``exc`` is (:data:`ERROR_KINDS`), or None where it is no
        device error. Follows ``__cause__``/``__context__`` (an ImportError raised for a
        missing library)."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            if isinstance(current, DeviceDisabled):
                return UNAVAILABLE
            kind = self._classify(current)
            if kind is None and isinstance(current, MemoryError):
                kind = OUT_OF_MEMORY  # RMM raises a plain MemoryError
            if kind is not None:
                return kind
            current = current.__cause__ or current.__context__
        return None

    def is_device_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from the device (:meth:`classify_error` is not None)."""
        return self.classify_error(exc) is not None

    def note_error(self, exc: BaseException) -> str | None:
        """Classify ``exc`` once, count it, and act on it: the device is off for the process
        after a sticky or unavailable error (:meth:`disable`); memory is released after an
        out-of-memory error. Returns the kind (None: not a device error)."""
        noted = getattr(exc, "_eugo_device_error", False)
        kind = self.classify_error(exc)
        if kind is None or noted:
            return kind
        with contextlib.suppress(AttributeError, TypeError):
            exc._eugo_device_error = True  # type: ignore[attr-defined]
        _stats.add_error(kind)
        if kind in FATAL_KINDS:
            self.disable(f"{kind} error: {type(exc).__name__}: {exc}")
        elif kind == OUT_OF_MEMORY:
            with contextlib.suppress(Exception):
                self.release_memory()
        return kind

    def disable(self, reason: str) -> None:
        """Turn this device off for the rest of the process, saying why (once)."""
        with self._lock:
            if self._disabled is not None:
                return
            self._disabled = reason
        with _stats._lock:
            _stats.disabled[self.name] = reason
        logger.warning("eugo: the %s device is off in this process: %s. GPU-planned tasks run their "
                       "CPU path here; restart the worker to use the device again.", self.name, reason)

    @property
    def unusable_reason(self) -> str | None:
        """Why this device is off in this process (:meth:`disable`), or None."""
        return self._disabled

    # -- idle release -------------------------------------------------------------------------
    def tasks_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def idle_release_externally(self) -> None:
        """Someone else calls :meth:`release_if_idle` (a distributed worker, from its event
        loop, for as long as it runs): this device starts no releaser thread of its own, which
        would outlive the worker."""
        self._idle_ticks_external = True

    def release_if_idle(self) -> None:
        """Give pools and plan caches back if no task ran for ``idle_release_s``."""
        if self.settings.idle_release_s is not None:
            self._release_if_idle(self.settings.idle_release_s)

    def _start_idle_release(self) -> None:
        if (self.settings.idle_release_s is None or self._idle_thread is not None
                or self._idle_ticks_external):
            return
        with self._lock:
            if self._idle_thread is not None:
                return
            self._idle_thread = threading.Thread(
                target=_idle_release_loop, args=(weakref.ref(self), self.settings.idle_release_s),
                name=f"eugo-{self.name}-idle-release", daemon=True)
        self._idle_thread.start()

    def _release_if_idle(self, idle_s: float) -> None:
        with self._release_lock:
            with self._lock:
                due = (not self._released_since_busy and not self.tasks_in_flight()
                       and time.monotonic() - self._last_busy >= idle_s)
                if due:
                    self._released_since_busy = True
            if due:
                released = self.release_memory(idle=True)
                logger.debug("eugo: %s idle for %.0f s: released %d bytes", self.name, idle_s, released)


def _idle_release_loop(ref: weakref.ref[Device], idle_s: float) -> None:
    while True:
        time.sleep(max(idle_s / 4, 0.01))
        device = ref()
        if device is None:
            return
        try:
            device._release_if_idle(idle_s)
        except Exception:  # never let the releaser die of a device error
            logger.exception("eugo: releasing idle device memory failed")
        del device


def map_arrays(value: Any, convert: Callable[[Any], Any]) -> Any:
    """Apply ``convert`` to every leaf of a (possibly nested) task value: lists, tuples and
    dicts are walked, anything else is a leaf."""
    if isinstance(value, list):
        return [map_arrays(v, convert) for v in value]
    if type(value) is tuple:
        return tuple(map_arrays(v, convert) for v in value)
    if type(value) is dict:
        return {k: map_arrays(v, convert) for k, v in value.items()}
    return convert(value)


# ---------------------------------------------------------------------------------------------
# Device bytes apart from host memory
# ---------------------------------------------------------------------------------------------
#: Types whose instances hold device memory without ``__cuda_array_interface__`` (the
#: emulated device registers its array type).
DEVICE_ARRAY_TYPES: set[type] = set()


def device_nbytes(value: Any) -> int:
    """Bytes of device memory held by the arrays in ``value`` (nested lists, tuples, dicts):
    anything with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch CUDA tensors) and the
    emulated device's arrays."""
    total = 0

    def visit(v: Any) -> None:
        nonlocal total
        cls = type(v)
        if cls in DEVICE_ARRAY_TYPES or hasattr(cls, "__cuda_array_interface__"):
            total += int(getattr(v, "nbytes", 0))

    _walk(value, visit)
    return total


def install_device_accounting(worker: Any) -> bool:
    """Make ``worker``'s spill buffer weigh values by their host bytes only.

    distributed weighs every stored value with ``sizeof``, which counts a CuPy array's device
    bytes; past the worker's memory target (60% of its memory limit) device results would be
    copied to the host and pickled to disk for the host's sake. Afterwards device bytes are
    left out of that weight (they are bounded by the device's pool limit instead) while
    ``sizeof``, which the scheduler also uses to price moving a key between workers, is
    unchanged. Idempotent; returns False where the worker's store is no zict buffer (dask-cuda
    brings its own device-aware store)."""
    data: Any = getattr(worker, "data", None)
    fast: Any = getattr(data, "fast", None)
    if data is None or fast is None or not hasattr(fast, "weights") or not callable(getattr(fast, "weight", None)):
        return False
    if getattr(data, "_eugo_device_accounting", False):
        return True
    original = fast.weight

    def host_weight(key: Any, value: Any) -> float:
        return max(original(key, value) - device_nbytes(value), 0)

    lock = getattr(fast, "lock", None) or contextlib.nullcontext()
    with lock:
        fast.weight = host_weight
        if hasattr(data, "weight"):
            data.weight = host_weight
        for key in list(fast.weights):
            new = host_weight(key, fast.d[key])
            fast.total_weight += new - fast.weights[key]
            fast.weights[key] = new
        data._eugo_device_accounting = True
    return True


# ---------------------------------------------------------------------------------------------
# Metrics (the process's /metrics: a worker's, where prometheus_client is installed)
# ---------------------------------------------------------------------------------------------
_metrics_lock = threading.Lock()
_metrics_registered = False


class DeviceMetricsCollector:
    """``eugo_device_*`` gauges of this process's devices, read at scrape time."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        memory = GaugeMetricFamily("eugo_device_memory_bytes",
                                   "Device memory of this process by device, ordinal and kind.",
                                   labels=["device", "ordinal", "kind"])
        plans = GaugeMetricFamily("eugo_device_fft_plans", "Cached cuFFT plans.",
                                  labels=["device", "ordinal"])
        in_flight = GaugeMetricFamily("eugo_device_tasks_in_flight", "Task scopes open.",
                                      labels=["device", "ordinal"])
        pinned = GaugeMetricFamily("eugo_device_pinned_bytes", "Pinned host staging memory.",
                                   labels=["device"])
        off = GaugeMetricFamily("eugo_device_disabled", "1 where the device is off in this process.",
                                labels=["device", "reason"])
        errors = CounterMetricFamily("eugo_device_errors", "Device errors by kind.", labels=["kind"])
        try:
            for stats in device_memory_stats():
                name = stats["device"]
                for entry in stats["ordinals"]:
                    labels = [name, str(entry["ordinal"])]
                    for kind in ("array_bytes", "pool_used_bytes", "pool_held_bytes", "pool_limit_bytes",
                                 "capacity_bytes", "fft_plan_bytes"):
                        if entry.get(kind) is not None:
                            memory.add_metric([*labels, kind.removesuffix("_bytes")], entry[kind])
                    plans.add_metric(labels, entry.get("fft_plans", 0))
                    in_flight.add_metric(labels, entry.get("tasks_in_flight", 0))
                pinned.add_metric([name], stats.get("pinned_bytes", 0))
                off.add_metric([name, stats.get("disabled") or ""], 1 if stats.get("disabled") else 0)
            for kind, n in device_stats()["device_errors"].items():
                errors.add_metric([kind], n)
        except Exception:  # a scrape never raises
            logger.exception("eugo: collecting device metrics failed")
        yield from (memory, plans, in_flight, pinned, off, errors)


def _register_metrics() -> None:
    global _metrics_registered
    if _metrics_registered:
        return
    with _metrics_lock:
        if _metrics_registered:
            return
        _metrics_registered = True
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return
        REGISTRY.register(DeviceMetricsCollector())


# ---------------------------------------------------------------------------------------------
# CuPy
# ---------------------------------------------------------------------------------------------
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


class CupyDevice(Device):
    """CUDA devices through CuPy (every device visible to the process)."""

    name = "cupy"
    #: Copies at most this large go straight from/to pageable memory (staging costs more).
    direct_copy_bytes = 1 * _MiB

    def __init__(self, cupy_module: Any, settings: DeviceSettings | None = None, *,
                 count: int | None = None) -> None:
        self.cupy = cupy_module
        self._count = int(count if count is not None else cupy_module.cuda.runtime.getDeviceCount())
        self._ready: set[int] = set()
        self._ready_lock = threading.Lock()
        self._fft_caches: dict[tuple[int, int], Any] = {}  # (thread ident, ordinal) -> PlanCache
        self._staging_lock = DeferringLock()  # a thread's buffers are forgotten by a finalizer
        self._staging_total = 0
        super().__init__(settings)  # last: the device is visible to metrics from here on

    @property
    def count(self) -> int:
        return self._count

    def is_device_array(self, value: object) -> bool:
        return isinstance(value, self.cupy.ndarray)

    def ordinal_of(self, value: object) -> int | None:
        return int(value.device.id) if isinstance(value, self.cupy.ndarray) else None

    def _default_ordinal(self) -> int:
        # outside a task scope, where code that chose no device runs: CuPy's current device
        return int(self.cupy.cuda.runtime.getDevice())

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
            self._fft_caches[(threading.get_ident(), ordinal)] = cache

    def _staging(self) -> _Staging:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = _Staging(self.cupy, self.settings.staging_bytes)
            with self._staging_lock:
                self._staging_total += 2 * self.settings.staging_bytes
            weakref.finalize(staging, self._staging_lock.defer, self._forget_staging,
                             2 * self.settings.staging_bytes)
        return staging

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
                    end = stream.record()
                    end.synchronize()
                    return end

                try:
                    yield stream.record, _elapsed_seconds(cupy), synchronise
                except BaseException:
                    # drain the stream before the fallback reads anything; a sticky error
                    # raised here is classified with the original one
                    with contextlib.suppress(Exception):
                        stream.synchronize()
                    raise

    @contextlib.contextmanager
    def _copy_stream(self, ordinal: int, in_task: bool) -> Iterator[Any]:
        """The stream a copy runs on: the task's, or this thread's, synchronised after."""
        if in_task:
            yield self.cupy.cuda.get_current_stream()
            return
        self._prepare(ordinal)
        with self.cupy.cuda.Device(ordinal):
            stream = self._stream(ordinal)
            _after_legacy_stream(self.cupy, stream)
            yield stream
            stream.synchronize()

    # -- copies -------------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray, ordinal: int, in_task: bool) -> Any:
        cupy = self.cupy
        if not (array.flags.c_contiguous or array.flags.f_contiguous):
            array = np.ascontiguousarray(array)
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        with self._copy_stream(ordinal, in_task) as stream:
            out = cupy.empty(array.shape, dtype=array.dtype, order=order)
            self._h2d(_host_bytes(array), out.data, stream)
        return out

    def _h2d(self, src: np.ndarray, dst: Any, stream: Any) -> None:
        nbytes, chunk = src.size, self.settings.staging_bytes
        if nbytes <= self.direct_copy_bytes or chunk <= 0:
            dst.copy_from_host_async(src.ctypes.data, nbytes, stream)
            return
        staging = self._staging()
        for i, offset in enumerate(range(0, nbytes, chunk)):
            slot, size = i % 2, min(chunk, nbytes - offset)
            staging.wait(slot)  # the previous copy out of this buffer has finished
            np.copyto(staging.views[slot][:size], src[offset:offset + size])
            (dst + offset).copy_from_host_async(staging.memory[slot].ptr, size, stream)
            staging.events[slot] = stream.record()

    def _to_host(self, array: Any) -> np.ndarray:
        cupy = self.cupy
        ordinal = int(array.device.id)
        clock = self.current_task()
        with self._copy_stream(ordinal, clock is not None and clock.ordinal == ordinal) as stream:
            if not (array.flags.c_contiguous or array.flags.f_contiguous):
                array = cupy.ascontiguousarray(array)
            order: Literal["C", "F"] = (
                "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C")
            out = np.empty(array.shape, dtype=array.dtype, order=order)
            self._d2h(array.data, _host_bytes(out), stream)
        return out

    def _d2h(self, src: Any, dst: np.ndarray, stream: Any) -> None:
        nbytes, chunk = dst.size, self.settings.staging_bytes
        if nbytes <= self.direct_copy_bytes or chunk <= 0:
            src.copy_to_host_async(dst.ctypes.data, nbytes, stream)
            stream.synchronize()
            return
        staging = self._staging()
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
            np.copyto(dst[offset:offset + size], staging.views[slot][:size])
            if i + 2 < len(offsets):
                issue(i + 2)

    def _move(self, array: Any, ordinal: int) -> Any:
        cupy = self.cupy
        clock = self.current_task()
        with self._copy_stream(ordinal, clock is not None and clock.ordinal == ordinal) as stream:
            if not (array.flags.c_contiguous or array.flags.f_contiguous):
                with cupy.cuda.Device(array.device.id):
                    array = cupy.ascontiguousarray(array)
                    cupy.cuda.get_current_stream().synchronize()
            order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
            out = cupy.empty(array.shape, dtype=array.dtype, order=order)
            out.data.copy_from_device_async(array.data, array.nbytes, stream)
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
        for ordinal in range(self._count):
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
                "pinned_bytes": pinned,
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
            if idle or thread == me or thread not in alive:
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
        for ordinal in range(self._count):
            reason = probe_cupy(self.cupy, ordinal)
            if reason is not None:
                return f"CUDA device {ordinal}: {reason}"
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


def _elapsed_seconds(cupy: Any) -> Callable[[Any, Any], float]:
    def elapsed(start: Any, end: Any) -> float:
        return float(cupy.cuda.get_elapsed_time(start, end)) / 1000.0

    return elapsed


def _classify_by_name(exc: BaseException) -> str | None:
    """Kinds recognised without importing the library that raised them (it may be missing)."""
    name, module = type(exc).__name__, type(exc).__module__ or ""
    if name in _LIBRARY_ERRORS and module.startswith(("cupy", "cupy_backends")):
        return LIBRARY
    if name in ("NVRTCError", "CompileException") and module.startswith(("cupy", "cupy_backends")):
        return COMPILE
    message = str(exc)
    if name == "DynamicLibNotFoundError" or (
            isinstance(exc, (ImportError, OSError, RuntimeError))
            and any(lib in message for lib in _CUDA_LIBRARIES)
            and ("cannot open shared object" in message or "Failure finding" in message
                 or "failed to load" in message.lower())):
        return UNAVAILABLE
    return None


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
        raise ImportError("eugo-dask GPU support needs CuPy: pip install 'eugo-dask[gpu]'") from e
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


def resolve_device_name(setting: str, *, explicit_error: bool = False) -> str | None:
    """Map an ``eugo.device`` setting to the device that will run GPU tasks here, or None.

    ``auto`` is ``cupy`` where CuPy has a working device and None otherwise; ``cupy`` raises
    when CuPy is missing (the user asked for it) and, with ``explicit_error``, when CuPy finds
    no usable device, saying why; without it, it is None there.
    """
    if setting == "none":
        return None
    if setting == "emulated":
        return "emulated"
    if setting == "cupy":
        import_cupy()
        reason = cupy_unusable_reason()
        if reason is not None and explicit_error:
            raise RuntimeError(
                f"eugo.device is 'cupy' but no CUDA device can run GPU tasks here: {reason}. "
                f"Set eugo.device to 'auto' to run on the CPU where there is none; allowed: "
                f"{list(DEVICES)}")
        return "cupy" if reason is None else None
    if setting == "auto":
        return "cupy" if cupy_device_count() else None
    raise ValueError(f"eugo.device must be one of {list(DEVICES)}; got {setting!r}")
