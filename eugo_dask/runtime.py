"""What runs inside the rewritten tasks.

The rewrite (:mod:`eugo_dask.rewrite`) builds three kinds of tasks from these callables:

- ``to_device(value, device)``: a host->device transfer task (one per host chunk with GPU
  consumers);
- ``DeviceCall(func, device)(...)``: the original chunk function run on device arrays;
- ``to_host(value, device)``: a device->host transfer task, kept under the original key wherever a
  CPU consumer or an output needs NumPy;
- ``pace_token(result)`` and ``after_token(token, value)``: a read paced to the device
  (:mod:`eugo_dask.pace`) waits for a token that a device task's end releases.

Each carries its CPU path. Where the device is not usable in this process (a worker without CuPy
or a GPU, or whose own ``eugo.device`` says no) everything passes host arrays through and the
original function runs on the CPU. Where the device fails inside a task (out of memory, CUDA
runtime error, a function that refuses device arrays, a chunk type a device cannot hold) the task
re-runs its CPU path on host copies of its inputs. Every GPU task reports what it did: it ran on
the device or on the CPU, and why (Fine Performance Metrics ``eugo-ran-on-device``,
``eugo-ran-on-cpu`` and ``eugo-fallback-<category>`` per task prefix, and the bytes each copy
moved); the scheduler plugin counts from those reports, not from the plan. A fallback is also
logged once per task prefix and reported to the scheduler once per prefix and reason.

A device array arriving from another worker lands on this process's device where it can, and as
the host array it carried where it cannot (no device here, or no room): receiving never fails a
task.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Literal

import dask
import numpy as np
from dask._task_spec import DataNode, Task
from dask.utils import funcname

from eugo_dask.config import (
    device_setting_problems,
    device_settings,
    emulated_device_count,
    emulated_memory_limit,
    process_device,
)
from eugo_dask.context import (
    close_worker,
    context_meter,
    current_worker,
    granted_resources,
    running_schedulers,
    running_workers,
)
from eugo_dask.devices import (
    STICKY,
    CupyDevice,
    Device,
    DeviceSettings,
    cupy_device_count,
    cupy_probe_passed,
    cupy_unusable_reason,
    import_cupy,
    install_device_accounting,
    map_arrays,
)
from eugo_dask.devices.emulated import EmulatedDevice, EmulatedDeviceArray, set_rebuild_device, set_receive
from eugo_dask.devices.stats import _stats
from eugo_dask.graph import FUSED_FUNC, FUSED_INNER, NO_KWARGS, fused, new_task
from eugo_dask.ops import device_dtype_ok

logger = logging.getLogger(__name__)
_task_logger = logging.getLogger(__name__ + ".tasks")

_state = threading.local()
_logged_prefixes: set[str] = set()  # prefixes whose first fallback was logged
_own_error_prefixes: set[str] = set()  # prefixes whose first own error was logged

#: Topic of the events GPU tasks send to the scheduler (fallbacks), read by the plugin.
EVENT_TOPIC = "eugo"
#: The longest text an event carries: the plugin drops longer ones (its input is untrusted), so
#: what eugo sends is cut to this first.
MAX_EVENT_TEXT = 300


# ---------------------------------------------------------------------------------------------
# The devices of this process
# ---------------------------------------------------------------------------------------------
_devices: dict[tuple[str, int, int, DeviceSettings], Device] = {}
_devices_lock = threading.Lock()


def get_device(name: str) -> Device | None:
    """The device called ``name`` in this process, or None where it is not usable here.

    Tasks call this at run time: a GPU-planned task on a worker without the device runs its
    CPU path instead. A CuPy device covers every GPU the process sees, each probed once; a
    worker that uses one weighs its stored values by host bytes only.
    """
    if name == "emulated":
        key = (name, emulated_memory_limit(), emulated_device_count(), device_settings())
    elif name == "cupy":
        key = (name, 0, 0, device_settings())
    else:
        return None
    device = _devices.get(key)
    if device is None:
        with _devices_lock:
            if key not in _devices:
                if name == "emulated":
                    _devices[key] = EmulatedDevice(key[1], count=key[2], settings=key[3])
                elif cupy_device_count():
                    cupy_device = CupyDevice(import_cupy(), key[3])
                    reason = cupy_device.probe()  # every GPU of the process, once
                    if reason is not None:
                        cupy_device.disable(reason)
                    # one CuPy device per process: the one made under settings that changed
                    # since (a calibrated profile appearing) goes, with its threads' pinned
                    # staging buffers, once the tasks that hold it end
                    for old in [k for k in _devices if k[0] == "cupy"]:
                        del _devices[old]
                    _devices[key] = cupy_device
                else:
                    return None
            device = _devices[key]
    worker = current_worker()
    if worker is not None:
        # its spill buffer weighs values by host bytes only (idempotent, per worker), and
        # eugo's worker plugin drives the idle release from its event loop: no thread of
        # eugo's outlives a worker (a worker without the plugin keeps its pools, as CuPy does)
        install_device_accounting(worker)
        device.idle_release_externally()
        device.on_memory_lost(_restart_workers)
    return device


#: Set while this process's workers close because a sticky error lost the device's memory;
#: ``_closed`` once they have.
_restarting = threading.Event()
_closed = threading.Event()
#: How long a task that reads lost device memory waits for its worker to close.
RESTART_WAIT_S = 60.0


def _restart_workers(reason: str) -> None:
    """A sticky CUDA error lost the device memory of this process: its workers' device keys
    are gone, and CUDA stays broken in this process. Close every worker of this process (not
    its nanny): the nanny starts a fresh process, with a fresh CUDA context, and the scheduler
    recomputes the lost keys where they are needed. Beside a scheduler (an in-process cluster)
    nothing would start the worker again: it stays, with the device off (its GPU tasks run
    their CPU path), and a task that reads a lost key fails with :class:`DeviceDataLost`."""
    workers = running_workers()
    if not workers:
        return
    if running_schedulers():
        logger.error("eugo: %s lost this process's device memory; a worker beside its scheduler "
                     "is not restarted: tasks that read lost device keys fail", reason)
        return
    if _restarting.is_set():
        return
    _restarting.set()
    pending = [len(workers)]

    def closed() -> None:
        pending[0] -= 1
        if pending[0] <= 0:
            _closed.set()

    for worker in workers:
        logger.error("eugo: %s lost the device memory of worker %s: closing it, so that its "
                     "nanny starts it again and the scheduler recomputes its keys", reason,
                     worker.address)
        close_worker(worker, f"eugo: device memory lost ({reason})"[:MAX_EVENT_TEXT], closed)


def _wait_for_restart() -> None:
    """A task that read lost device memory while its worker closes for it waits for the close
    (bounded): the scheduler then reschedules the task, rather than recording it as failed."""
    if _restarting.is_set():
        _closed.wait(RESTART_WAIT_S)


def _forget_cuda_devices() -> None:
    """In a child process made by ``fork``: the parent's CuPy device (its streams, pools and
    CUDA context) is not the child's; the child makes its own after probing again
    (:func:`eugo_dask.devices.cuda.cupy_unusable_reason`), or uses none. The lock may have been
    held by another thread of the parent, which the child does not have."""
    global _devices_lock
    _devices_lock = threading.Lock()
    for key in [k for k in _devices if k[0] == "cupy"]:
        del _devices[key]


os.register_at_fork(after_in_child=_forget_cuda_devices)


def device_started(name: str) -> bool:
    """Whether tasks have run on the device ``name`` in this process (it is made when the first
    one asks for it)."""
    return any(key[0] == name for key in list(_devices))


def device_first_use_paid(name: str) -> bool:
    """Whether this process has paid the device's first use (CUDA context, module load, a
    kernel compile): tasks ran on it, or, for CuPy, the probe that resolving ``eugo.device``
    runs has run. The emulated device has no start of its own and stands for a GPU in a dry
    run: it is planned as CuPy is once resolved, its first use paid (its threads' set-up not)."""
    if device_started(name) or name == "emulated":
        return True
    return name == "cupy" and cupy_probe_passed()


def release_idle_devices() -> None:
    """Give back the pools of this process's devices that sat idle for ``eugo.device-idle-release``
    (a worker's periodic callback calls this)."""
    for device in list(_devices.values()):
        device.release_if_idle()


def _emulated_device() -> EmulatedDevice:
    device = get_device("emulated")
    assert isinstance(device, EmulatedDevice)
    return device


# device arrays unpickled in this process arrive on its emulated device
set_rebuild_device(_emulated_device)


class PlannedDevice(str):
    """A device's name as a plan made in this process for a local scheduler writes it into its
    tasks, with the ``eugo.*`` settings the plan was made under.

    The processes scheduler's pool processes start with Dask's default config: settings made
    with ``dask.config.set`` never reach them, and every GPU-planned task would run its CPU path
    there while the plan counted on the device. A task that meets such a name in another process
    that is no distributed worker first takes those settings for its process
    (:func:`_adopt_planned_settings`); a worker keeps its own. It is the name itself everywhere
    else (a ``str``); graphs for a distributed scheduler carry plain names."""

    settings: dict[str, Any]
    pid: int

    def __new__(cls, name: str, settings: dict[str, Any], pid: int) -> PlannedDevice:
        planned = super().__new__(cls, name)
        planned.settings, planned.pid = settings, pid
        return planned

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlannedDevice, (str(self), self.settings, self.pid))

    @classmethod
    def here(cls, name: str) -> PlannedDevice:
        """``name``, planned in this process under the ``eugo.*`` settings in force."""
        settings = copy.deepcopy(dask.config.get("eugo", {}))
        settings["device"] = name
        return cls(name, settings, os.getpid())


_adopted: list[dict[str, Any]] = []  # the planned settings this process took, the last one


def _adopt_planned_settings(name: str) -> None:
    """Where a task planned in another process runs outside any distributed worker (a
    processes scheduler's pool process): take the ``eugo.*`` settings it was planned under."""
    if type(name) is str or not isinstance(name, PlannedDevice) or name.pid == os.getpid():
        return
    if (_adopted and _adopted[0] == name.settings) or current_worker() is not None:
        return
    dask.config.update(dask.config.config, {"eugo": copy.deepcopy(name.settings)})
    _adopted[:] = [name.settings]


def usable_device(name: str) -> Device | None:
    """The device a task planned for ``name`` may use in this process, or None
    (:func:`why_no_device` says why).

    The process's own ``eugo.device`` decides: a worker set to ``none`` never uses a device; the
    emulated device runs only where ``eugo.device`` is ``emulated`` (a CPU worker does not
    pretend); CuPy runs where ``auto`` or ``cupy`` finds a CUDA device. An invalid setting on
    this worker uses no device (and is reported where the worker starts). A task planned in
    another process for a local scheduler brings its plan's settings (:class:`PlannedDevice`).
    """
    _adopt_planned_settings(name)
    if _setting_problem() is not None:
        return None
    local = process_device()
    if local == "none" or (name == "emulated") != (local == "emulated"):
        return None
    device = get_device(name)
    if device is None and local == "cupy":
        _say_once(f"eugo.device is 'cupy' here but no CUDA device can run GPU tasks: "
                  f"{cupy_unusable_reason()}; GPU-planned tasks run their CPU path")
    if device is not None and device.unusable_reason is not None:
        return None  # switched off in this process (Device.disable said why)
    return device


def _setting_problem() -> str | None:
    """The first problem with this process's own settings that the device path reads
    (``eugo.device``, ``eugo.emulated.*``, the device settings), or None. A worker with an invalid
    setting uses no device: its GPU tasks run their CPU path."""
    problems = device_setting_problems()
    return problems[0] if problems else None


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("eugo: %s", message)


def why_no_device(name: str) -> str:
    """Why a task planned for device ``name`` finds none in this process (for its fallback
    reason and the worker's warning)."""
    problem = _setting_problem()
    if problem is not None:
        return f"invalid setting: {problem}"
    local = process_device()
    if local == "none":
        return "eugo.device is 'none' on this worker"
    if name == "emulated" and local != "emulated":
        return f"planned for the emulated device; this worker's eugo.device is {local!r}"
    if name != "emulated" and local == "emulated":
        return f"planned for {name}; this worker's eugo.device is 'emulated'"
    device = get_device(name)
    if device is None:
        return f"no CUDA device CuPy can use on this worker ({cupy_unusable_reason()})"
    if device.unusable_reason is not None:
        return f"the device is off in this process: {device.unusable_reason}"
    return f"no {name} device"


def _metered_copy(label: str, copy: Callable[[Any], Any], value: Any, nbytes: int) -> Any:
    meter = context_meter()
    with meter.meter(label):
        out = copy(value)
    meter.digest_metric(label, nbytes, "bytes")
    return out


#: Activities GPU tasks report (with unit "tasks"): what ran where. A fallback also reports
#: ``eugo-fallback-<category>``, one of :data:`FALLBACK_CATEGORIES`.
RAN_ON_DEVICE, RAN_ON_CPU = "eugo-ran-on-device", "eugo-ran-on-cpu"
FallbackCategory = Literal["device-error", "unsupported", "no-device", "host-chunk"]
FALLBACK_CATEGORIES: tuple[FallbackCategory, ...] = (
    "device-error", "unsupported", "no-device", "host-chunk")
_REASON_WORDS: dict[FallbackCategory, str] = {
    "device-error": "device error", "unsupported": "unsupported on device",
    "no-device": "no device", "host-chunk": "host-only chunk"}
_RECEIVE_WORDS = "device error on receive"
#: What a fallback reason eugo reports looks like: its words, a device error's kind in
#: parentheses ("device error (out-of-memory): EmulatedOutOfMemoryError"), then the detail. The
#: scheduler plugin accepts reports of this shape only.
FALLBACK_REASON = re.compile(
    rf"^({'|'.join(map(re.escape, [*_REASON_WORDS.values(), _RECEIVE_WORDS]))})"
    r"( \([a-z-]+\))?(: .*)?$", re.S)
_reported: set[tuple[str, str]] = set()


class _Ledger:
    """What the GPU-planned tasks of this process did, per task prefix (the plan's prefix,
    :attr:`DeviceCall.prefix`): tasks and seconds by outcome (:data:`RAN_ON_DEVICE`,
    :data:`RAN_ON_CPU`) and fallbacks by category (``eugo-fallback-<category>``). Seconds are
    each :class:`DeviceCall`'s own, timed around it (the CPU path included). Read by
    :mod:`eugo_dask.ran` (here, or from each worker through ``client.run``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tasks: Counter[tuple[str, str]] = Counter()
        self.seconds: dict[tuple[str, str], float] = {}

    def add(self, prefix: str, activity: str, tasks: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            if tasks:
                self.tasks[(prefix, activity)] += tasks
            if seconds:
                self.seconds[(prefix, activity)] = self.seconds.get((prefix, activity), 0.0) + seconds

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{"tasks" | "seconds": {prefix: {activity: value}}}`` (plain data: it crosses
        ``client.run``)."""
        out: dict[str, dict[str, dict[str, float]]] = {"tasks": {}, "seconds": {}}
        with self._lock:
            for name, counts in (("tasks", self.tasks), ("seconds", self.seconds)):
                for (prefix, activity), value in counts.items():
                    out[name].setdefault(prefix, {})[activity] = value
        return out


ledger = _Ledger()


def _ran(where: str, prefix: str) -> None:
    """Report one GPU task's outcome: a Fine Performance Metric the scheduler aggregates per
    task prefix, a count on the worker that ran it (``worker.eugo_ran``, which tells
    workers apart where several share a process, as in ``gen_cluster``), and one in this
    process's :data:`ledger` (whose seconds :meth:`DeviceCall.__call__` adds)."""
    _state.ran = where
    ledger.add(prefix, where, tasks=1)
    context_meter().digest_metric(where, 1, "tasks")
    worker = current_worker()
    if worker is not None:
        ran = getattr(worker, "eugo_ran", None)
        if ran is None:
            ran = worker.eugo_ran = Counter()
        ran[where] += 1


def _report_fallback(prefix: str, category: FallbackCategory, reason: str) -> None:
    ledger.add(prefix, f"eugo-fallback-{category}", tasks=1)
    context_meter().digest_metric(f"eugo-fallback-{category}", 1, "tasks")
    if (prefix, reason) in _reported:  # the reason once per prefix; the counts above
        return
    worker = current_worker()
    if worker is None:
        return
    _reported.add((prefix, reason))
    worker.log_event(EVENT_TOPIC, {"fallback": reason[:MAX_EVENT_TEXT],
                                   "prefix": prefix[:MAX_EVENT_TEXT]})


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




def _host_to_device(device: Device, ordinal: int | None = None, *, zero_d: bool = False
                    ) -> Callable[[Any], Any]:
    """Host arrays to device ``ordinal``; device arrays on another device move there. Inside a
    task scope the copies are asynchronous and timed by the scope's clock (bytes counted here);
    outside one each copy is complete and metered when it returns. A 0-d array stays on the host
    (an argument a device function may need as a host value) unless ``zero_d``."""
    min_ndim = 0 if zero_d else 1

    def convert(value: Any) -> Any:
        if (
            type(value) is np.ndarray
            and value.ndim >= min_ndim
            and device_dtype_ok(value.dtype)
            and not device.is_device_array(value)
        ):
            if device.current_task() is not None:
                context_meter().digest_metric("eugo-h2d", value.nbytes, "bytes")
                return device.to_device(value, ordinal)
            return _metered_copy("eugo-h2d", lambda v: device.to_device(v, ordinal), value,
                                 value.nbytes)
        where = device.ordinal_of(value)
        if ordinal is not None and where is not None and where != ordinal:
            return device.move(value, ordinal)  # a chain stays on one device
        return value

    return convert


def _device_of(value: Any) -> Device | None:
    """The device ``value`` lives on, or None for anything else (a host array, a scalar)."""
    if isinstance(value, EmulatedDeviceArray):
        return value._device
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(value, cupy.ndarray):
        return get_device("cupy")
    return None


def _to_host(value: Any) -> Any:
    """A device array as a host array (counted); anything else as it is."""
    device = _device_of(value)
    if device is None:
        return value
    try:
        return _metered_copy("eugo-d2h", device.to_host, value, value.nbytes)
    except Exception as exc:
        if device.note_error(exc) == STICKY:  # the value is lost with the device's memory
            _wait_for_restart()
        raise


def host_values(values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` with every device array in them copied to the host (counted), or ``values``
    itself where nothing changed."""
    host = {k: map_arrays(v, _to_host) for k, v in values.items()}
    return values if all(map(operator.is_, host.values(), values.values())) else host


def _host_only_chunk(value: Any) -> str | None:
    """The type name of a chunk no device holds (a masked or other ndarray subclass, a sparse
    matrix), or None: tasks with one run their CPU path (and say so)."""
    found: list[str] = []

    def check(v: Any) -> Any:
        if isinstance(v, np.ndarray) and type(v) is not np.ndarray:
            found.append(type(v).__name__)
        elif (not isinstance(v, np.ndarray) and hasattr(v, "__array_function__")
              and hasattr(v, "shape") and _device_of(v) is None):
            found.append(type(v).__name__)
        return v

    map_arrays(value, check)
    return found[0] if found else None


class ZeroDimensionalResult(TypeError):
    """A device task produced a 0-d array: NumPy would have handed back either a scalar or a
    0-d array, and only the CPU path can say which (the planner keeps 0-d results on the host;
    this guards the rest)."""


def _check_no_0d(value: Any, device: Device) -> None:
    def check(v: Any) -> Any:
        if device.is_device_array(v) and v.ndim == 0:
            raise ZeroDimensionalResult("a 0-d device result; NumPy's type is the CPU path's")
        return v

    map_arrays(value, check)


def to_device(value: Any, device_name: str) -> Any:
    """Host->device transfer task: every numeric array in ``value`` moves to the device chosen
    for it (:meth:`~eugo_dask.devices.Device.select`); the copies are complete when it ends.

    Where the device fails (no room, a library or CUDA error), the value stays on the host and
    its consumers run their CPU path (and count the fallback); a sticky error also turns the
    device off in this process.
    """
    device = usable_device(device_name)
    if device is None or _cpu_path_active():
        return value
    try:
        # a 0-d array too: a key of its own is a GPU task's operand, which CuPy's ufuncs take
        # on the device only (array expressions make a scalar operand a 0-d array of its own)
        return map_arrays(value, _host_to_device(device, device.select(value), zero_d=True))
    except Exception as exc:
        if device.note_error(exc) is None:  # counted in device_stats()["device_errors"]
            raise
        return value


class DeviceDataLost(RuntimeError):
    """A device array could not be copied back: the device failed in a way that loses its
    memory (a sticky CUDA error). Restarting the worker recomputes the key."""


def to_host(value: Any, device_name: str) -> Any:
    """Device->host transfer task: every device array in ``value`` comes back as NumPy
    (whatever device it is on, and whatever this worker's own setting)."""
    try:
        return map_arrays(value, _to_host)
    except Exception as exc:
        device = get_device(device_name)
        kind = device.note_error(exc) if device is not None else None
        if kind is None:
            raise
        raise DeviceDataLost(
            f"eugo: a {device_name} result could not be copied back ({kind} error: "
            f"{type(exc).__name__}: {exc}); restart this worker to recompute it") from exc


def _receive(data: np.ndarray) -> Any:
    """An emulated device array arriving from another process: on this process's device where
    it may use one and has room, else the host array it carried."""
    device = usable_device("emulated")
    if device is None:
        return data
    try:
        assert isinstance(device, EmulatedDevice)
        return device.wrap(data)
    except MemoryError:
        _stats.add_fallback(f"{_RECEIVE_WORDS}: out of memory")
        return data


set_receive(_receive)


def receiving_as_host(original: Callable[[dict[str, Any], list[Any]], Any],
                      ) -> Callable[[dict[str, Any], list[Any]], Any]:
    """distributed's deserializer of CuPy arrays, ``original``, made to land a CuPy array
    arriving from another worker as a host array where this process cannot hold it (no usable
    GPU, or out of device memory), instead of failing inside deserialisation. ``original``
    itself where it is one already (:func:`eugo_dask.worker.install_receive_fallback` registers
    it)."""
    if getattr(original, "_eugo_receive", False):
        return original

    def receive(header: dict[str, Any], frames: list[Any]) -> Any:
        if usable_device("cupy") is not None:
            try:
                return original(header, frames)
            except MemoryError:  # cupy's OutOfMemoryError is one
                _stats.add_fallback(f"{_RECEIVE_WORDS}: out of memory")
        return _host_from_cupy_frames(header, frames)

    receive._eugo_receive = True  # type: ignore[attr-defined]
    return receive


def _host_from_cupy_frames(header: dict[str, Any], frames: list[Any]) -> np.ndarray:
    """What distributed's CuPy serializer sends (one host frame of the array's bytes, with its
    ``__cuda_array_interface__`` in the header), as a NumPy array."""
    raw = np.frombuffer(frames[0], dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(
        raw.view(np.dtype(header["typestr"])), shape=tuple(header["shape"]),
        strides=tuple(header["strides"]) if header.get("strides") else None).copy()


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
        return map_arrays(value, _host_to_device(device))

    def __reduce__(self):
        return (OnDevice, (self.func, self.device_name))

    def __repr__(self) -> str:
        return f"OnDevice({funcname(self.func)})"


def _identity(value: Any) -> Any:
    return value


def sources_on_device(inner_dsk: dict, is_source: Callable[[Any], bool], device_name: str,
                      done: dict[int, dict] | None = None) -> dict:
    """Rewrite the inner graph of a fused task so its sources land on the device. ``done``:
    the inner graphs rewritten so far, by the id of the original, read and filled in for the
    ones nested in this one (a linearly fused chunk task's inner graph is its own, the
    blockwise-fused one nested in it its layer's)."""
    out: dict[Any, Any] = {}
    for key, node in inner_dsk.items():
        parts = fused(node)
        if isinstance(node, DataNode) and is_source(node):
            out[key] = Task(key, OnDevice(_identity, device_name), DataNode(None, node.value))
        elif parts is not None:
            inner = done.get(id(parts.inner)) if done is not None else None
            if inner is None:
                inner = sources_on_device(parts.inner, is_source, device_name, done)
                if done is not None:
                    done[id(parts.inner)] = inner
            # (the node's own references: what it reads does not change)
            out[key] = new_task(key, FUSED_FUNC, (inner, *node.args[FUSED_INNER + 1:]),
                                NO_KWARGS, node.dependencies)
        elif type(node) is Task and is_source(node):
            out[key] = new_task(key, _on_device(node.func, device_name), node.args,
                                node.kwargs, node.dependencies)
        else:
            out[key] = node
    return out


def _on_device(func: Callable[..., Any], device_name: str) -> OnDevice:
    """One :class:`OnDevice` per source function and device, shared by the chunks of a layer
    (a linearly fused chunk task's sources are rewritten chunk by chunk)."""
    try:
        return _shared_on_device(func, device_name)
    except TypeError:  # an unhashable function
        return OnDevice(func, device_name)


_shared_on_device = functools.lru_cache(maxsize=256)(OnDevice)


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
        if _cpu_path_active():  # inside another task's CPU path: that task reported itself
            return self._cpu_path(args, kwargs)
        started, _state.ran = time.perf_counter(), None
        try:
            return self._run(args, kwargs)
        finally:  # the seconds go to the outcome _ran recorded (none if it raised before)
            if _state.ran is not None:
                ledger.add(self.prefix, _state.ran, seconds=time.perf_counter() - started)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if self.cpu_only:  # re-routed by the scheduler: the CPU path is the plan now
            result = self._cpu_path(args, kwargs)
            _ran(RAN_ON_CPU, self.prefix)
            return result
        device = usable_device(self.device_name)
        if device is None:
            return self._fall_back("no-device", why_no_device(self.device_name), args, kwargs)
        host_only = _host_only_chunk((args, kwargs))
        if host_only is not None:
            return self._fall_back("host-chunk", host_only, args, kwargs)
        ordinal = device.select((args, kwargs))  # where most of the inputs already are
        failed: Exception | None = None
        try:
            # the scope makes the device current, runs on its thread's stream and waits for the
            # work at its end: a fault raises here, and the clock holds device time
            with device.task(ordinal) as clock:
                convert = _host_to_device(device, ordinal)
                device_args = map_arrays(args, convert)
                device_kwargs = map_arrays(kwargs, convert)
                clock.mark("eugo-h2d")
                result = self.func(*device_args, **device_kwargs)
                _check_no_0d(result, device)
                clock.mark("eugo-device-compute")
        except Exception as exc:
            failed = exc
        if failed is not None:
            # (outside the except clause: an error of the CPU path is raised as plain Dask
            # raises it, not chained to the device's)
            kind = device.note_error(failed)  # counted; a sticky error turns the device off
            if kind is None:
                return self._fall_back("unsupported", type(failed).__name__, args, kwargs,
                                       failed)
            # the original arguments: host arrays as they came, device arrays of earlier tasks
            return self._fall_back("device-error", type(failed).__name__, args, kwargs, failed,
                                   kind=kind)
        meter = context_meter()
        for label, seconds in clock.seconds.items():
            meter.digest_metric(label, seconds, "seconds")
        host_only = _host_only_chunk(result)
        if host_only is not None:  # it ran on host chunks after all (one embedded in the task)
            reason = f"{_REASON_WORDS['host-chunk']}: {host_only}"
            _stats.add_fallback(reason)
            _report_fallback(self.prefix, "host-chunk", reason)
            _ran(RAN_ON_CPU, self.prefix)
            return result
        _stats.add(tasks=1)
        _ran(RAN_ON_DEVICE, self.prefix)
        return result

    def _fall_back(self, category: FallbackCategory, detail: str, args: tuple, kwargs: dict,
                   exc: Exception | None = None, *, kind: str | None = None) -> Any:
        words = _REASON_WORDS[category] if kind is None else f"{_REASON_WORDS[category]} ({kind})"
        reason = f"{words}: {detail}"
        # (the copies back first: a failure there is the device's, not the task's own)
        args, kwargs = map_arrays(args, _to_host), map_arrays(kwargs, _to_host)
        try:
            result = self._cpu_path(args, kwargs)
        except Exception as own:
            # the task's own error (a user function's, NumPy's): what plain Dask raises. It is
            # no fallback: nothing ran in the device's stead, and nothing is counted as one
            self._log_own_error(reason, exc, own)
            raise
        _stats.add_fallback(reason)
        _report_fallback(self.prefix, category, reason)
        if self.prefix not in _logged_prefixes:
            _logged_prefixes.add(self.prefix)
            logger.warning(
                "eugo: %s tasks fell back to the CPU (%s%s); later fallbacks of this prefix "
                "are logged at DEBUG on %s",
                self.prefix,
                reason,
                f": {exc}" if exc is not None else "",
                _task_logger.name,
            )
        else:
            _task_logger.debug("%s fell back to the CPU: %s", self.prefix, reason)
        _ran(RAN_ON_CPU, self.prefix)
        return result

    def _log_own_error(self, reason: str, device_error: Exception | None,
                       own: Exception) -> None:
        """Say (once per prefix at INFO, then at DEBUG) that a task raised on its CPU path."""
        if device_error is not None and type(device_error) is type(own):
            where = "on the device and again on its CPU path"
        else:
            where = f"on its CPU path (run for {reason})"
        message = (f"eugo: a task of {self.prefix} raised {type(own).__name__} {where}: the "
                   "task's own error, raised to the caller as plain Dask raises it; no fallback "
                   "counted")
        if self.prefix not in _own_error_prefixes:
            _own_error_prefixes.add(self.prefix)
            logger.info("%s (later ones at DEBUG on %s): %s", message, _task_logger.name, own)
        else:
            _task_logger.debug("%s: %s", message, own)

    def _cpu_path(self, args: tuple, kwargs: dict) -> Any:
        # inputs may be device arrays (a fallback after the copies, or a re-routed task whose
        # inputs were made on a device): the CPU path reads host copies
        args, kwargs = map_arrays(args, _to_host), map_arrays(kwargs, _to_host)
        with _cpu_path():
            return self.func(*args, **kwargs)


class DualCall(DeviceCall):
    """A task that can run on either device ("dual", ``eugo.dispatch: dual``): its inputs and
    result live on the host, and the scheduler plugin decides where it runs just before it can
    (:mod:`eugo_dask.dispatch`).

    On a worker that granted it the GPU slot (one unit of ``resource``: the plugin asked for
    it) it copies its host inputs to the device, runs there and copies its result back, all
    inside the task, through the device's copy engine; a failure there runs its CPU path, as a
    GPU task's does. Anywhere else (a CPU worker, a GPU worker's thread without the slot, a
    local scheduler, a task the plugin could not decide) it runs its CPU path. Either way its
    result is a host array, the CPU path's value. ``cost``: its estimated seconds on a CPU
    thread and on a GPU slot, which the scheduler plugin weighs (read back from the graph where
    the pass runs again over it)."""

    __slots__ = ("resource", "cost")

    def __init__(self, func: Callable[..., Any], device_name: str, prefix: str,
                 resource: str, cost: tuple[float, float] | None = None,
                 cpu_only: bool = False) -> None:
        super().__init__(func, device_name, prefix, cpu_only)
        self.resource = resource
        self.cost = cost

    def __reduce__(self):
        return (DualCall, (self.func, self.device_name, self.prefix, self.resource, self.cost,
                           self.cpu_only))

    def __repr__(self) -> str:
        return f"DualCall({funcname(self.func)}, {self.device_name!r})"

    def _run(self, args: tuple, kwargs: dict) -> Any:
        granted = granted_resources()
        if self.cpu_only or not granted or granted.get(self.resource, 0) < 1:
            _ran(RAN_ON_CPU, self.prefix)
            return self._cpu_path(args, kwargs)
        return map_arrays(super()._run(args, kwargs), _to_host)


def _host_value(value: Any, device_name: str) -> Any:
    """A re-routed host->device copy: the value stays on the host."""
    return value


def cpu_path_task(task: Any) -> Any:
    """``task`` (a GPU task or a copy to the device) rewritten to run its CPU path anywhere."""
    if type(task) is not Task:
        return task
    if isinstance(task.func, DualCall):
        func: Callable[..., Any] = DualCall(task.func.func, task.func.device_name,
                                            task.func.prefix, task.func.resource,
                                            task.func.cost, cpu_only=True)
    elif isinstance(task.func, DeviceCall):
        func = DeviceCall(task.func.func, task.func.device_name, task.func.prefix,
                          cpu_only=True)
    elif task.func is to_device:
        func = _host_value
    else:
        return task
    return Task(task.key, func, *task.args, **task.kwargs)


def pace_token(consumed: Any) -> None:
    """A read's pacing token (:mod:`eugo_dask.pace`): runs on the GPU worker once the device
    task that consumed an earlier block ended, and hands the paced read None, so that all the
    read fetches from the GPU worker is that None, never the device result it waited for."""
    return None


def after_token(token: None, value: Any) -> Any:
    """A paced read: ``value`` is the read's own result (its original task, nested in the paced
    one and run as it was); ``token`` only made it wait, and is not handed to the read."""
    return value


def is_eugo_callable(func: Any) -> bool:
    """Whether ``func`` is one of the callables this module puts into graphs."""
    return (func in (to_device, to_host, _host_value, pace_token, after_token)
            or isinstance(func, (DeviceCall, OnDevice)))


__all__ = ["DeviceCall", "DualCall", "OnDevice", "after_token", "get_device", "is_eugo_callable",
           "pace_token", "to_device", "to_host", "usable_device"]
