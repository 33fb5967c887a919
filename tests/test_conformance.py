"""eugo_dask.conformance, the pytest plugin of scripts/conformance.sh: the tests it selects in
distributed's suite, and the heterogeneous clusters it gives those tests with eugo on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from distributed import Client, Nanny
from distributed.utils_test import cluster, gen_cluster

import eugo_dask
from eugo_dask.conformance import _clusters, heterogeneous_clusters
from eugo_dask.testing import device_tasks

from .conftest import H200_SERVER

EMULATED = {
    "optimizations": [eugo_dask.eugo],
    "eugo.device": "emulated",
    "eugo.min-speedup": 0,
    "eugo.profile": H200_SERVER,
}
with dask.config.set(EMULATED):
    HETEROGENEOUS, ENVIRONMENT = heterogeneous_clusters()
A = np.random.default_rng(5).random((300, 200))


def pipeline():
    x = da.from_array(A, chunks=100)
    return (np.exp(x / 4) @ x.T).sum(axis=0)


EXPECTED = (np.exp(A / 4) @ A.T).sum(axis=0)


def test_select_runs_only_the_tests_whose_source_names_the_text(tmp_path):
    (tmp_path / "test_client.py").write_text(
        "import pytest\n\n"
        "def test_array():\n    da = pytest.importorskip('dask.array')\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_array_twice(n):\n    import dask.array\n\n"
        "def test_bag():\n    import dask.bag\n")
    (tmp_path / "test_other.py").write_text("def test_bag():\n    import dask.bag\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "eugo_dask.conformance", "-p", "no:cacheprovider",
                    "--eugo-select", "test_client.py:dask.array", f"--eugo-report={report}", "-q",
                    "test_client.py", "test_other.py"], cwd=tmp_path, check=True, timeout=120)
    assert sorted(json.loads(report.read_text())["tests"]) == [
        "test_client.py::test_array", "test_client.py::test_array_twice[1]",
        "test_client.py::test_array_twice[2]", "test_other.py::test_bag"]


def test_the_settings_reach_spawned_schedulers_and_workers_through_their_environment():
    assert ENVIRONMENT == {
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": "['eugo_dask.plugin', 'eugo_dask.conformance']",
        "DASK_DISTRIBUTED__WORKER__PRELOAD": "['eugo_dask.conformance']",
        "DASK_EUGO__DEVICE": "'emulated'",
        "DASK_EUGO__PROFILE": repr(H200_SERVER),
        "DASK_EUGO__MIN_SPEEDUP": "0",
    }
    parsed = dask.config.collect_env(ENVIRONMENT)
    assert parsed["distributed"] == {"scheduler": {"preload": HETEROGENEOUS["distributed.scheduler.preload"]},
                                     "worker": {"preload": HETEROGENEOUS["distributed.worker.preload"]}}
    assert parsed["eugo"] == {"device": "emulated", "profile": H200_SERVER, "min_speedup": 0}


def _sorted(resources):
    return sorted((dict(r) for r in resources), key=lambda r: sorted(r.items()))


_BEFORE = dict(_clusters)  # before the cluster below starts (this module's only one in-process)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3 + [("127.0.0.1", 1, {"resources": {"A": 2}})],
             config={**EMULATED, **HETEROGENEOUS})
async def test_a_cluster_gets_one_gpu_worker_and_eugo_scheduler_plugin(c, s, *workers):
    # the worker given resources by the test keeps its own
    assert _sorted(w.state.total_resources for w in workers) == [{}, {}, {"A": 2}, {"GPU": 1}]
    assert _sorted(ws.resources for ws in s.workers.values()) == [{}, {}, {"A": 2}, {"GPU": 1}]
    assert "eugo" in s.plugins
    assert {k: _clusters[k] - _BEFORE[k] for k in _clusters} == {"clusters": 1, "gpu_workers": 1}
    assert_eq(await c.compute(pipeline()), EXPECTED)
    (gpu,) = (w for w in workers if "GPU" in w.state.total_resources)
    assert device_tasks(gpu) > 0
    assert sum(device_tasks(w) for w in workers if w is not gpu) == 0


@pytest.mark.slow
@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1)] * 3, config={**EMULATED, **HETEROGENEOUS},
             timeout=120)
async def test_workers_under_nannies_get_the_same(c, s, *nannies):
    # a nanny hands its worker process this process's config
    resources = await c.run(lambda dask_worker: dask_worker.state.total_resources)
    assert _sorted(resources.values()) == [{}, {}, {"GPU": 1}]
    assert_eq(await c.compute(pipeline()), EXPECTED)
    ran = await c.run(lambda dask_worker: device_tasks(dask_worker))
    assert [ran[w] > 0 for w in sorted(ran, key=lambda w: len(resources[w]))] == [False, False, True]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_spawned_cluster_gets_one_gpu_worker_and_eugo_scheduler_plugin(monkeypatch):
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    with dask.config.set(EMULATED), cluster(nworkers=3) as (scheduler, _), Client(scheduler["address"]) as client:
        resources = client.run(lambda dask_worker: dask_worker.state.total_resources)
        assert _sorted(resources.values()) == [{}, {}, {"GPU": 1}]
        assert client.run_on_scheduler(lambda dask_scheduler: "eugo" in dask_scheduler.plugins)
        assert_eq(client.compute(pipeline()).result(timeout=60), EXPECTED)
        ran = client.run(lambda dask_worker: device_tasks(dask_worker))
        assert [ran[w] > 0 for w in sorted(ran, key=lambda w: len(resources[w]))] == [False, False, True]


def test_plugin_refuses_a_config_snapshot_taken_before_eugo(tmp_path):
    # distributed.utils_test is imported by this project's own tests: a run that loads it first
    (tmp_path / "conftest.py").write_text("import distributed.utils_test\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "eugo_dask.conformance", "-p", "no:cacheprovider",
                          f"--eugo-distributed={tmp_path}", "--eugo=on", "-q", "test_x.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "distributed.utils_test was imported before eugo's config was set" in run.stderr


def test_vendored_tests_are_distributed_s_own_files():
    # byte-identical to upstream: each file's git blob id is the one conformance/distributed/README.md
    # records for it (git hash-object)
    import hashlib

    root = Path(__file__).parent.parent / "conformance" / "distributed"
    recorded = {}
    for line in (root / "README.md").read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.split("|")[1:-1]]
        if len(cells) == 2 and len(cells[1]) == 40:
            recorded[cells[0].split(" ")[0].strip("`")] = cells[1]
    assert len(recorded) == 5
    for path, blob in recorded.items():
        data = (root / path).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, path
