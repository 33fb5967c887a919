"""What submitting one large graph costs a separate-process scheduler, plain and with eugo
(used by ``pass_overhead.py``).

The client pickles the collection; the scheduler materializes it (Dask's optimization, then
eugo's pass, in an offload thread that shares the GIL with the event loop), orders it, then
builds its task states on the event loop (where eugo's plugin sees the graph). Measured per mode,
each on a fresh ``dask scheduler --preload eugo_dask.plugin`` with one GPU worker (emulated
device) that is paused, so nothing runs and only the submission is timed:

- ``loop_max_s``: the longest the scheduler's event loop went without running a 10 ms periodic
  callback (a client's heartbeat or a dashboard request waits that long);
- ``loop_blocked_s``: the time the loop lost in all stalls over 50 ms;
- ``update_s``, ``materialize_s``: the scheduler's own ``update-graph`` metrics;
- ``rss_peak_gib``: the scheduler process's peak resident memory growth over its idle size,
  sampled every 20 ms;
- ``tasks``: how many tasks the scheduler then holds (eugo's rewrite adds copy tasks).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from distributed.core import Status

from eugo_dask.testing import process_cluster

SAMPLE_S = 0.010
STALL_S = 0.050


def _start_loop_probe(dask_scheduler: Any) -> None:
    from tornado.ioloop import PeriodicCallback

    probe = {"last": time.monotonic(), "max": 0.0, "blocked": 0.0}

    def tick() -> None:
        now = time.monotonic()
        gap = now - probe["last"]
        probe["last"] = now
        probe["max"] = max(probe["max"], gap)
        if gap > STALL_S:
            probe["blocked"] += gap - SAMPLE_S

    callback = PeriodicCallback(tick, SAMPLE_S * 1000)
    callback.start()
    dask_scheduler._eugo_loop_probe = (callback, probe)


def _stop_loop_probe(dask_scheduler: Any) -> dict[str, float]:
    callback, probe = dask_scheduler._eugo_loop_probe
    callback.stop()
    return {"max": probe["max"], "blocked": probe["blocked"]}


def _pause(dask_worker: Any) -> None:
    dask_worker.status = Status.paused


def _task_count(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


def _graph_updates(client: Any) -> list[dict[str, Any]]:
    return [msg for _, msg in client.get_events("scheduler")
            if isinstance(msg, dict) and msg.get("action") == "update-graph"]


def measure_submission(build: Callable[[], Any], settings: dict[str, Any],
                       timeout_s: float = 1800) -> dict[str, Any]:
    """Submit ``build()`` under ``settings`` to a fresh scheduler; the figures above."""
    here = str(Path(__file__).resolve().parent)  # the processes unpickle this module's probes
    with tempfile.TemporaryDirectory() as logs, process_cluster(
            logs, workers={"gpu": {"gpu": True}}, pythonpath=[here]) as (cluster, client):
        client.run(_pause)
        scheduler = psutil.Process(cluster.pid("scheduler"))
        base = scheduler.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample_rss() -> None:
            while not done.wait(0.02):
                try:
                    peak[0] = max(peak[0], scheduler.memory_info().rss)
                except psutil.Error:
                    return

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        client.run_on_scheduler(_start_loop_probe)
        import dask

        with dask.config.set(settings):
            future = client.compute(build())
        deadline = time.monotonic() + timeout_s
        while not _graph_updates(client):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler took over {timeout_s} s to take the graph")
            time.sleep(0.2)
        loop = client.run_on_scheduler(_stop_loop_probe)
        done.set()
        sampler.join()
        (update,) = _graph_updates(client)
        if update.get("status") != "OK":
            raise RuntimeError(f"the scheduler did not take the graph: {update}")
        metrics = update["metrics"]
        tasks = client.run_on_scheduler(_task_count)
        client.cancel(future)
        # a paused worker can take the cluster's whole shutdown grace period to stop: it has
        # nothing to keep
        cluster.kill("gpu")
        return {"loop_max_s": loop["max"], "loop_blocked_s": loop["blocked"],
                "update_s": metrics["duration_seconds"],
                "materialize_s": metrics["materialization_duration_seconds"],
                "rss_peak_gib": (peak[0] - base) / 2**30, "tasks": tasks}
