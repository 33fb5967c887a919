"""eugo in Dask's array-expression mode (``array.query-planning: True``) against legacy mode.

``array.query-planning`` is read once, when dask.array is first imported: every test here runs
child processes with ``DASK_ARRAY__QUERY_PLANNING`` set, and compares what each mode did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The equivalence cases Dask 2026.8's array expressions cannot build, and why.
NOT_EXPRESSIBLE = {
    **dict.fromkeys(["matmul", "matmul-chain", "outer-matmul"], "Array.__matmul__ raises"),
    **dict.fromkeys(["dot", "tensordot", "einsum", "where", "nansum", "nanmean", "nanmax"],
                    "not implemented for dask-expr"),
    **dict.fromkeys(["std", "var-axis"], "NotImplementedError"),
    **dict.fromkeys(["argmax", "argmin", "cumsum", "cumprod", "reshape"], "no such method"),
    **dict.fromkeys(["fft", "fft2", "rfft"], "no da.fft module"),
    **dict.fromkeys(["fancy-index", "bool-index"], "Shuffle has no _token"),
}

#: Op families a mode may plan that the other has not, and why: legacy mode's low-level
#: fusion glues them into the task that reads them (whose family the fused task takes), while
#: expressions keep one task per operation. The devices of the families both modes plan agree.
FUSED_AWAY_IN_LEGACY = {
    "creation": "ones/arange/random chunks: fused into their consumer in legacy mode",
    "movement": "transpose, slices and stacks fused into their consumer in legacy mode; and "
                "expressions end a computation of several chunks with a rechunk of their own "
                "(legacy: one finalize task on the host)",
    "reduction": "a chunk reduction fused with the elementwise chain before it in legacy mode",
}


def _child(args: list[str], *, expressions: bool, timeout: int = 600) -> Any:
    env = {**os.environ, "DASK_ARRAY__QUERY_PLANNING": str(expressions),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _json_child(module: str, *args: str, expressions: bool) -> Any:
    return json.loads(_child(["-m", module, *args], expressions=expressions))


@pytest.mark.slow
def test_equivalence_cases_place_and_compute_as_in_legacy_mode():
    legacy = _json_child("tests.placements", expressions=False)
    expr = _json_child("tests.placements", expressions=True)
    assert (legacy["expressions"], expr["expressions"]) == (False, True)
    assert legacy["cases"].keys() == expr["cases"].keys()
    unbuilt = {name for name, case in expr["cases"].items() if "not expressible" in case}
    assert unbuilt == set(NOT_EXPRESSIBLE)
    for name, case in expr["cases"].items():
        if name in unbuilt:
            continue
        before = legacy["cases"][name]
        assert case["same result"] and before["same result"], name
        assert case["fallbacks"] == 0, name
        assert case["device ran"] == case["planned on the device"], (name, case)
        assert case["device ran"] or not before["device ran"], (name, before, case)
        for op in case["placements"].keys() & before["placements"].keys():
            assert case["placements"][op] == before["placements"][op], (name, op, before, case)
        for op in case["placements"].keys() ^ before["placements"].keys():
            assert op in FUSED_AWAY_IN_LEGACY, (name, op, before, case)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "process"])
def test_a_cluster_with_an_emulated_gpu_worker(kind, tmp_path):
    """On a LocalCluster, and with scheduler and workers in processes of their own started
    without the client's settings (eugo's device, profile and min-speedup reach the scheduler
    with the expression, frozen on the client)."""
    args = [kind] if kind == "local" else [kind, str(tmp_path)]
    runs = {mode: _json_child("tests.expression_cluster", *args, expressions=mode)
            for mode in (False, True)}
    for mode, run in runs.items():
        assert run["expressions"] is mode
        assert run["same result"] and run["result type"] == "ndarray", run
        assert run["fallbacks"] == 0, run
        gpu_tasks = run["roles planned"]["gpu"]
        assert gpu_tasks > 0 and run["device tasks on the GPU worker"] == gpu_tasks, run
        assert run["device tasks elsewhere"] in (None, 0), run
        assert run["roles planned"]["host"] > 0, run  # (the read and the aggregation)


_HOOK_CODE = """
import json, warnings, dask, dask.array as da, numpy as np
{before}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import eugo_dask
from eugo_dask.array_expressions import hook_installed
x = np.sin(da.from_array(np.arange(64.0).reshape(8, 8), chunks=4)) + 1
settings = dict(optimizations=[eugo_dask.eugo], **{{"eugo.device": "emulated",
                "eugo.min-speedup": 0, "eugo.profile": {{"base": "h200", "cpu": "server-x86"}}}})
with dask.config.set(settings):
    result = x.compute(scheduler="sync")
    device_tasks = eugo_dask.device_stats()["tasks"]
    plan = eugo_dask.explain(x)
eugo_dask.reset_device_stats()
with dask.config.set({{**settings, "optimizations": []}}):
    expected = x.compute(scheduler="sync")
print(json.dumps({{
    "warnings": [str(w.message)[:110] for w in caught if w.category is RuntimeWarning],
    "hook": hook_installed(), "same": bool(np.array_equal(result, expected)),
    "device ran": device_tasks > 0, "device ran plain": eugo_dask.device_stats()["tasks"] > 0,
    "explain": [plan.device, len(plan.gpu_keys)],
    "upstream": dask.config.get("optimization.expression-passes", None) is not None}}))
"""


def test_the_hook_is_version_pinned_and_only_acts_with_eugo_on():
    tested = json.loads(_child(["-c", _HOOK_CODE.format(before="")], expressions=True))
    upstream = tested.pop("upstream")
    assert tested == {"warnings": [], "hook": True, "same": True, "device ran": True,
                      "device ran plain": False, "explain": ["emulated", 9]}
    untested = json.loads(_child(["-c", _HOOK_CODE.format(before="dask.__version__ = '2027.1.0'")],
                                 expressions=True))
    if upstream:  # (a Dask with docs/upstream's patch: its config key, whatever its version)
        assert untested == {**tested, "upstream": True}
        return
    assert untested == {
        "warnings": ["eugo-dask: dask.array runs in array-expression mode (array.query-planning: "
                     "True) on Dask 2027.1.0; eugo's hook"],
        "hook": False, "same": True, "device ran": False, "device ran plain": False,
        "explain": [None, 9], "upstream": False}  # what eugo would do; the graph runs unchanged


def test_the_dask_eugo_installs_with_is_one_the_hook_was_tested_with():
    """pyproject.toml's highest Dask and distributed are the release after the newest of
    TESTED_DASK: an install (and CI) never gets a Dask whose array expressions eugo would stand
    aside from (CI installed Dask 2026.11 when the hook knew 2026.8 at most, and its
    expression-mode tests failed)."""
    import re

    from eugo_dask.array_expressions import TESTED_DASK

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    newest = max(tuple(map(int, v.split("."))) for v in TESTED_DASK)
    following = f"{newest[0]}.{newest[1] + 1}" if newest[1] < 12 else f"{newest[0] + 1}"
    for name in ("dask[array]", "distributed"):
        bounds = re.findall(rf'"{re.escape(name)}>=[0-9.]+,<([0-9.]+)"', text)
        assert bounds == [following], (name, bounds, TESTED_DASK)


def test_legacy_mode_is_left_alone():
    out = json.loads(_child(["-c", _HOOK_CODE.format(before="")], expressions=False))
    assert out == {"warnings": [], "hook": False, "same": True, "device ran": True,
                   "device ran plain": False, "explain": ["emulated", 4],
                   "upstream": out["upstream"]}


_BAD_SETTING_CODE = """
import json
import dask, dask.array as da
from distributed import Client, LocalCluster
import eugo_dask

if __name__ == "__main__":
    x = da.ones((100, 100), chunks=50)
    seen = []
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, \\
            Client(cluster) as client:
        for how in ("compute", "persist", "client.compute"):
            y = (x + 1).sum()
            run = {"compute": y.compute, "persist": y.persist,
                   "client.compute": lambda: client.compute(y).result(timeout=60)}[how]
            with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.dispatch": "gpu"}):
                try:
                    run()
                    seen.append([how, None, ""])
                except Exception as e:
                    seen.append([how, type(e).__name__, str(e)])
        submitted = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
    print(json.dumps({"seen": seen, "tasks on the scheduler": submitted}))
"""


def test_a_bad_setting_is_reported_as_itself_on_a_cluster():
    # expression mode on distributed: the bad value surfaced as "TypeError: Could not serialize
    # object of type PlannedExpr", the ValueError naming the key only chained inside it
    out = json.loads(_child(["-c", _BAD_SETTING_CODE], expressions=True, timeout=300))
    for how, kind, message in out["seen"]:
        assert kind == "ValueError", (how, kind, message[:300])
        assert "eugo.dispatch" in message and "static" in message and "'gpu'" in message, message
    assert out["tasks on the scheduler"] == 0  # nothing was submitted


_SLICE_CODE = """
import json
import dask, dask.array as da, eugo_dask
from eugo_dask.testing import emulated_settings

x = da.random.default_rng(0).random((1024, 1024), chunks=256)
out = {}
for name, y in {"element": (x * 2 + 1)[5, 7], "slice": (x * 2)[::3, 10:700],
                "row": (x * 2 + 1)[3]}.items():
    with dask.config.set(emulated_settings()):
        planned = sum(r.device == "gpu" for r in eugo_dask.explain(y))
        eugo_dask.reset_device_stats()
        y.compute()
        out[name] = [planned, eugo_dask.device_stats()["tasks"]]
print(json.dumps(out))
"""


def test_a_slice_is_planned_for_the_chunks_it_reads():
    # an array expression's graph comes uncalled: the pass and explain() planned every chunk of
    # the expression sliced (32 GPU tasks planned for an element whose compute ran 2)
    out = json.loads(_child(["-c", _SLICE_CODE], expressions=True, timeout=300))
    for name, (planned, ran) in out.items():
        assert planned == ran > 0, (name, planned, ran)


_SPECIAL_CHUNKS_CODE = """
import json, dask, numpy as np, scipy.sparse as sp, eugo_dask, dask.array as da
from eugo_dask.testing import emulated_settings

x = da.random.default_rng(0).random((512, 512), chunks=128)
masked = x.map_blocks(np.ma.masked_greater, 0.5, meta=np.ma.masked_array(np.empty((0, 0))))
cases = {"masked": masked * 2 + 1, "masked mean": (masked * 2).mean(axis=0),
         "scipy sparse": x.map_blocks(lambda b: sp.csr_matrix(b * (b > 0.9)),
                                      meta=sp.csr_matrix((0, 0))) * 2}

def same(a, b):
    if sp.issparse(a):
        return type(a) is type(b) and (a != b).nnz == 0
    return type(a) is type(b) and bool(np.ma.allequal(a, b)) and bool(
        (np.ma.getmaskarray(a) == np.ma.getmaskarray(b)).all())

out = {}
for name, y in cases.items():
    with dask.config.set(optimizations=[]):
        expected = y.compute(scheduler="sync")
    with dask.config.set(emulated_settings()):
        planned = len(eugo_dask.explain(y).gpu_keys)
        eugo_dask.reset_device_stats()
        result = y.compute(scheduler="sync")
    stats = eugo_dask.device_stats()
    out[name] = {"same": same(result, expected), "planned on the device": planned,
                 "device tasks": stats["tasks"], "fallbacks": stats["fallbacks"]}
if da.array_expr_enabled():  # a 0-d reduction's aggregate has a NumPy scalar for its meta
    from eugo_dask.array_expressions import expression_graph
    graph, _, chunk_info = expression_graph(((x * 2).sum(), x.max(axis=0)))
    out["special chunk types of plain reductions"] = sorted(
        {str(chunk_info.special_chunk_type(key)) for key in graph} - {"None"})
print(json.dumps(out))
"""


@pytest.mark.parametrize("expressions", [False, True])
def test_masked_and_sparse_chunks_are_planned_on_the_cpu(expressions):
    # no device holds a masked array or a sparse matrix: legacy mode read the meta's chunk type
    # (``collection_annotations``) and kept such chunks on the CPU; expression mode planned
    # them on the device, where every one fell back at run time (33 fallbacks for the masked
    # case, "host-only chunk: MaskedArray"; 16 TypeErrors for the sparse one)
    out = json.loads(_child(["-c", _SPECIAL_CHUNKS_CODE], expressions=expressions, timeout=300))
    assert out.pop("special chunk types of plain reductions", []) == []
    for name, case in out.items():
        assert case == {"same": True, "planned on the device": 0, "device tasks": 0,
                        "fallbacks": 0}, (name, case)


_GRAPH_ERROR_CODE = """
import json, dask, numpy as np, eugo_dask, dask.array as da
from eugo_dask.testing import emulated_settings

x = da.from_array(np.ones((64, 48)), chunks=16)
# a function that fails on Dask's empty stand-in (its first element) and a dtype given as a
# Python type: Dask's expressions raise AttributeError while making the graph
y = (x * 2).map_blocks(lambda b: b / b[0, 0], dtype=float)
out = {}
for name, settings in {"plain": {"optimizations": []}, "eugo": emulated_settings()}.items():
    with dask.config.set(settings):
        try:
            y.compute(scheduler="sync")
        except Exception as e:
            out[name] = [type(e).__name__, str(e), repr(e.__context__)]
print(json.dumps(out))
"""


def test_an_error_raised_while_the_graph_is_made_reaches_the_caller_unchanged():
    # eugo's planned expression made its graph in a property: an AttributeError there sent
    # Python to Expr.__getattr__, which made the graph a second time and raised an
    # AttributeError of its own ("... This often means that you are attempting to use an
    # unsupported API function..") with Dask's as its context
    out = json.loads(_child(["-c", _GRAPH_ERROR_CODE], expressions=True, timeout=300))
    assert out["plain"][0] == "AttributeError" and out["plain"][2] == "None", out
    assert out["eugo"] == out["plain"]
