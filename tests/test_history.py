"""Learning from observed runtimes: robust medians, warm-up, spikes, persistence, and the loop
from a computation back into the next plan."""

from __future__ import annotations

import json

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask.history import RuntimeHistory, get_history
from eugo_dask.plugin import EugoSchedulerPlugin

from .conftest import H200_SERVER

NBYTES = 2**23  # bucket 23 holds [2**23, 2**24)


def test_converges_to_observed_durations():
    h = RuntimeHistory(min_samples=5)
    assert h.estimate("matmul", "cpu", NBYTES) is None
    assert h.record("matmul", "cpu", NBYTES, 5.0) is False  # first call: warm-up, discarded
    for i in range(4):
        h.record("matmul", "cpu", NBYTES, 0.010 * (1 + 0.01 * i))
    assert h.estimate("matmul", "cpu", NBYTES) is None  # not enough samples yet
    h.record("matmul", "cpu", NBYTES, 0.010)
    assert h.estimate("matmul", "cpu", NBYTES) == pytest.approx(0.0101, rel=0.02)
    # scales within the size bucket, per byte
    assert h.estimate("matmul", "cpu", NBYTES * 1.5) == pytest.approx(0.01515, rel=0.02)
    assert h.estimate("matmul", "gpu", NBYTES) is None  # other device, other buckets


def test_spikes_are_rejected():
    # StarPU's failure: 100 ms spikes among 190 us tasks must not move the estimate
    h = RuntimeHistory(min_samples=5)
    rng = np.random.default_rng(0)
    h.record("elementwise", "gpu", NBYTES, 1.0)  # warm-up
    for i in range(200):
        spike = i % 10 == 5
        h.record("elementwise", "gpu", NBYTES, 0.100 if spike else 190e-6 * rng.uniform(0.95, 1.05))
    assert h.estimate("elementwise", "gpu", NBYTES) == pytest.approx(190e-6, rel=0.05)
    assert h.rejected >= 19
    assert len(h) <= 64  # a bounded window


def test_persisted_and_reloaded(tmp_path):
    path = tmp_path / "history.json"
    h = RuntimeHistory(path)
    for _ in range(7):
        h.record("fft", "cpu", NBYTES, 0.02)
    h.save()
    assert json.loads(path.read_text())["buckets"][0]["op"] == "fft"
    again = RuntimeHistory(path)
    assert again.estimate("fft", "cpu", NBYTES) == pytest.approx(0.02)
    again.record("fft", "cpu", NBYTES, 0.02)  # reloaded buckets are warm already
    assert len(again) == len(h) + 1


def test_unreadable_history_is_ignored(tmp_path, caplog):
    path = tmp_path / "history.json"
    path.write_text("{not json")
    h = RuntimeHistory(path)
    assert len(h) == 0 and "ignoring unreadable runtime history" in caplog.text


def _pipeline():
    x = da.from_array(np.random.default_rng(0).random((400, 400)), chunks=100)
    return np.exp(x) @ x


def test_local_runs_refine_the_next_plan(tmp_path):
    path = str(tmp_path / "history.json")
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                "eugo.profile": H200_SERVER, "eugo.learn": True, "eugo.history": path}
    with dask.config.set(settings):
        before = eugo_dask.explain(_pipeline())
        assert not any(d.measured for d in before)
        for _ in range(8):
            _pipeline().compute(scheduler="threads")
        after = eugo_dask.explain(_pipeline())
    measured = [d for d in after if d.measured]
    assert measured, str(after)
    assert "measured, the profile predicted" in measured[0].reason
    assert measured[0].to_dict()["cpu_model_s"] is not None or measured[0].to_dict()["gpu_model_s"]
    assert len(get_history(path)) > 0
    assert (tmp_path / "history.json").exists()  # saved when the computation finished


def test_learning_is_off_by_default():
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": H200_SERVER}):
        assert not eugo_dask.read_settings().learn
        plan = eugo_dask.explain(_pipeline())
    assert not any(d.measured for d in plan)


@pytest.mark.slow
def test_scheduler_plugin_learns_from_worker_timings(tmp_path):
    path = str(tmp_path / "history.json")
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated", "eugo.min-speedup": 0,
                "eugo.profile": H200_SERVER, "eugo.learn": True, "eugo.history": path}
    with LocalCluster(n_workers=1, processes=False, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster):
        cluster.scheduler.add_plugin(EugoSchedulerPlugin())
        with dask.config.set(settings):
            for _ in range(3):
                _pipeline().compute()
    history = get_history(path)
    assert len(history) > 0
    assert any(op == "matmul" for op, _, _ in history._samples)


@pytest.mark.parametrize("seconds", [-0.5, float("nan"), float("inf")])
def test_impossible_durations_are_rejected(seconds):
    # a negative duration would make the GPU look free and send everything there
    h = RuntimeHistory(min_samples=1)
    h.record("matmul", "gpu", NBYTES, 0.01)  # warm-up
    h.record("matmul", "gpu", NBYTES, 0.01)
    assert h.record("matmul", "gpu", NBYTES, seconds) is False
    assert h.rejected == 1
    assert h.estimate("matmul", "gpu", NBYTES) == pytest.approx(0.01)


def test_impossible_durations_in_a_file_are_dropped(tmp_path, caplog):
    path = tmp_path / "history.json"
    path.write_text(json.dumps({"version": 1, "buckets": [
        {"op": "matmul", "device": "gpu", "bucket": 23, "s_per_byte": [1e-9, -1e-9, "NaN"] * 3}]}))
    h = RuntimeHistory(path, min_samples=3)
    assert "ignoring 6 negative or non-finite durations" in caplog.text
    assert h.estimate("matmul", "gpu", NBYTES) == pytest.approx(1e-9 * NBYTES)


def _entry(bucket, samples="[1e-9, 1e-9, 1e-9, 1e-9, 1e-9]"):
    return f'{{"op": "matmul", "device": "gpu", "bucket": {bucket}, "s_per_byte": {samples}}}'


def test_a_bad_entry_is_dropped_and_the_rest_used(tmp_path, caplog):
    # issue: an infinite or nested bucket made every pass fail (graph run unchanged)
    from eugo_dask.pass_log import pass_stats

    path = tmp_path / "history.json"
    path.write_text(f'{{"version": 1, "buckets": [{_entry("Infinity")}, {_entry("[[23]]")}, '
                    f'{_entry(23)}]}}')
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                "eugo.profile": H200_SERVER, "eugo.learn": True, "eugo.history": str(path)}
    before = pass_stats()
    with dask.config.set(settings):
        result = _pipeline().compute(scheduler="sync")
    after = pass_stats()
    np.testing.assert_allclose(result, _pipeline().compute(scheduler="sync"))
    assert after["pass_errors"] == before["pass_errors"]
    assert after["graphs_planned"] == before["graphs_planned"] + 1
    assert f"ignoring 2 malformed entries of runtime history {path}" in caplog.text
    history = get_history(str(path))
    assert history.estimate("matmul", "gpu", NBYTES) == pytest.approx(1e-9 * NBYTES)


@pytest.mark.parametrize("text", [
    f'{{"version": 1, "buckets": [{_entry(23, "[" + "9" * 400 + "]")}]}}',  # float() overflows
    '{"version": 1, "buckets": ' + "[" * 100_000 + "]" * 100_000 + "}",  # past the recursion limit
])
def test_a_poisoned_history_is_reported_once_and_ignored(tmp_path, caplog, text):
    # issue: a 400-digit integer or deep nesting raised OverflowError/RecursionError out of the
    # loader: every pass failed, and read the file again
    from eugo_dask.pass_log import pass_stats

    path = tmp_path / "history.json"
    path.write_text(text)
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                "eugo.profile": H200_SERVER, "eugo.learn": True, "eugo.history": str(path)}
    before = pass_stats()
    with dask.config.set(settings):
        for _ in range(2):
            _pipeline().compute(scheduler="sync")
    after = pass_stats()
    assert after["pass_errors"] == before["pass_errors"]
    assert after["graphs_planned"] == before["graphs_planned"] + 2
    reports = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(reports) == 1, reports
    assert get_history(str(path)).estimate("matmul", "gpu", NBYTES) is None
