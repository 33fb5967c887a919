"""A graph's machine use as the plugin records it: busy fractions that say what ran."""

from __future__ import annotations

import pytest

from eugo_dask.usage import GraphUsage


def compute(start, stop):
    return [{"action": "compute", "start": start, "stop": stop}]


def test_copies_in_flight_together_count_once():
    # copies ask for none of the GPU slot: on a GPU worker they run on several threads at once,
    # beside a kernel; the copies' busy time is when the worker had one in flight (summed per
    # task, two copies side by side made the link 200% busy)
    usage = GraphUsage("plan", 6, cpu_threads=2, gpu_slots=1, work=None)
    usage.ran("gpu", compute(0.0, 4.0))
    for start, stop in ((0.0, 2.0), (0.0, 2.0), (1.0, 3.0), (3.5, 4.0)):
        usage.ran("copies", compute(start, stop), worker="gpu-1")
    usage.ran("cpu", compute(0.0, 4.0))
    record = usage.to_dict()
    assert record["busy_s"] == {"cpu": 4.0, "gpu": 4.0, "copies": pytest.approx(3.5)}
    assert record["busy"]["copies"] == pytest.approx(3.5 / 4.0)


def test_copies_on_two_gpu_workers_each_count():
    usage = GraphUsage("plan", 3, cpu_threads=2, gpu_slots=2, work=None)
    usage.ran("copies", compute(0.0, 1.0), worker="gpu-1")
    usage.ran("copies", compute(0.0, 1.0), worker="gpu-2")
    usage.ran("copies", compute(0.5, 2.0), worker="gpu-1")  # after the span it overlaps: merged
    assert usage.to_dict()["busy_s"]["copies"] == pytest.approx(3.0)
    assert usage.to_dict()["busy"]["copies"] == pytest.approx(3.0 / (2 * 2.0))
