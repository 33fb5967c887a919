"""Observability on a real cluster: the /eugo page (in headless Chromium), the navigation link,
Prometheus metrics, fine performance metrics, and a plugin error that must not break them.

The scheduler is a separate process started with ``dask scheduler --preload eugo_dask.plugin``;
the GPU worker runs the emulated device."""

from __future__ import annotations

import re
import shutil
import time
import urllib.request

import dask
import pytest
from dask.array.utils import assert_eq

import eugo_dask

from .cluster import SETTINGS, plugin_summary, process_cluster, worker_stats
from .pipelines import EXPECTED, pipeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WORKERS = {"gpu": {"gpu": True, "nthreads": 2}, "cpu": {}}
CHROMIUM = shutil.which("chromium")


def _wait_for_gate(total, name):
    from distributed import Event

    if not Event(name).wait(timeout=120):
        raise TimeoutError(f"the gate {name} was never opened")
    return 1


def gated(gate):
    """A computation with device work whose last task waits until ``gate`` is set: its
    elementwise chain (new prefixes on the page: the fused random, exp and sum of each chunk)
    runs while the result cannot be ready."""
    import dask.array as da
    import numpy as np

    total = np.exp(da.random.default_rng(1).random((3000, 3000), chunks=(100, 3000)) * 3).sum()
    return dask.delayed(_wait_for_gate)(total, gate.name)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with process_cluster(tmp_path_factory.mktemp("dash"), workers=WORKERS) as (cluster, client):
        port = client.scheduler_info()["services"]["dashboard"]
        yield cluster, client, f"http://127.0.0.1:{port}"


def test_page_navigation_metrics_and_fine_metrics(cluster):
    _, client, base = cluster
    client.run(eugo_dask.reset_device_stats)
    with dask.config.set(SETTINGS):
        assert_eq(pipeline().compute(), EXPECTED)
    assert "Bokeh" in get(base + "/eugo")
    assert 'href="eugo"' in get(base + "/status")  # the top bar links to the page

    stats = worker_stats(client)["gpu"]
    deadline = time.monotonic() + 20  # workers report what they ran with their heartbeats
    while True:
        text = get(base + "/metrics")
        if (metric(text, "eugo_tasks_total", device="gpu") >= stats["tasks"]
                or time.monotonic() > deadline):
            break
        time.sleep(0.25)
    summary = plugin_summary(client)
    # the scheduler's counts agree with what the GPU worker's device layer did
    assert metric(text, "eugo_tasks_total", device="gpu") == stats["tasks"] > 0
    assert metric(text, "eugo_transfer_bytes_total", direction="host_to_device") == stats["h2d_bytes"]
    assert metric(text, "eugo_transfer_bytes_total", direction="device_to_host") == stats["d2h_bytes"]
    assert metric(text, "eugo_tasks_total", device="cpu", prefix="sum-aggregate") == \
        summary["prefixes"]["sum-aggregate"]["cpu_tasks"] > 0
    assert metric(text, "eugo_predicted_seconds_total") > 0
    assert metric(text, "eugo_actual_seconds_total") > 0
    assert "eugo_saved_seconds" in text and "eugo_fallbacks_total" in text

    wanted = {"eugo-h2d", "eugo-d2h", "eugo-device-compute"}
    deadline = time.monotonic() + 20  # workers send their metrics with their heartbeats
    while True:
        activities = client.run_on_scheduler(lambda dask_scheduler: {
            k[2] for k in dask_scheduler.cumulative_worker_metrics
            if isinstance(k, tuple) and len(k) == 4})
        if wanted <= activities or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= activities


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: run `apt-get install chromium` "
                    "(as root) to run this test; .ci/run does")
def test_page_in_headless_chromium_during_a_computation(cluster, tmp_path):
    """The page shows a computation while it runs: its last task waits on a gate the test
    opens only once the browser's plots hold the computation's device tasks."""
    from distributed import Event
    from playwright.sync_api import sync_playwright

    _, client, base = cluster
    with dask.config.set(SETTINGS):
        assert_eq(pipeline().compute(), EXPECTED)  # data on the page before it opens
    gate = Event("eugo-dashboard-gate", client=client)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(base + "/eugo")
            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0", timeout=30_000)
            tasks = """() => {
                const fig = Bokeh.documents[0].get_model_by_name('eugo-tasks');
                const data = fig && fig.renderers.length ? fig.renderers[0].data_source.data : null;
                return data ? Array.from(data.prefix) : [];
            }"""
            page.wait_for_function(f"() => ({tasks})().length > 0", timeout=30_000)
            before = page.evaluate(tasks)
            # the pipeline's machine use: its makespan against its plan's work bound
            use = """() => {
                const table = Bokeh.documents[0].get_model_by_name('eugo-machine-use');
                const data = table ? table.source.data : null;
                return data ? {ratio: Array.from(data.ratio), gpu: Array.from(data.gpu)} : null;
            }"""
            page.wait_for_function(
                f"() => {{ const u = ({use})(); return u && u.ratio.some(r => r.endsWith('x')); }}",
                timeout=30_000)
            machine = page.evaluate(use)
            with dask.config.set(SETTINGS):
                running = client.compute(gated(gate))
            # (the new computation's device prefix appears while its last task waits)
            page.wait_for_function(f"""() => ({tasks})().some(
                p => p.startsWith('eugo-gpu') && !{before!r}.includes(p))""", timeout=60_000)
            prefixes = page.evaluate(tasks)
            summary = page.evaluate("() => Bokeh.documents[0].get_model_by_name('eugo-summary').text")
            assert not running.done()  # shown during the computation, not after it
            time.sleep(1)
            page.screenshot(path=str(tmp_path / "eugo.png"), full_page=True)
            assert page.title() == "Dask: Eugo"
        finally:
            gate.set()
            browser.close()
    assert running.result(timeout=120) == 1
    assert errors == []
    assert any(p.startswith("eugo-gpu") and p not in before for p in prefixes)
    assert "tasks ran on a GPU" in summary
    assert re.fullmatch(r"\d+\.\d\dx", machine["ratio"][0]), machine
    assert re.fullmatch(r"\d+% of \d+", machine["gpu"][0]), machine
    assert (tmp_path / "eugo.png").stat().st_size > 20_000


def test_plugin_error_does_not_break_scheduler_or_metrics(cluster):
    _, client, base = cluster

    def break_counting(dask_scheduler):
        plugin = dask_scheduler.plugins["eugo"]
        plugin._count = lambda *args: 1 / 0  # every finished task now raises inside the hook

    client.run_on_scheduler(break_counting)
    before = plugin_summary(client)["errors"]
    with dask.config.set(SETTINGS):
        assert_eq(pipeline().compute(), EXPECTED)  # the computation is not affected
    errors = plugin_summary(client)["errors"]
    assert errors > before
    text = get(base + "/metrics")
    assert metric(text, "eugo_plugin_errors_total") == errors
    assert metric(text, "eugo_metrics_errors_total") == 0


def test_a_figure_whose_update_fails_leaves_the_others_live(caplog):
    """Each figure updates on its own: one that fails on a summary it cannot read is logged and
    counted, and the page's other figures and headline still show the tick's figures."""
    from types import SimpleNamespace

    from eugo_dask.dashboard import EugoDashboard

    summary = {"tasks": {"gpu": {"eugo-gpu-exp": 3}, "cpu": {"sum": 2}}, "bytes_h2d": 8e6,
               "bytes_d2h": 1e6, "fallbacks": {}, "fallback_reasons": {}, "warnings": [],
               "estimated_saved_s": 0.5}  # no "prefixes": the seconds figure cannot update
    plugin = SimpleNamespace(summary=lambda: summary)
    page = EugoDashboard(SimpleNamespace(plugins={"eugo": plugin}))
    page.update()
    assert page.errors == 1 and "updating PredictedSeconds failed" in caplog.text
    tasks = next(c for c in page.components if type(c).__name__ == "TasksByDevice")
    assert tasks.source.data["prefix"] == ["sum", "eugo-gpu-exp"]
    assert "<b>3</b> tasks ran on a GPU" in page.summary.root.text
    assert "8.0 MB</b> to the device" in page.summary.root.text


def test_a_summary_that_cannot_be_read_is_said_on_the_page(caplog):
    from types import SimpleNamespace

    from eugo_dask.dashboard import EugoDashboard

    def broken():
        raise RuntimeError("the plugin's own bug")

    page = EugoDashboard(SimpleNamespace(plugins={"eugo": SimpleNamespace(summary=broken)}))
    page.update()
    assert page.errors == 1 and "summary could not be read" in page.summary.root.text
    assert "reading the plugin's summary failed" in caplog.text


def test_the_page_shows_the_plans_the_plugin_hands_it():
    """The what-if figure and the headline's count of plans come from the plugin's summary (the
    plugin hands on the pass's log), not from a module global of the pass."""
    from types import SimpleNamespace

    from eugo_dask.dashboard import EugoDashboard

    plans = [{"all_cpu": 4.0, "all_gpu": 9.0, "as_chosen": 3.0},
             {"all_cpu": 2.0, "all_gpu": 1.0, "as_chosen": 1.0}]
    summary = {"tasks": {}, "bytes_h2d": 0, "bytes_d2h": 0, "prefixes": {}, "fallbacks": {},
               "fallback_reasons": {}, "warnings": [], "estimated_saved_s": 0.0, "plans": plans}
    page = EugoDashboard(SimpleNamespace(plugins={"eugo": SimpleNamespace(summary=lambda: summary)}))
    page.update()
    assert page.errors == 0
    whatif = next(c for c in page.components if type(c).__name__ == "WhatIf")
    assert whatif.source.data["run"] == [1, 2] and whatif.source.data["as_chosen"] == [3.0, 1.0]
    assert "2 computations planned" in page.summary.root.text
