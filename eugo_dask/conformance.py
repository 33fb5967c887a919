"""Conformance: a test suite run with eugo forced on must behave exactly as without it.

A pytest plugin and a comparison, used by ``scripts/conformance.sh`` to run Dask's own
``dask/array/tests`` twice (plain, then with eugo on) and report every test whose outcome or
warnings differ::

    pytest -p eugo_dask.conformance --eugo=off --eugo-report=plain.json --pyargs dask.array.tests
    pytest -p eugo_dask.conformance --eugo=on --eugo-min-speedup=0 --eugo-report=eugo.json ...
    python -m eugo_dask.conformance plain.json eugo.json --allowed conformance/allowed.txt

With ``--eugo=on`` every array graph goes through the eugo pass on the emulated device under the
``h200`` profile (``--eugo-min-speedup 0``: every task that can run on a device does). The plugin
records, per test, its outcome, the warnings it raised, and what eugo did meanwhile: graphs
rewritten, device tasks run, fallbacks, and errors inside the pass (the pass is fail-safe, so a
pass error never fails a test; the report counts it as a difference all the same).

With ``--eugo-distributed DIR`` the plugin runs distributed's own tests, vendored under ``DIR`` in
distributed's source layout (its wheel has no tests): it makes ``distributed.shuffle.tests``
importable from there and loads distributed's test fixtures (``distributed.utils_test``, what
distributed's root ``conftest.py`` does). With ``--eugo=on`` too,
every cluster those tests start is heterogeneous: every scheduler preloads eugo's plugin
(``eugo_dask.plugin``) and this module, every worker preloads this module, and the first worker
to ask its scheduler advertises the GPU resource (``eugo.resource``), the others none; config
and environment carry this to clusters in subprocesses as well.

The comparison prints each test whose outcome or warnings differ, except those listed in the
allowed-differences file (``nodeid  # reason``: tests that assert the graph's own structure), and
exits 1 when anything else differs.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import itertools
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

#: Markers Dask's own conftest and pyproject register; registering them keeps strict markers quiet.
_DASK_MARKERS = ("slow", "gpu", "network", "array_expr", "normal_and_array_expr")
#: Markers distributed's pyproject registers, and pytest-rerunfailures' ``flaky`` its tests use.
_DISTRIBUTED_MARKERS = ("ci1", "memray", "ipython", "leaking", "workerstate", "flaky")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("eugo", "eugo-dask conformance")
    group.addoption("--eugo", choices=("off", "on"), default="off",
                    help="run every array graph through the eugo pass (emulated device)")
    group.addoption("--eugo-min-speedup", type=float, default=0.0,
                    help="eugo.min-speedup while --eugo=on (0: offload all that can be)")
    group.addoption("--eugo-report", default=None, help="write per-test outcomes here (JSON)")
    group.addoption("--runslow", action="store_true", help="run tests marked slow (as Dask's own)")
    group.addoption("--eugo-distributed", default=None, metavar="DIR",
                    help="the tests are distributed's own, vendored under DIR in its source layout: "
                         "load its fixtures; with --eugo=on every cluster is heterogeneous")
    group.addoption("--eugo-select", action="append", default=[], metavar="FILE:TEXT",
                    help="in the test file named FILE, run only the test functions whose source "
                         "contains TEXT (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    for marker in (*_DASK_MARKERS, *_DISTRIBUTED_MARKERS):
        config.addinivalue_line("markers", f"{marker}: a marker of Dask's or distributed's test suite")
    pytest.register_assert_rewrite("dask.array.utils")
    config._eugo_results = {}  # type: ignore[attr-defined]
    if config.getoption("--eugo") == "on":
        import dask

        import eugo_dask

        # process-wide and never exited: every test's own dask.config.set nests inside it
        dask.config.set({
            "optimizations": [eugo_dask.eugo],
            "eugo.device": "emulated",
            "eugo.profile": "h200",
            "eugo.min-speedup": config.getoption("--eugo-min-speedup"),
        })
        if config.getoption("--eugo-distributed"):
            settings, environment = heterogeneous_clusters()
            dask.config.set(settings)
            os.environ.update(environment)
    if config.getoption("--eugo-distributed"):
        _distributed_tests(config, Path(config.getoption("--eugo-distributed")))


def _distributed_tests(config: pytest.Config, root: Path) -> None:
    """Make the test helpers vendored under ``root`` importable as distributed's own
    (``distributed.shuffle.tests.utils``), and load distributed's test fixtures, after eugo's
    config is set: ``distributed.utils_test`` snapshots Dask's config on import, and every
    ``gen_cluster`` test restores that snapshot.

    The test modules themselves are imported as pytest imports them from distributed's source
    tree (``test_client``: ``distributed/tests`` is no package), except that ``test_rechunk``
    becomes ``tests.test_rechunk``: the vendored tree has no ``distributed/__init__.py``, which
    would shadow the installed distributed. The name matters where distributed looks at it:
    the code of a computation skips frames of modules named ``distributed.*``."""
    if "distributed.utils_test" in sys.modules:
        raise pytest.UsageError("--eugo-distributed: distributed.utils_test was imported before eugo's "
                                "config was set; its config snapshot would lack eugo")
    import distributed.shuffle

    folder = str(root / "distributed" / "shuffle")
    if folder not in distributed.shuffle.__path__:
        distributed.shuffle.__path__.append(folder)
    config.pluginmanager.import_plugin("distributed.utils_test")


def heterogeneous_clusters() -> tuple[dict[str, Any], dict[str, str]]:
    """(Dask config, environment variables) that give every cluster distributed's tests start
    eugo's scheduler plugin and one GPU worker (:func:`dask_setup`). The config reaches what
    runs in this process and what it hands its config to (``gen_cluster``, ``LocalCluster``,
    nannies); the environment, the schedulers and workers ``distributed.utils_test.cluster``
    spawns, which read nothing else; it carries this process's ``eugo.*`` device settings too."""
    import dask

    settings: dict[str, Any] = {
        "distributed.scheduler.preload": ["eugo_dask.plugin", __name__],
        "distributed.worker.preload": [__name__],
    }
    inherited = {**settings, **{key: dask.config.get(key)
                                for key in ("eugo.device", "eugo.profile", "eugo.min-speedup")}}
    environment = {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): repr(value)
                   for key, value in inherited.items()}
    return settings, environment


#: The scheduler handler through which a worker asks whether it is its cluster's GPU worker.
_CLAIM_GPU = "eugo_conformance_claim_gpu"
#: Clusters and GPU workers made heterogeneous in this process (counted in each test's activity).
_clusters = {"clusters": 0, "gpu_workers": 0}


async def dask_setup(server: Any) -> None:
    """Preload of schedulers and workers under ``--eugo-distributed --eugo=on``: the scheduler
    grants the GPU resource to the first of its workers that asks; a worker asks before it
    registers, so it advertises the resource from its first contact. A worker whose resources
    the test set itself keeps them, and asks nothing."""
    from distributed import Scheduler

    if isinstance(server, Scheduler):
        asked = itertools.count()
        server.handlers[_CLAIM_GPU] = lambda: next(asked) == 0
        _clusters["clusters"] += 1
        return
    if server.state.total_resources:
        return
    from eugo_dask.config import read_resource

    try:
        granted_here = await asyncio.wait_for(getattr(server.scheduler, _CLAIM_GPU)(), 10)
    except (OSError, asyncio.TimeoutError, KeyError):  # no scheduler yet, or one without this preload
        return
    if granted_here:
        # what Worker(resources=...) sets; Worker.set_resources would tell a scheduler that does
        # not know this worker yet
        resource = read_resource()
        server.state.total_resources[resource] = 1
        server.state.available_resources[resource] = 1
        _clusters["gpu_workers"] += 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--eugo-select FILE:TEXT``: in FILE, only the test functions whose source holds TEXT."""
    rules = [rule.partition(":")[::2] for rule in config.getoption("--eugo-select")]
    if not rules:
        return
    sources: dict[Path, dict[str, str]] = {}
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        texts = [text for name, text in rules if item.path.name == name]
        if not texts:
            keep.append(item)
            continue
        if item.path not in sources:
            sources[item.path] = _function_sources(item.path)
        source = sources[item.path].get(getattr(item, "originalname", item.name), "")
        (keep if all(text in source for text in texts) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _function_sources(path: Path) -> dict[str, str]:
    """The source of each function defined in ``path`` (methods included), by name."""
    text = path.read_text()
    return {node.name: ast.get_source_segment(text, node) or ""
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _activity() -> dict[str, int]:
    """What eugo has done in this process so far (counters that only grow)."""
    from eugo_dask import device_stats
    from eugo_dask.pass_log import pass_stats

    stats = device_stats()
    return {"device_tasks": stats["tasks"], "fallbacks": stats["fallbacks"], **pass_stats(), **_clusters}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item._eugo_start = _activity()  # type: ignore[attr-defined]
    # Dask's own conftest (not installed with Dask) skips these the same way
    if "slow" in item.keywords and not item.config.getoption("--runslow"):
        pytest.skip("need --runslow option to run")
    if "array_expr" in item.keywords:
        pytest.skip("need --runarrayexpr option to run")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    start = getattr(item, "_eugo_start", None)
    if report.when == "teardown" and start is not None:
        # user_properties travel to pytest-xdist's controller with the report
        now = _activity()
        report.user_properties.append(
            ("eugo_activity", {k: now[k] - start.get(k, 0) for k in now if now[k] != start.get(k, 0)}))


def _phase_outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return report.outcome  # passed | skipped


#: A test's outcome is the worst of its phases'.
_RANK = {"passed": 0, "skipped": 1, "xfailed": 2, "xpassed": 3, "failed": 4, "error": 5}
_session_results: dict[str, dict[str, Any]] = {}


def _entry(nodeid: str) -> dict[str, Any]:
    return _session_results.setdefault(nodeid, {"outcome": "passed", "warnings": [], "activity": {}})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _entry(report.nodeid)
    phase = _phase_outcome(report)
    if _RANK[phase] > _RANK[entry["outcome"]]:
        entry["outcome"] = phase
    for name, value in report.user_properties:
        if name == "eugo_activity":
            entry["activity"] = value


def pytest_warning_recorded(warning_message: Any, when: str, nodeid: str, location: Any) -> None:
    if nodeid:
        _entry(nodeid)["warnings"].append(_normalise_warning(warning_message))


# object addresses and ids, hex tokens, and long numbers (zarr's memory://140224958111488)
_ADDRESSES = re.compile(r" at 0x[0-9a-f]+|0x[0-9a-f]{6,}|[0-9a-f]{32}|[0-9]{9,}")


def _normalise_warning(message: Any) -> str:
    text = _ADDRESSES.sub("…", str(message.message))
    return f"{message.category.__name__}: {text}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--eugo-report")
    if not path or hasattr(session.config, "workerinput"):  # xdist workers report through reports
        return
    results = {nodeid: {"outcome": r["outcome"], "warnings": sorted(set(r["warnings"])),
                        "activity": r["activity"]}
               for nodeid, r in sorted(_session_results.items())}
    Path(path).write_text(json.dumps({
        "eugo": session.config.getoption("--eugo"),
        "min_speedup": session.config.getoption("--eugo-min-speedup"),
        "tests": results,
    }, indent=1))


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------
def load_allowed(path: str | Path | None) -> dict[str, str]:
    """``nodeid  # reason`` lines (a nodeid ending in ``*`` matches a prefix)."""
    allowed: dict[str, str] = {}
    if path is None:
        return allowed
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, _, reason = line.partition("#")
        if not reason.strip():
            raise ValueError(f"{path}: every allowed difference needs a reason: {line!r}")
        allowed[nodeid.strip()] = reason.strip()
    return allowed


def _allowed_reason(nodeid: str, allowed: dict[str, str]) -> str | None:
    if nodeid in allowed:
        return allowed[nodeid]
    for pattern, reason in allowed.items():
        if pattern.endswith("*") and nodeid.startswith(pattern[:-1]):
            return reason
    return None


def compare(plain: dict[str, Any], eugo: dict[str, Any], allowed: dict[str, str], *,
            only_second: bool = False) -> tuple[list[str], list[str], dict[str, Any]]:
    """(unexplained differences, allowed differences, totals) between two reports;
    ``only_second``: compare only the tests the second run ran (a run over fewer modules)."""
    unexplained: list[str] = []
    explained: list[str] = []
    base, other = plain["tests"], eugo["tests"]
    if only_second:
        base = {k: v for k, v in base.items() if k in other}
    totals: Counter[str] = Counter()
    for nodeid in sorted(set(base) | set(other)):
        a, b = base.get(nodeid), other.get(nodeid)
        problems = []
        if a is None or b is None:
            problems.append("ran in one run only")
        else:
            if a["outcome"] != b["outcome"]:
                problems.append(f"outcome {a['outcome']} -> {b['outcome']}")
            added = sorted(set(b["warnings"]) - set(a["warnings"]))
            lost = sorted(set(a["warnings"]) - set(b["warnings"]))
            if added:
                problems.append(f"new warnings {added}")
            if lost:
                problems.append(f"lost warnings {lost}")
            errors = b["activity"].get("pass_errors", 0)
            if errors:
                problems.append(f"{errors} error(s) inside the eugo pass")
            for key, value in b["activity"].items():
                totals[key] += value
        if b is not None:
            totals[f"outcome {b['outcome']}"] += 1
        if not problems:
            continue
        line = f"{nodeid}: {'; '.join(problems)}"
        reason = _allowed_reason(nodeid, allowed)
        (explained if reason else unexplained).append(line + (f"  [allowed: {reason}]" if reason else ""))
    return unexplained, explained, dict(totals)


def _confirmed(first: dict[str, Any], rerun: dict[str, Any] | None) -> dict[str, Any]:
    """``first`` with the tests ``rerun`` ran again replaced by their rerun."""
    if rerun is None:
        return first
    return {**first, "tests": {**first["tests"], **rerun["tests"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a plain and an eugo conformance run.")
    parser.add_argument("plain")
    parser.add_argument("eugo")
    parser.add_argument("--allowed", default=None, help="allowed differences, one per line")
    parser.add_argument("--only-second", action="store_true",
                        help="compare only the tests the second run ran")
    parser.add_argument("--differing-out", default=None,
                        help="write the node ids of unexplained differences here (to rerun)")
    parser.add_argument("--confirm", nargs=2, metavar=("PLAIN_RERUN", "EUGO_RERUN"),
                        help="reports of the differing tests run again, one at a time in one "
                             "process: a difference counts only if it shows there too")
    parser.add_argument("--test-root", default="", help="prefix for --differing-out node ids")
    args = parser.parse_args(argv)
    plain = json.loads(Path(args.plain).read_text())
    eugo = json.loads(Path(args.eugo).read_text())
    allowed = load_allowed(args.allowed)
    first, _, _ = compare(plain, eugo, allowed, only_second=args.only_second)
    flaky: list[str] = []
    if args.confirm:
        plain_rerun, eugo_rerun = (json.loads(Path(p).read_text()) for p in args.confirm)
        rerun_ids = set(eugo_rerun["tests"])
        plain, eugo = _confirmed(plain, plain_rerun), _confirmed(eugo, eugo_rerun)
        confirmed, _, _ = compare(plain, eugo, allowed, only_second=args.only_second)
        confirmed_ids = {line.split(": ")[0] for line in confirmed}
        flaky = [line for line in first
                 if line.split(": ")[0] in rerun_ids and line.split(": ")[0] not in confirmed_ids]
    unexplained, explained, totals = compare(plain, eugo, allowed, only_second=args.only_second)
    if args.differing_out:
        Path(args.differing_out).write_text(
            "".join(f"{args.test_root}{line.split(': ')[0]}\n" for line in unexplained))
    tests = {k: v for k, v in plain["tests"].items() if not args.only_second or k in eugo["tests"]}
    outcomes = Counter(t["outcome"] for t in tests.values())
    print(f"plain: {len(tests)} tests, "
          + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
    print(f"eugo (min-speedup {eugo['min_speedup']:g}): "
          + ", ".join(f"{n} {k.split()[1]}" for k, n in sorted(totals.items())
                      if k.startswith("outcome")))
    print("eugo activity: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())
                                        if not k.startswith("outcome")))
    print(f"differences: {len(unexplained) + len(explained)} "
          f"({len(explained)} allowed, {len(unexplained)} unexplained)"
          + (f"; {len(flaky)} more did not reproduce when run alone" if flaky else ""))
    for line in explained:
        print("  allowed     " + line)
    for line in flaky:
        print("  not alone   " + line)
    for line in unexplained:
        print("  UNEXPLAINED " + line)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
