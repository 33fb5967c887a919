"""what_ran(): the report of what ran where, on a local scheduler and on a LocalCluster with the
scheduler plugin, against the counters the tasks themselves keep."""

from __future__ import annotations

import time

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask.plugin import EugoSchedulerPlugin
from eugo_dask.runtime import get_device
from eugo_dask.testing import emulated_settings

pytestmark = pytest.mark.timeout(240)


def _pipeline():
    """GPU work (sin, a product, chunk sums) beside CPU work (the random reads, aggregation)."""
    x = da.random.default_rng(0).random((200, 200), chunks=50)
    return (np.sin(x) @ x.T).sum(axis=0) + x.mean()


def test_local_counts_are_what_ran_and_fallbacks_show(emulated):
    y = _pipeline()
    with dask.config.set(scheduler="threads"):
        y.compute()  # outside the block: not counted
        before = eugo_dask.device_stats()
        get_device("emulated").inject_fault("out-of-memory", count=2)
        with eugo_dask.what_ran() as report:
            result = y.compute()
        after = eugo_dask.device_stats()
    np.testing.assert_allclose(result, _pipeline().compute(optimizations=[]), rtol=1e-12)
    totals = report.totals()
    # the GPU tasks that ran on a device are device_stats' count of the block, no more
    assert totals["on_gpu"] == after["tasks"] - before["tasks"] > 0
    assert totals["fallbacks"] == after["fallbacks"] - before["fallbacks"] == 2
    assert report.fallback_reasons == {
        "device error (out-of-memory): EmulatedOutOfMemoryError": 2}
    gpu_rows = {p: r for p, r in report.rows.items() if r.planned_gpu}
    assert sum(r.fallbacks.get("device-error", 0) for r in gpu_rows.values()) == 2
    for row in gpu_rows.values():  # each GPU-planned task says where it ran
        assert row.planned_gpu == row.on_gpu + row.on_cpu
        assert row.gpu_s is not None and row.gpu_s > 0
    # against the plan: the block's one plan put as many tasks on the GPU as reported
    assert report.plans["graphs"] == 1
    assert report.plans["gpu_tasks"] == totals["planned_gpu"]
    # the CPU side: the reads and the aggregation, counted and timed by Dask's callbacks
    assert report.rows["random"].on_cpu == 16 and report.rows["random"].planned_gpu == 0
    assert report.rows["random"].cpu_s is not None
    assert report.copies["to_device"]["bytes"] == after["h2d_bytes"] - before["h2d_bytes"] > 0
    assert report.copies["to_host"]["arrays"] == after["d2h_count"] - before["d2h_count"] > 0
    text = str(report)
    assert "what ran where, on a local scheduler" in text
    assert "2 x device error (out-of-memory)" in text and "random " in text
    html = report._repr_html_()
    assert "<table class='eugo'>" in html and ">random<" in html
    assert report.to_dict()["totals"] == totals


def test_outside_the_block_nothing_is_counted(emulated):
    y = _pipeline()
    with dask.config.set(scheduler="sync"), eugo_dask.what_ran() as report:
        pass
    y.compute(scheduler="sync")
    assert report.rows == {} and report.totals()["on_gpu"] == 0
    assert any("planned no graph" in note for note in report.notes)


def test_processes_scheduler_says_what_it_could_not_see(emulated):
    y = np.sin(da.ones((100, 100), chunks=50)) + 1
    with dask.config.set(scheduler="processes", num_workers=2), eugo_dask.what_ran() as report:
        y.compute()
    planned = report.plans["gpu_tasks"]
    assert planned > 0 and report.totals()["planned_gpu"] == 0  # outcomes in the pool's processes
    assert any(f"{planned} of {planned} GPU-planned tasks ran where this process cannot read"
               in note for note in report.notes)


def _settled(plugin, timeout=30):
    """The plugin's summary once the workers' reports (with their heartbeats) account for every
    GPU-planned task it saw finish."""
    deadline = time.monotonic() + timeout
    while True:
        summary = plugin.summary()
        planned = sum(s["planned_gpu"] for s in summary["prefixes"].values())
        reported = sum(summary["tasks"].get("gpu", {}).values()) + sum(
            n for p, n in summary["tasks"].get("cpu", {}).items() if p.startswith("eugo-gpu"))
        if reported >= planned or time.monotonic() > deadline:
            return summary
        time.sleep(0.1)


def test_local_cluster_counts_match_the_plugin_summary():
    with dask.config.set(emulated_settings()):
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                          resources={"GPU": 1}, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            client.register_plugin(EugoSchedulerPlugin())
            plugin = cluster.scheduler.plugins["eugo"]
            client.compute(_pipeline()).result(timeout=60)  # before the block: not counted
            before = _settled(plugin)
            with eugo_dask.what_ran() as report:
                client.compute(_pipeline()).result(timeout=60)
            after = _settled(plugin)
    assert report.scheduler == "distributed" and report.plugin is not None
    assert not [n for n in report.notes if "lag" in n]  # the reports arrived within the wait
    totals = report.totals()
    on_gpu = (sum(after["tasks"].get("gpu", {}).values())
              - sum(before["tasks"].get("gpu", {}).values()))
    planned = (sum(s["planned_gpu"] for s in after["prefixes"].values())
               - sum(s["planned_gpu"] for s in before["prefixes"].values()))
    assert totals["on_gpu"] == on_gpu == report.plugin["on_gpu"] > 0
    assert totals["planned_gpu"] == planned
    # tasks the plan kept on the CPU: the plugin's own per-prefix counts over the block
    for prefix, stats in after["prefixes"].items():
        if prefix.startswith("eugo-"):
            continue
        was = before["prefixes"].get(prefix, {"cpu_tasks": 0})["cpu_tasks"]
        if stats["cpu_tasks"] - was:
            assert report.rows[prefix].on_cpu == stats["cpu_tasks"] - was
    assert report.copies["to_device"]["bytes"] == after["bytes_h2d"] - before["bytes_h2d"] > 0
    assert report.plans["graphs"] == 1 and report.plans["gpu_tasks"] == planned
    assert "on a distributed cluster" in str(report)


def test_a_cluster_without_the_plugin_says_so():
    with dask.config.set(emulated_settings()):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                          resources={"GPU": 1}, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            with eugo_dask.what_ran() as report:
                client.compute(_pipeline()).result(timeout=60)
    assert report.plugin is None
    assert any("scheduler plugin is not registered" in n for n in report.notes)
    assert "not registered" in str(report)
