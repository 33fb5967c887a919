"""Prometheus metrics for the scheduler's ``/metrics`` endpoint, all named ``eugo_*``.

distributed serves the process-global ``prometheus_client.REGISTRY`` on ``/metrics``; one
collector registered there reads, at scrape time, the ``eugo`` plugin of the scheduler that
registered it (``scheduler.plugins["eugo"]``, however the plugin got there: preload or
``client.register_plugin``). It is registered once per process (a later call points it at the
newest scheduler) and a scrape never raises: a failure is logged and counted in
``eugo_metrics_errors_total``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from eugo_dask.pass_log import pass_stats

logger = logging.getLogger(__name__)

_lock = threading.Lock()


class EugoCollector:
    """Turns the eugo plugin's counters into metric families at scrape time."""

    def __init__(self) -> None:
        self._scheduler: weakref.ref[Any] | None = None
        self.scrape_errors = 0

    def attach(self, scheduler: Any) -> None:
        self._scheduler = weakref.ref(scheduler)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            families = list(self._families(CounterMetricFamily, GaugeMetricFamily))
        except Exception:  # a broken scrape must not break /metrics
            self.scrape_errors += 1
            logger.exception("eugo: collecting metrics failed")
            families = []
        errors = CounterMetricFamily("eugo_metrics_errors", "Failed eugo metric collections.")
        errors.add_metric([], self.scrape_errors)
        yield from families
        yield errors

    def _families(self, counter: Any, gauge: Any) -> Iterator[Any]:
        scheduler = self._scheduler() if self._scheduler is not None else None
        plugin = scheduler.plugins.get("eugo") if scheduler is not None else None
        if plugin is None:
            return
        summary = plugin.summary()
        tasks = counter("eugo_tasks", "eugo's tasks by where they ran (GPU tasks as workers "
                        "report) and prefix.", labels=["device", "prefix"])
        for device, by_prefix in summary["tasks"].items():
            for prefix, n in by_prefix.items():
                tasks.add_metric([device, prefix], n)
        transfer = counter("eugo_transfer_bytes", "Bytes copied between host and device, as "
                           "workers report.", labels=["direction"])
        transfer.add_metric(["host_to_device"], summary["bytes_h2d"])
        transfer.add_metric(["device_to_host"], summary["bytes_d2h"])
        fallbacks = counter("eugo_fallbacks", "GPU tasks that ran their CPU path, by category.",
                            labels=["category"])
        for category, n in summary["fallbacks"].items():
            fallbacks.add_metric([category], n)
        predicted = counter("eugo_predicted_seconds",
                            "Estimated seconds of finished planned tasks, by prefix.",
                            labels=["prefix"])
        actual = counter("eugo_actual_seconds",
                         "Measured compute seconds of finished planned tasks, by prefix.",
                         labels=["prefix"])
        for prefix, stats in summary["prefixes"].items():
            predicted.add_metric([prefix], stats["predicted_s"])
            actual.add_metric([prefix], stats["actual_s"])
        saved = gauge("eugo_saved_seconds", "Estimated task-seconds saved by GPU tasks that ran "
                      "on a device, against all-CPU.")
        saved.add_metric([], summary["estimated_saved_s"])
        without = gauge("eugo_gpu_workers_without_device",
                        "Workers advertising the GPU resource that cannot use a device.")
        without.add_metric([], len(summary["workers_without_device"]))
        invalid = gauge("eugo_workers_with_invalid_settings",
                        "Workers whose own eugo settings are invalid (they use no device).")
        invalid.add_metric([], len(summary["invalid_settings"]))
        dropped = gauge("eugo_dropped_worker_reports",
                        "Series of workers' eugo reports dropped: their total is not a finite "
                        "non-negative number (a task reported NaN, an infinity or a negative "
                        "value under an eugo label).")
        dropped.add_metric([], summary["dropped_reports"])
        errors = counter("eugo_plugin_errors", "Errors caught in the eugo scheduler plugin.")
        errors.add_metric([], summary["errors"])
        backlog = gauge("eugo_gpu_backlog", "GPU work waiting and running: eugo's device tasks "
                        "and copies not finished (waiting for inputs or a worker, queued, "
                        "processing); what GPU worker groups scale on.")
        backlog.add_metric([], plugin.gpu_backlog())
        pass_errors = counter("eugo_pass_errors", "Failures of the eugo pass in this process "
                              "(each graph ran unchanged).")
        pass_errors.add_metric([], pass_stats()["pass_errors"])
        yield from (tasks, transfer, fallbacks, predicted, actual, saved, without, invalid,
                    dropped, errors, backlog, pass_errors)


_collector: EugoCollector | None = None


def register_metrics(scheduler: Any) -> bool:
    """Serve the eugo plugin of ``scheduler`` on ``/metrics``: the collector is registered with
    prometheus_client's default registry once per process.

    Returns False where prometheus_client is not installed."""
    global _collector
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    with _lock:
        if _collector is None:
            _collector = EugoCollector()
            REGISTRY.register(_collector)
        _collector.attach(scheduler)
    return True
