"""eugo_dask.metrics: the scheduler's /metrics says what the workers report they ran."""

from __future__ import annotations

import time
import urllib.request

import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import eugo_dask
from eugo_dask.metrics import EugoCollector
from eugo_dask.testing import emulated_gpu_cluster

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(120)

A = np.random.default_rng(3).random((300, 200))


def pipeline():
    x = da.from_array(A, chunks=100)
    return (np.exp(x / 4) @ x.T).sum(axis=0)


def scrape(client) -> dict[str, dict[tuple, float]]:
    """The eugo_* samples of the scheduler's /metrics: name -> {sorted labels: value}."""
    url = client.dashboard_link.replace("/status", "/metrics")
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("eugo_"):
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_are_what_the_workers_ran():
    with emulated_gpu_cluster(cpu_workers=1) as client:
        eugo_dask.reset_device_stats()  # this process's counters: earlier tests' work too
        assert_eq(client.compute(pipeline()).result(timeout=60), (np.exp(A / 4) @ A.T).sum(axis=0))
        worker = {name: stats for name, stats in (
            client.run(lambda dask_worker: (dask_worker.name, eugo_dask.device_stats()))).values()}
        # workers share this process: its device counters are the GPU worker's
        ran, h2d = worker["gpu"]["tasks"], worker["gpu"]["h2d_bytes"]
        assert ran > 0 and h2d > 0
        deadline = time.monotonic() + 30  # the counts arrive with the workers' heartbeats
        while True:
            samples = scrape(client)
            on_gpu = sum(v for labels, v in samples.get("eugo_tasks_total", {}).items()
                         if ("device", "gpu") in labels)
            if on_gpu >= ran or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert on_gpu == ran
        transfer = samples["eugo_transfer_bytes_total"]
        assert transfer[(("direction", "host_to_device"),)] == h2d
        assert samples["eugo_pass_errors_total"][()] == 0
        assert samples["eugo_plugin_errors_total"][()] == 0
        assert samples["eugo_gpu_workers_without_device"][()] == 0
        assert samples["eugo_metrics_errors_total"][()] == 0


def test_a_scheduler_without_the_plugin_exposes_only_the_error_counter():
    class Scheduler:
        plugins: dict = {}

    scheduler = Scheduler()
    collector = EugoCollector()
    collector.attach(scheduler)
    names = [family.name for family in collector.collect()]
    assert names == ["eugo_metrics_errors"]


def test_a_failing_scrape_is_counted_not_raised():
    class Broken:
        def summary(self):
            raise RuntimeError("boom")

    class Scheduler:
        plugins = {"eugo": Broken()}

    scheduler = Scheduler()
    collector = EugoCollector()
    collector.attach(scheduler)
    (errors,) = list(collector.collect())
    assert errors.name == "eugo_metrics_errors" and errors.samples[0].value == 1


def _digest(label, value, unit):
    from distributed.metrics import context_meter

    context_meter.digest_metric(label, value, unit)
    return value


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_bad_number_from_a_task_is_dropped_and_counted(bad):
    from distributed import wait

    from eugo_dask.dashboard import EugoDashboard

    with emulated_gpu_cluster(cpu_workers=1) as client:
        poisoned = client.submit(_digest, "eugo-ran-on-device", bad, "tasks", key="poison-1")
        wait(poisoned, timeout=30)
        assert_eq(client.compute(pipeline()).result(timeout=60), (np.exp(A / 4) @ A.T).sum(axis=0))
        scheduler = client.cluster.scheduler
        plugin = scheduler.plugins["eugo"]

        def reported():
            return plugin.summary()["tasks"].get("gpu", {})

        deadline = time.monotonic() + 30  # the counts arrive with the workers' heartbeats
        while not (reported() and ("execute", "poison", "eugo-ran-on-device", "tasks")
                   in scheduler.cumulative_worker_metrics):
            assert time.monotonic() < deadline, scheduler.cumulative_worker_metrics
            time.sleep(0.2)
        summary = plugin.summary()  # the bad value did not break it, nor the other counts
        assert summary["dropped_reports"] == 1 and "poison" not in summary["tasks"].get("gpu", {})
        assert sum(reported().values()) > 0
        samples = scrape(client)
        assert samples["eugo_dropped_worker_reports"][()] == 1
        assert samples["eugo_metrics_errors_total"][()] == 0
        assert sum(samples["eugo_tasks_total"].values()) > 0
        page = EugoDashboard(scheduler)
        page.update()  # the /eugo page's periodic update
        assert "1</b> worker reports dropped" in page.summary.root.text and page.errors == 0


def _hold(event_name: str) -> int:
    from distributed import Event

    Event(event_name).wait(timeout=90)
    return 1


def _backlog(client) -> float:
    return scrape(client)["eugo_gpu_backlog"][()]


def _until(condition, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_gpu_backlog_rises_with_queued_gpu_work_and_returns_to_zero():
    """The metric GPU groups scale on: eugo's GPU tasks waiting and running. The GPU worker's one
    slot is held by a task of the user's, so the computation's GPU tasks queue behind it."""
    from distributed import Event

    with emulated_gpu_cluster(cpu_workers=1) as client:
        assert _backlog(client) == 0
        hold = Event("hold-gpu")
        blocker = client.submit(_hold, "hold-gpu", resources={"GPU": 1}, pure=False)
        gpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "gpu")
        _until(lambda: client.processing().get(gpu), "the blocker holds the GPU")
        future = client.compute(pipeline())  # (eugo on: emulated_gpu_cluster's settings)
        plugin = client.cluster.scheduler.plugins["eugo"]
        _until(lambda: _backlog(client) > 0, "GPU work queued behind the blocker")
        queued = _backlog(client)
        time.sleep(1)  # held: nothing drains
        assert _backlog(client) == queued == plugin.gpu_backlog() == len(plugin.gpu_keys)
        hold.set()
        assert blocker.result(timeout=60) == 1
        assert_eq(future.result(timeout=60), (np.exp(A / 4) @ A.T).sum(axis=0))
        _until(lambda: _backlog(client) == 0, "the backlog drains to zero")


@pytest.mark.parametrize("on_demand", [True, False])
def test_a_gpu_group_at_zero_is_woken_by_the_backlog(on_demand):
    """An autoscaled GPU group at zero: with eugo.gpu-workers-on-demand (the chart sets it on the
    scheduler) a graph is planned for the GPU workers yet to start, and its GPU tasks wait and
    show in eugo_gpu_backlog, which the autoscaler scales the group up on; once a GPU worker
    joins they run on it. Without it, the graph runs on the CPU and the backlog stays zero (the
    group would never wake)."""
    import dask
    from distributed import Client, LocalCluster, Worker

    from eugo_dask.plugin import EugoSchedulerPlugin
    from eugo_dask.testing import device_tasks, emulated_settings

    settings = emulated_settings() | {"eugo.gpu-workers-on-demand": on_demand}
    with dask.config.set(settings), LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        cluster.worker_spec["cpu"] = {"cls": Worker, "options": {"nthreads": 1}}
        cluster.scale(1)
        with Client(cluster) as client:
            client.register_plugin(EugoSchedulerPlugin())
            client.wait_for_workers(1, timeout=60)
            future = client.compute(pipeline())
            expected = (np.exp(A / 4) @ A.T).sum(axis=0)
            if not on_demand:
                assert_eq(future.result(timeout=60), expected)
                assert _backlog(client) == 0
                return
            _until(lambda: _backlog(client) > 0, "GPU work waits for a GPU worker")
            time.sleep(1)
            assert not future.done() and _backlog(client) > 0
            cluster.worker_spec["gpu"] = {"cls": Worker, "options": {"nthreads": 1, "resources": {"GPU": 1}}}
            cluster.scale(2)  # what the autoscaler does
            assert_eq(future.result(timeout=60), expected)
            ran = client.run(lambda dask_worker: device_tasks(dask_worker))
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            assert {names[a]: n > 0 for a, n in ran.items()} == {"cpu": False, "gpu": True}
            _until(lambda: _backlog(client) == 0, "the backlog drains to zero")
