"""A real cluster of separate processes for the tests (:func:`eugo_dask.testing.process_cluster`,
with this repository first on the processes' path: tests define array-likes they unpickle), the
settings its clients compute with, and what its scheduler plugin and workers report."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import eugo_dask
from eugo_dask.testing import DASK_CLI, free_port
from eugo_dask.testing import process_cluster as _process_cluster

from .conftest import H200_SERVER

ROOT = str(Path(__file__).resolve().parents[1])
process_cluster = functools.partial(_process_cluster, pythonpath=[ROOT])

#: What the clients of the cluster tests compute with: eugo on the emulated device, every task
#: that can run there does.
SETTINGS = {
    "optimizations": [eugo_dask.eugo],
    "eugo.device": "emulated",
    "eugo.min-speedup": 0,
    "eugo.profile": H200_SERVER,
}
#: A worker preload that makes CuPy and the emulated device unusable (a CPU node pool's image).
POISON = str(Path(__file__).with_name("poison_device.py"))
HETEROGENEOUS = {
    "gpu": {"gpu": True, "nthreads": 2},
    "cpu-1": {"extra": ["--preload", POISON]},
    "cpu-2": {"extra": ["--preload", POISON]},
}


def plugin_summary(client):
    return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary())


def reported_summary(client, expected_gpu_tasks, timeout=30):
    """The plugin's summary once the workers' reports (sent with their heartbeats) account for
    ``expected_gpu_tasks`` GPU tasks that ran, on the device or their CPU path."""
    deadline = time.monotonic() + timeout
    while True:
        summary = plugin_summary(client)
        ran = sum(n for p, n in summary["tasks"].get("gpu", {}).items())
        ran += sum(n for p, n in summary["tasks"].get("cpu", {}).items() if p.startswith("eugo-gpu"))
        if ran >= expected_gpu_tasks or time.monotonic() > deadline:
            return summary
        time.sleep(0.2)


def placements(client):
    return client.run_on_scheduler(
        lambda dask_scheduler: list(dask_scheduler.plugins["eugo"].placements))


def worker_stats(client):
    stats = client.run(eugo_dask.device_stats)
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    return {names[a]: s for a, s in stats.items()}


def received_device_arrays(client):
    return client.run(lambda dask_worker: getattr(dask_worker, "eugo_device_arrays_received", []))


__all__ = ["DASK_CLI", "HETEROGENEOUS", "POISON", "SETTINGS", "free_port", "placements",
           "plugin_summary", "process_cluster", "received_device_arrays", "reported_summary",
           "worker_stats"]
