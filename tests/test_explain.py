"""explain(): one record per task with numbers and a reason; table, JSON, what-if totals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import DataNode, Task, TaskRef

from eugo_dask import Decision, device_stats, eugo, explain, pass_log, reset_device_stats
from eugo_dask.report import copies_text
from eugo_dask.testing import emulated_settings


def collection():
    a = da.random.default_rng(0).random((4000, 4000), chunks=2000, dtype="f4")
    return (np.exp(a) @ a.T).sum()


def test_records(h200_server):
    plan = explain(collection())
    records = list(plan)
    assert len(records) == len(plan) > 0
    assert all(isinstance(r, Decision) for r in records)
    for r in records:
        assert r.device in ("cpu", "gpu")
        assert r.op and r.reason and r.key is not None
        assert r.cpu_s > 0
    matmul = [r for r in records if r.op == "matmul"]
    assert matmul and matmul[0].flops > 0 and matmul[0].dtype == "float32"
    assert matmul[0].shape is not None
    assert plan[matmul[0].key] is matmul[0]


def test_table_grouped_by_prefix(h200_server):
    plan = explain(collection())
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("eugo plan:") and "profile h200" in lines[0]
    for prefix in {r.prefix for r in plan}:
        assert sum(line.startswith(prefix[:28] + " ") for line in lines) == 1
    assert lines[-1].startswith("what-if task-seconds: all-CPU")


def test_json_and_totals(h200_server):
    plan = explain(collection())
    data = json.loads(plan.to_json())
    assert len(data["tasks"]) == len(plan)
    assert set(data["totals_s"]) == {"all_cpu", "all_gpu", "as_chosen"}
    assert data["tasks"][0].keys() >= {"key", "op", "device", "reason", "cpu_s", "gpu_s", "h2d_s", "d2h_s"}
    with dask.config.set({"eugo.min-speedup": 0}):
        everything = explain(collection())
    assert everything.totals["as_chosen"] == everything.totals["all_gpu"]


def test_explain_overrides_and_dry_run_without_device():
    # no GPU here: with the default device (auto) nothing would change, and the plan says so
    plan = explain(collection(), profile={"base": "h200", "cpu": "server-x86"})
    assert plan.device is None
    assert "the graph would run unchanged" in str(plan)
    assert plan.gpu_keys  # ... but shows what an H200 would take
    assert not explain(collection(), profile={"base": "h200", "cpu": "server-x86"},
                       min_speedup=1e9).gpu_keys


def test_html(h200_server, tmp_path):
    plan = explain(collection())
    html = plan._repr_html_()
    assert html.count("<tr class=") == len(plan.by_prefix())
    assert "What-if task-seconds" in html and "matmul" in html
    page = plan.to_html()
    assert page.startswith("<!DOCTYPE html>") and html in page


def test_cli_writes_html(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "pipeline.py"
    script.write_text("import dask.array as da\n"
                      "x = (da.ones((2000, 2000), chunks=1000) @ da.ones((2000, 2000), chunks=1000)).sum()\n")
    out = tmp_path / "plan.html"
    cli = str(Path(sys.executable).with_name("eugo-dask"))
    result = subprocess.run([cli, "explain", f"{script}:x", "--html", str(out), "--profile", "h200"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "<table class='eugo'>" in out.read_text() and "eugo plan:" in result.stdout


@pytest.mark.parametrize("thing", [np.ones(3), [1, 2], None])
def test_explain_of_something_else_says_what_it_takes(thing):
    with pytest.raises(TypeError, match=r"explain\(\) takes a Dask collection .*; got "):
        explain(thing)


@pytest.mark.parametrize("outside_first", [True, False])
def test_a_key_from_outside_the_graph_is_not_a_key_holding_none(emulated, outside_first):
    """Chunks of a layer share a description when they read the same things: a key the graph
    does not hold (an unknown array) and a key holding None (a literal) are not the same."""
    tasks = [Task(("f", 1), np.cumsum, TaskRef(("a", 0)), TaskRef("outside")),
             Task(("f", 0), np.cumsum, TaskRef(("a", 0)), TaskRef("n"))]
    dsk = {("a", 0): DataNode(("a", 0), np.ones(100_000)), "n": DataNode("n", None),
           **{t.key: t for t in (tasks if outside_first else tasks[::-1])}}
    out = dict(eugo(dsk, [("f", 0), ("f", 1)]))
    assert not any("outside" in str(k) and "eugo" in str(k) for k in out)  # no copy of it
    assert out[("f", 1)] is dsk[("f", 1)]  # on the CPU: its input's size is unknown


@pytest.mark.parametrize("literal", [1.0, np.float32(1), np.float64(1)])
def test_literals_equal_across_types_are_not_the_same_input(emulated, literal):
    """``x + 1`` and ``x + 1.0`` read equal literals of different types, with results of
    different dtypes: neither takes the other's description, whichever comes first."""
    from eugo_dask.describe import describe_graph
    from eugo_dask.graph import ChunkInfo
    from eugo_dask.optimization import _current_settings, _profile

    x = np.ones(1000, dtype=np.int64)
    dsk = {("x", 0): DataNode(("x", 0), x),
           ("a", 0): Task(("a", 0), np.add, TaskRef(("x", 0)), 1),
           ("b", 0): Task(("b", 0), np.add, TaskRef(("x", 0)), literal),
           ("c", 0): Task(("c", 0), np.add, TaskRef(("x", 0)), True)}
    description = describe_graph(dsk, ChunkInfo({}), _profile(_current_settings()))
    for key, value in (("a", 1), ("b", literal), ("c", True)):
        expected = np.add(x, value)
        assert description.specs[(key, 0)] == (expected.shape, expected.dtype), key
        assert description.estimates[(key, 0)].out_bytes == expected.nbytes, key


# --- several collections, as dask.compute(*collections) computes them ----------------------------
def shared_outputs():
    x = da.random.default_rng(0).random((2048, 2048), chunks=1024, dtype="f4")
    return (x @ x.T).sum(axis=0), np.exp(x).sum(axis=0) + x[::2].T.sum(axis=1)


@pytest.mark.parametrize("min_speedup", [0, 2])
def test_several_collections_are_the_plan_their_joint_compute_runs(min_speedup):
    """(At min-speedup 2 the walk once met the collections' tasks in another order for the
    compute than for explain, and with it placed the tasks that share ``x`` otherwise.)"""
    a, b = shared_outputs()
    with dask.config.set(emulated_settings(min_speedup=min_speedup)):
        plan = explain(a, b)
        reset_device_stats()
        dask.compute(a, b, scheduler="sync")
        ran, stats = pass_log.recent_plans()[-1], device_stats()
        alone = [explain(a), explain(b)]
    assert plan.gpu_keys and ran["gpu_tasks"] == stats["tasks"] == len(plan.gpu_keys)
    copies = plan.copies
    assert (stats["h2d_count"], stats["h2d_bytes"]) == (copies.to_device, copies.to_device_bytes)
    assert (stats["d2h_count"], stats["d2h_bytes"]) == (copies.to_host, copies.to_host_bytes)
    # one graph: what the two share (x, its chunks and their copies) is in it once
    assert len(plan) < sum(map(len, alone))
    assert {d.key for d in alone[0] if d.op == "creation"} <= set(plan.decisions)
    # and one collection alone is planned as before: its own graph
    assert {d.key for d in explain(a)} == {d.key for d in alone[0]}


def test_the_plan_says_what_it_copies(h200_server):
    plan = explain(collection())
    assert plan.copies.to_device > 0 and plan.copies.to_device_bytes > 0
    assert plan.copies.to_host == len(plan.host_needed)  # one copy back per result needed
    lines = str(plan).splitlines()
    assert lines[-3] == copies_text(*plan.copies)  # (then the schedule, then the totals)
    assert lines[-3].startswith(f"copies: {plan.copies.to_device} to the device (")
    assert json.loads(plan.to_json())["copies"] == plan.copies._asdict()
    assert "Copies: " + copies_text(*plan.copies)[len("copies: "):] in plan._repr_html_()


def test_explain_of_nothing_says_what_it_takes():
    with pytest.raises(TypeError, match=r"explain\(\) takes a Dask collection .*or several as "
                                        r"dask.compute takes them; got none"):
        explain()


def test_explain_of_something_else_among_collections_names_it():
    with pytest.raises(TypeError, match=r"explain\(\) takes a Dask collection .*; got ndarray"):
        explain(collection(), np.ones(3))


def test_several_array_expressions_are_planned_together():
    """In array-expression mode too (a fresh process: the mode is read when dask.array loads),
    several collections make one plan, of what eugo would do."""
    script = textwrap.dedent("""
        import warnings, dask.array as da, numpy as np
        warnings.simplefilter("ignore")
        import eugo_dask
        x = da.from_array(np.ones((4000, 4000), dtype="f4"), chunks=2000)
        a, b = np.exp(np.sin(x)).sum(), np.exp(x).sum(axis=0)
        # the h200 preset with its former 20 GB/s staged copies, and a min-speedup of 1: a's
        # tasks pay on the device (expressions fuse nothing: sin alone pays its copy, 1.18x)
        link = {"h2d_bytes_per_s": 2e10, "d2h_bytes_per_s": 2e10}
        for outputs in ([a], [b], [a, b]):
            plan = eugo_dask.explain(*outputs, min_speedup=1,
                                     profile={"base": "h200", "cpu": "server-x86", "link": link})
            print(plan.device, len(plan), len(plan.gpu_keys))
    """)
    out = subprocess.check_output([sys.executable, "-c", script], text=True, timeout=120,
                                  env={**os.environ, "DASK_ARRAY__QUERY_PLANNING": "True"})
    (_, tasks_a, gpu_a), (_, tasks_b, gpu_b), joint = [line.split() for line in out.splitlines()]
    assert gpu_a != "0"
    # (the tasks of b do not follow a's copy of x to the device)
    assert joint == ["None", str(int(tasks_a) + int(tasks_b)), str(int(gpu_a) + int(gpu_b))]
