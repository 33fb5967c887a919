"""What a worker does for eugo when it starts: check its own settings, say whether its GPU can
be used, and receive device arrays safely.

The scheduler plugin installs :class:`EugoWorkerPlugin` on every worker, present and future
(``Scheduler.register_worker_plugin``), so a cluster needs nothing on its workers beyond
``eugo_dask`` being importable. At ``setup``:

- the worker's own ``eugo.*`` settings are checked (``DASK_EUGO__DEVICE=gpu``, a memory limit of
  ``-1``): each problem is logged as an error naming the key and what is allowed, and reported
  to the scheduler; the worker then uses no device (its GPU tasks run their CPU path and say why);
- a worker that advertises the GPU resource but cannot use a device (``eugo.device: none``, no
  CUDA device, a broken CuPy) logs a warning and reports it: it would otherwise run every GPU
  task on its CPU while the plan counts on the GPU;
- eugo's device arrays leave this worker as host arrays (:func:`send_device_values_as_host`):
  whoever fetches one (a CPU worker taking the results of a retiring GPU worker, a rebalance, a
  replica, a client) receives NumPy, and a GPU worker's device task copies it back to its device
  as it copies any host input. A worker without CuPy, which cannot rebuild a device array,
  never gets one to rebuild: a transfer that would fail for ever and hang the retirement of a
  GPU worker;
- a CuPy array sent to this worker lands as a host array where it cannot be held here
  (:func:`install_receive_fallback`), for peers that send device arrays
  (workers of another version of eugo);
- a worker in the process of its scheduler (and, as a rule, of the client that started them:
  ``LocalCluster(processes=False)``, ``gen_cluster``) has no settings of its own: the tasks it
  runs read the client's settings as they are when they run (``dask.config.set`` around a
  computation, made after the cluster started), so nothing is checked or reported at its start.
  Its GPU tasks that find no device say so when they run (their fallbacks' reasons);
- the worker gives idle device memory back (``eugo.device-idle-release``): the pools of a
  device that no task and no copy used for that long are released, in a thread started by a
  periodic callback of its event loop (never on the loop itself: freeing device memory waits
  for the device), which stops with the worker (no thread of eugo's outlives it). Cached FFT
  plans stay with the threads that made them (CuPy's plan caches are not safe to clear from
  another thread); a finished thread's are released.

Reports go to the scheduler on the worker's own stream (:data:`REPORT_OP`), where the scheduler
knows which worker sent them: an event on the ``eugo`` topic names its worker in a field anyone
(a client) can fill.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.serialize import Serialize, to_serialize
from tornado.ioloop import PeriodicCallback

from eugo_dask.config import (
    device_setting_problems,
    device_settings,
    process_device,
    worker_setting_problems,
)
from eugo_dask.context import running_schedulers
from eugo_dask.devices import import_cupy
from eugo_dask.graph import holds_eugo_device_value
from eugo_dask.runtime import (
    MAX_EVENT_TEXT,
    host_values,
    receiving_as_host,
    release_idle_devices,
    usable_device,
    why_no_device,
)

logger = logging.getLogger(__name__)

#: The op of a worker's report to the eugo scheduler plugin, on the worker's own stream.
REPORT_OP = "eugo-worker-report"


def _beside_a_scheduler() -> bool:
    """Whether a scheduler runs in this process too (``LocalCluster(processes=False)``,
    ``gen_cluster``): then so does, as a rule, the client that started it, and the settings the
    worker reads are that client's, which it changes around its computations."""
    return bool(running_schedulers())


def device_capability() -> tuple[str | None, str | None]:
    """(the device GPU tasks can use in this process, or None; why not, or None): the runtime's
    own answer (:func:`~eugo_dask.runtime.usable_device`, invalid settings included)."""
    name = "emulated" if not device_setting_problems() and process_device() == "emulated" else "cupy"
    if usable_device(name) is not None:
        return name, None
    return None, why_no_device(name)


class EugoWorkerPlugin(WorkerPlugin):
    """Installed on every worker by the eugo scheduler plugin (see the module docstring).

    Parameters
    ----------
    resource
        The worker resource that marks GPU workers (the scheduler plugin's ``eugo.resource``).
    report
        Whether to report to the scheduler (the eugo scheduler plugin, which handles
        :data:`REPORT_OP`, sets it: a scheduler without that handler would drop this worker's
        connection).
    """

    name = "eugo"
    idempotent = True

    def __init__(self, resource: str = "GPU", *, report: bool = False) -> None:
        self.resource = resource
        self.report = report

    def _report(self, worker: Any, kind: str, text: str) -> None:
        if not self.report:
            return
        message = {"op": REPORT_OP, "report": {kind: text[:MAX_EVENT_TEXT]}}
        if worker.thread_id == threading.get_ident():
            worker.batched_send(message)
        else:  # (as Worker.log_event does)
            worker.loop.add_callback(worker.batched_send, message)

    def setup(self, worker: Any) -> None:
        install_receive_fallback()
        send_device_values_as_host(worker)
        self._drive_idle_release(worker)
        if _beside_a_scheduler():
            return  # no settings of its own to check (see the module docstring)
        device_problems = device_setting_problems()
        for problem in worker_setting_problems():
            logger.error("eugo: %s%s", problem,
                         "; this worker uses no device" if problem in device_problems else "")
            self._report(worker, "invalid-setting", problem)
        resources = getattr(getattr(worker, "state", None), "total_resources", {}) or {}
        device, why = device_capability()
        worker.eugo_device = device  # what this worker reports it can use (tests read it)
        if resources.get(self.resource) and device is None:
            logger.warning("eugo: this worker advertises %s=%s but cannot use a device (%s): "
                           "its GPU tasks run their CPU path", self.resource,
                           resources[self.resource], why)
            self._report(worker, "no-device", str(why))

    @staticmethod
    def _drive_idle_release(worker: Any) -> None:
        try:
            idle_s = device_settings().idle_release_s
        except ValueError:  # reported in setup
            return
        if idle_s is None or "eugo-idle-release" in worker.periodic_callbacks:
            return
        callback = PeriodicCallback(_release_idle_devices_off_the_loop, max(idle_s / 4, 0.01) * 1000)
        worker.periodic_callbacks["eugo-idle-release"] = callback  # stopped when the worker closes
        callback.start()


async def _release_idle_devices_off_the_loop() -> None:
    """The idle release in a thread of its own: it frees pool blocks (``cudaFree`` waits for
    the whole device) and must not stall the event loop. The periodic callback awaits it, so
    one runs at a time."""
    await asyncio.to_thread(release_idle_devices)


def install_receive_fallback() -> bool:
    """Make a CuPy array arriving from another worker land as a host array where this worker
    cannot hold it (:func:`~eugo_dask.runtime.receiving_as_host`), instead of failing inside
    deserialisation. Needs CuPy importable here; returns whether it was installed."""
    try:
        cupy = import_cupy()  # no GPU needed to import it
        from distributed.protocol.serialize import dask_deserialize

        # distributed registers its CuPy serializers on first use; they need rmm or numba
        original = dask_deserialize.dispatch(cupy.ndarray)
    except ImportError as e:
        logger.debug("eugo: no receive fallback for CuPy arrays here (%s)", e)
        return False
    receive = receiving_as_host(original)
    if receive is not original:
        dask_deserialize.register(cupy.ndarray)(receive)
    return True


def send_device_values_as_host(worker: Any) -> None:
    """Have ``worker`` send eugo's device arrays among the values peers and clients fetch from
    it (its ``get_data`` handler: dependencies, replicas, retirement, rebalancing, gathering) as
    host arrays, copied back off the event loop. Its own copies stay on its device, and values
    that are not eugo's (:func:`~eugo_dask.graph.holds_eugo_device_value`: a user's own CuPy
    chunks) leave as they are, as in plain Dask."""
    handler = worker.handlers.get("get_data")
    if handler is None or getattr(handler, "_eugo_host", False):
        return

    async def get_data(comm: Any, *args: Any, **kwargs: Any) -> Any:
        return await handler(_HostDataComm(comm), *args, **kwargs)

    get_data._eugo_host = True  # type: ignore[attr-defined]
    worker.handlers["get_data"] = get_data


class _HostDataComm:
    """A comm whose ``write`` sends the device arrays of a ``get_data`` reply as host arrays;
    everything else is the comm's own."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def write(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        data: dict[Any, Any] = (msg.get("data") if type(msg) is dict else None) or {}
        ours = [k for k in data if holds_eugo_device_value(k)]
        if ours:
            values = {k: _unwrapped(data[k]) for k in ours}
            host = await asyncio.to_thread(host_values, values)
            if host is not values:
                msg = {**msg, "data": {**data, **{k: to_serialize(v) for k, v in host.items()}}}
        return await self._comm.write(msg, *args, **kwargs)


def _unwrapped(value: Any) -> Any:
    return value.data if isinstance(value, Serialize) else value
