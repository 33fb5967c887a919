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
- a CuPy array sent to this worker lands as a host array where it cannot be held here
  (:func:`eugo_dask.runtime.install_receive_fallback`), so retiring a GPU worker, or a full
  device, never leaves a transfer failing forever;
- the worker's event loop gives idle device memory back (``eugo.device-idle-release``): pools
  and FFT plan caches of a device no task used for that long are released, from a periodic
  callback that stops with the worker (no thread of eugo's outlives it).

Reports go to the scheduler as events on the ``eugo`` topic, which the scheduler plugin reads.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from eugo_dask.config import (
    device_setting_problems,
    device_settings,
    process_device,
    worker_setting_problems,
)
from eugo_dask.runtime import (
    EVENT_TOPIC,
    MAX_EVENT_TEXT,
    install_receive_fallback,
    release_idle_devices,
    usable_device,
    why_no_device,
)

logger = logging.getLogger(__name__)


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
    """

    name = "eugo"
    idempotent = True

    def __init__(self, resource: str = "GPU") -> None:
        self.resource = resource

    def setup(self, worker: Any) -> None:
        device_problems = device_setting_problems()
        for problem in worker_setting_problems():
            logger.error("eugo: %s%s", problem,
                         "; this worker uses no device" if problem in device_problems else "")
            worker.log_event(EVENT_TOPIC, {"invalid-setting": problem[:MAX_EVENT_TEXT],
                                           "worker": worker.address})
        install_receive_fallback()
        self._drive_idle_release(worker)
        resources = getattr(getattr(worker, "state", None), "total_resources", {}) or {}
        device, why = device_capability()
        worker.eugo_device = device  # what this worker reports it can use (tests read it)
        if resources.get(self.resource) and device is None:
            logger.warning("eugo: this worker advertises %s=%s but cannot use a device (%s): "
                           "its GPU tasks run their CPU path", self.resource,
                           resources[self.resource], why)
            worker.log_event(EVENT_TOPIC, {"no-device": str(why)[:MAX_EVENT_TEXT],
                                           "worker": worker.address})

    @staticmethod
    def _drive_idle_release(worker: Any) -> None:
        try:
            idle_s = device_settings().idle_release_s
        except ValueError:  # reported above
            return
        if idle_s is None or "eugo-idle-release" in worker.periodic_callbacks:
            return
        callback = PeriodicCallback(release_idle_devices, max(idle_s / 4, 0.01) * 1000)
        worker.periodic_callbacks["eugo-idle-release"] = callback  # stopped when the worker closes
        callback.start()
