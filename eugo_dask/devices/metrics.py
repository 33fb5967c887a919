"""The process's ``/metrics`` (a worker's, where prometheus_client is installed): ``eugo_device_*``
gauges of every device built in this process, read at scrape time."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from eugo_dask.devices.stats import device_memory_stats, device_stats

logger = logging.getLogger(__name__)

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
        results = GaugeMetricFamily("eugo_device_pinned_result_bytes",
                                    "Pinned host memory of the result pool: in results, and free.",
                                    labels=["device", "kind"])
        off = GaugeMetricFamily("eugo_device_disabled", "1 where the device is off in this process.",
                                labels=["device", "reason"])
        errors = CounterMetricFamily("eugo_device_errors", "Device errors by kind.", labels=["kind"])
        try:
            for stats in device_memory_stats():
                name = stats["device"]
                for entry in stats["ordinals"]:
                    labels = [name, str(entry["ordinal"])]
                    for kind in ("array_bytes", "array_peak_bytes", "pool_used_bytes",
                                 "pool_held_bytes", "pool_limit_bytes", "capacity_bytes",
                                 "fft_plan_bytes"):
                        if entry.get(kind) is not None:
                            memory.add_metric([*labels, kind.removesuffix("_bytes")], entry[kind])
                    plans.add_metric(labels, entry.get("fft_plans", 0))
                    in_flight.add_metric(labels, entry.get("tasks_in_flight", 0))
                pinned.add_metric([name], stats.get("pinned_bytes", 0))
                if "pinned_result_bytes" in stats:
                    free = stats.get("pinned_result_free_bytes", 0)
                    results.add_metric([name, "in_results"], stats["pinned_result_bytes"] - free)
                    results.add_metric([name, "free"], free)
                off.add_metric([name, stats.get("disabled") or ""], 1 if stats.get("disabled") else 0)
            for kind, n in device_stats()["device_errors"].items():
                errors.add_metric([kind], n)
        except Exception:  # a scrape never raises
            logger.exception("eugo: collecting device metrics failed")
        yield from (memory, plans, in_flight, pinned, results, off, errors)


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
