"""Prometheus metrics for the scheduler's ``/metrics`` endpoint, all named ``eugo_*``.

distributed serves the process-global ``prometheus_client.REGISTRY`` on ``/metrics``; one
collector registered there reads the live :class:`~eugo_dask.plugin.EugoSchedulerPlugin` at
scrape time. It is registered once per process (a second call is a no-op) and a scrape never
raises: a failure is logged and counted in ``eugo_metrics_errors_total``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False
_scrape_errors = 0


class EugoCollector:
    """Turns the plugin's counters into metric families at scrape time."""

    def collect(self) -> Iterator[Any]:
        global _scrape_errors
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            families = list(self._families(CounterMetricFamily, GaugeMetricFamily))
        except Exception:  # a broken scrape must not break /metrics
            _scrape_errors += 1
            logger.exception("eugo: collecting metrics failed")
            families = []
        errors = CounterMetricFamily("eugo_metrics_errors", "Failed eugo metric collections.")
        errors.add_metric([], _scrape_errors)
        yield from families
        yield errors

    @staticmethod
    def _families(counter, gauge) -> Iterator[Any]:
        from eugo_dask.plugin import current_plugin

        plugin = current_plugin()
        if plugin is None:
            return
        tasks = counter("eugo_tasks", "Tasks eugo planned, by the device they ran on and prefix.",
                        labels=["device", "prefix"])
        transfer = counter("eugo_transfer_bytes", "Bytes copied between host and device.",
                           labels=["direction"])
        fallbacks = counter("eugo_fallbacks", "GPU tasks that ran their CPU path, by reason.",
                            labels=["reason"])
        predicted = counter("eugo_predicted_seconds",
                            "Estimated seconds of finished planned tasks, by prefix.",
                            labels=["prefix"])
        actual = counter("eugo_actual_seconds",
                         "Measured compute seconds of finished planned tasks, by prefix.",
                         labels=["prefix"])
        for prefix, stats in list(plugin.prefixes.items()):
            tasks.add_metric(["gpu", prefix], stats.gpu_tasks)
            tasks.add_metric(["cpu", prefix], stats.cpu_tasks)
            predicted.add_metric([prefix], stats.predicted_s)
            actual.add_metric([prefix], stats.actual_s)
        transfer.add_metric(["host_to_device"], plugin.bytes_h2d)
        transfer.add_metric(["device_to_host"], plugin.bytes_d2h)
        for reason, n in list(plugin.fallbacks.items()):
            fallbacks.add_metric([reason], n)
        saved = gauge("eugo_saved_seconds",
                      "Estimated task-seconds saved by GPU placement against all-CPU.")
        saved.add_metric([], plugin.saved_s)
        errors = counter("eugo_plugin_errors", "Errors caught in the eugo scheduler plugin.")
        errors.add_metric([], plugin.errors)
        yield from (tasks, transfer, fallbacks, predicted, actual, saved, errors)


def register_metrics() -> bool:
    """Register the collector with prometheus_client's default registry, once per process.

    Returns False where prometheus_client is not installed."""
    global _registered
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    with _lock:
        if not _registered:
            REGISTRY.register(EugoCollector())
            _registered = True
    return True
