"""The device interface: what the runtime calls inside tasks (:class:`Device`), the settings a
device is built with (:class:`DeviceSettings`), and what device implementations share.

What a device does for the runtime (each point is one method; the runtime decides when):

- **which device a task runs on** (:meth:`Device.select`): the one holding most of the task's
  device-resident input bytes, so a chain's data stays where it is; otherwise the least busy one,
  each worker thread preferring a device of its own. A process sees every GPU it is given
  (``--resources GPU=4``, four visible GPUs); dask-cuda's one process per GPU sees one.
- **a task's time on the device** (:meth:`Device.task`): a scope that makes the task's device
  and its thread's own stream current, and at its end synchronises that stream, so the scope's
  host time is the work's time and a kernel fault surfaces inside the task (where the runtime can
  fall back), not in a later copy. A :class:`~eugo_dask.devices.clock.TaskClock` holds the
  device-side seconds between the marks the runtime sets (CUDA events on CuPy).
- **copies** (:meth:`Device.to_device`, :meth:`Device.to_host`, :meth:`Device.move`): on CuPy
  through two pinned staging buffers per worker thread (:mod:`eugo_dask.devices.cuda`).
- **bounded memory**: a pool limit per device (``memory_fraction`` of its memory), cuFFT plan
  caches bounded in plans and bytes, pools released after ``idle_release_s`` without tasks or
  copies, and on out-of-memory (:meth:`Device.release_memory`; a thread's plan cache by that
  thread only), all reported by
  :meth:`Device.memory_stats` and, where prometheus_client is installed, on the process's
  ``/metrics`` (:mod:`eugo_dask.devices.metrics`).
- **errors** (:meth:`Device.classify_error`, :meth:`Device.note_error`): the kinds of
  :mod:`eugo_dask.devices.errors`; after a sticky or unavailable one the device is off for the
  process, with the reason kept (:attr:`Device.unusable_reason`).
- **honest detection** (:meth:`Device.probe`): a tiny kernel, a GEMM and an FFT before a device
  is trusted, and the reason when it cannot be.

Also here: :func:`map_arrays` (a task value's leaves converted) and :class:`DeferringLock` (the
lock both devices keep their memory books under, which finalizers change).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from eugo_dask.devices.clock import TaskClock
from eugo_dask.devices.errors import FATAL_KINDS, OUT_OF_MEMORY, STICKY, UNAVAILABLE
from eugo_dask.devices.metrics import _register_metrics
from eugo_dask.devices.stats import _live_devices, _stats

logger = logging.getLogger(__name__)

_MiB = 1 << 20

#: One size of a profile's per-size copy paths: (bytes, path, threads of a staged copy or None).
CopyRule = tuple[int, str, int | None]


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
    copy_threads, copy_piece_bytes
        Threads that split one host memcpy into or out of a staging buffer, each given at least
        ``copy_piece_bytes`` (:class:`~eugo_dask.devices.copies.HostCopier`); 1: the task's
        thread alone.
    pinned_results_bytes, pinned_results_min_bytes
        The cap on pinned host memory held for results copied back (the device copies straight
        into it: :class:`~eugo_dask.devices.copies.ResultPool`), and the least bytes a result
        needs to get a block (smaller ones are staged into new arrays); 0 bytes: every result
        is staged.
    register_min_bytes
        Contiguous host chunks at least this large are page-locked in place
        (``cudaHostRegister``) and copied to the device in one DMA; None: never (staged).
    gpus
        Which CUDA devices a process drives: ``"one"`` (its current device, the first it
        sees) or ``"all"`` it sees; always one under dask-cuda or RMM
        (:meth:`eugo_dask.devices.CupyDevice.ordinals`).
    h2d_by_size, d2h_by_size
        The profile's per-size copy paths (``link.copies_by_size``), ``(bytes, path,
        threads)`` by increasing size, each the path that measured best at that size
        (:func:`eugo_dask.devices.copies.choose_copy` takes the one nearest a copy's size).
    per_size
        Which copy choices those points make (``"threads"``, ``"h2d"``, ``"d2h"``): the ones
        whose config keys (``eugo.copy-threads``, ``eugo.register-in-place``,
        ``eugo.pinned-results-min``) are ``auto``; the others follow the fields above.
    """

    memory_fraction: float | None = None
    fft_plan_cache_size: int = 16
    fft_plan_cache_bytes: int | None = None
    idle_release_s: float | None = None
    staging_bytes: int = 8 * _MiB
    copy_threads: int = 4
    copy_piece_bytes: int = 1 * _MiB
    pinned_results_bytes: int = 1024 * _MiB
    pinned_results_min_bytes: int = 64 * _MiB
    register_min_bytes: int | None = None
    gpus: str = "one"
    h2d_by_size: tuple[CopyRule, ...] = ()
    d2h_by_size: tuple[CopyRule, ...] = ()
    per_size: frozenset[str] = frozenset()


class DeviceDisabled(RuntimeError):
    """The device is off for this process (a sticky CUDA error, a missing CUDA library)."""


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
        # held while an idle release runs: no task scope and no copy starts meanwhile (the
        # release frees pool blocks, and cudaFree waits for the whole device)
        self._release_lock = threading.Lock()
        self._in_flight: Counter[int] = Counter()
        self._copies_in_flight = 0  # copies outside task scopes (those inside are the task's)
        self._next_home = 0
        self._disabled: str | None = None
        self._last_busy = time.monotonic()
        self._released_since_busy = True
        self._idle_thread: threading.Thread | None = None
        self._idle_ticks_external = False
        self._memory_lost_callbacks: list[Callable[[str], None]] = []
        _live_devices.add(self)
        _register_metrics()

    # -- what a device implements ---------------------------------------------------------------
    @property
    def count(self) -> int:
        """Devices of this kind this process uses."""
        return 1

    @property
    def ordinals(self) -> tuple[int, ...]:
        """The ordinals of the devices this process uses (``0 .. count-1`` unless a device
        says otherwise: a CUDA process driving one GPU uses its current one)."""
        return tuple(range(self.count))

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
        """Give back what the pools hold beyond what is in use, and the cached FFT plans of this
        thread and of finished threads (a live thread's plans are its own: CuPy's plan caches
        are not safe to clear from another thread). ``idle``: called by the idle releaser,
        while no task and no copy runs. Returns the bytes given back."""
        raise NotImplementedError

    def probe(self) -> str | None:
        """Run a tiny kernel, GEMM and FFT on each device; the reason it is unusable, or None."""
        return None

    # -- placement ----------------------------------------------------------------------------
    def _home(self) -> int:
        home = getattr(self._local, "home", None)
        if home is None:
            ordinals = self.ordinals
            with self._lock:
                home = ordinals[self._next_home % len(ordinals)]
                self._next_home += 1
            self._local.home = home
        return home

    def select(self, values: Any = ()) -> int:
        """The device for a task reading ``values`` (its arguments, nested).

        The device holding most of their device-resident bytes (a chain stays on its device);
        else, inside a task scope, the scope's; else the one with the fewest tasks in flight,
        this thread's own device among equals (worker threads spread over devices). Only the
        devices this process uses (:attr:`ordinals`) are chosen: data on another is moved."""
        ordinals = self.ordinals
        if len(ordinals) == 1:
            return ordinals[0]
        resident: Counter[int] = Counter()

        def visit(value: Any) -> None:
            ordinal = self.ordinal_of(value)
            if ordinal is not None and ordinal in ordinals:
                resident[ordinal] += int(getattr(value, "nbytes", 0)) + 1

        _walk(values, visit)
        if resident:
            return max(resident, key=lambda o: (resident[o], -self._in_flight[o], -o))
        clock = getattr(self._local, "clock", None)
        if clock is not None:
            return clock.ordinal
        home = self._home()
        return min(ordinals, key=lambda o: (self._in_flight[o], o != home, o))

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
        with self._copying():
            out = self._to_device(array, ordinal, clock is not None and clock.ordinal == ordinal)
        _stats.add(h2d_count=1, h2d_bytes=int(array.nbytes))
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """Copy a device array to a new host array (counted); complete on return."""
        with self._copying():
            out = self._to_host(array)
        _stats.add(d2h_count=1, d2h_bytes=int(out.nbytes))
        return out

    def move(self, array: Any, ordinal: int) -> Any:
        """Copy a device array to device ``ordinal`` (counted; the same array if it is there)."""
        if self.ordinal_of(array) == ordinal:
            return array
        with self._copying():
            out = self._move(array, ordinal)
        _stats.add(d2d_count=1, d2d_bytes=int(array.nbytes))
        return out

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """A copy outside a task scope is device work too: the device is not idle while it runs
        (an idle release would free the blocks it reads, and its cudaFree would wait for it),
        and none starts while a release runs. A copy inside a scope is the task's."""
        if self.current_task() is not None:
            yield
            return
        with self._release_lock, self._lock:
            self._copies_in_flight += 1
            self._released_since_busy = False
        try:
            yield
        finally:
            with self._lock:
                self._copies_in_flight -= 1
                self._last_busy = time.monotonic()

    # -- errors -------------------------------------------------------------------------------
    def classify_error(self, exc: BaseException) -> str | None:
        """The kind of device error ``exc`` is (:data:`~eugo_dask.devices.errors.ERROR_KINDS`),
        or None where it is no device error. Follows ``__cause__``/``__context__`` (an
        ImportError raised for a missing library)."""
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
        after a sticky or unavailable error (:meth:`disable`), and after a sticky one the
        callbacks of :meth:`on_memory_lost` run; memory is released after an out-of-memory
        error. Returns the kind (None: not a device error)."""
        noted = getattr(exc, "_eugo_device_error", False)
        kind = self.classify_error(exc)
        if kind is None or noted:
            return kind
        with contextlib.suppress(AttributeError, TypeError):
            exc._eugo_device_error = True  # type: ignore[attr-defined]
        _stats.add_error(kind)
        if kind in FATAL_KINDS:
            reason = f"{kind} error: {type(exc).__name__}: {exc}"
            self.disable(reason)
            if kind == STICKY:  # the device's memory is gone with its context
                for callback in list(self._memory_lost_callbacks):
                    callback(reason)
        elif kind == OUT_OF_MEMORY:
            with contextlib.suppress(Exception):
                self.release_memory()
        return kind

    def on_memory_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when a sticky error loses this device's memory (once per
        callback, however often it is asked for)."""
        with self._lock:
            if callback not in self._memory_lost_callbacks:
                self._memory_lost_callbacks.append(callback)

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

    def busy(self) -> bool:
        """Whether a task scope or a copy outside one runs on this device now."""
        return bool(self.tasks_in_flight() or self._copies_in_flight)

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
                due = (not self._released_since_busy and not self.busy()
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
