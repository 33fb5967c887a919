"""eugo_dask.k8s against a stand-in API server: the key it writes, the calibration it skips,
the API server's own error message, IPv6 addresses."""

from __future__ import annotations

import pytest
import yaml

from eugo_dask import k8s
from eugo_dask.k8s import ApiError, api_server_url, calibrate_into, inputs_key, main, store_profile

from .fake_k8s import FORBIDDEN, FakeApiServer

CONFIGMAP = "demo-eugo-dask-eugo-profile"


@pytest.fixture
def api():
    with FakeApiServer() as server:
        server.configmaps[CONFIGMAP] = {}
        yield server


def client(api: FakeApiServer) -> dict:
    return {"api_url": api.url, "token": "t0ken"}


@pytest.mark.parametrize("host, url", [
    ("10.96.0.1", "https://10.96.0.1:443"),
    ("kubernetes.default.svc", "https://kubernetes.default.svc:443"),
    ("fd00:10:96::1", "https://[fd00:10:96::1]:443"),
    ("[fd00:10:96::1]", "https://[fd00:10:96::1]:443"),
])
def test_api_server_url_brackets_ipv6(host, url):
    assert api_server_url(host, "443") == url


def test_store_patches_only_its_key(api, tmp_path):
    api.configmaps[CONFIGMAP] = {"other": "kept"}
    profile = tmp_path / "profile.yaml"
    profile.write_text("base: l4\n")
    status = store_profile(profile, CONFIGMAP, "dask", key="calibrated.yaml", inputs="job-1", **client(api))
    assert status == 200
    (request,) = api.requests
    assert request == {"method": "PATCH", "path": f"/api/v1/namespaces/dask/configmaps/{CONFIGMAP}",
                       "auth": "Bearer t0ken", "type": "application/merge-patch+json",
                       "body": {"data": {"calibrated.yaml": "base: l4\n", "calibrated.inputs": "job-1"}}}
    assert api.configmaps[CONFIGMAP] == {"other": "kept", "calibrated.yaml": "base: l4\n",
                                         "calibrated.inputs": "job-1"}


def test_inputs_key_follows_the_profile_key():
    assert inputs_key("calibrated.yaml") == "calibrated.inputs"
    assert inputs_key("t4.json") == "t4.inputs"


@pytest.fixture
def fake_calibration(monkeypatch):
    runs = []

    def calibrate(*, quick, gpu_preset, threads, progress):
        runs.append({"quick": quick, "gpu_preset": gpu_preset, "threads": threads})
        return {"name": "calibrated", "base": gpu_preset}

    monkeypatch.setattr("eugo_dask.calibrate.calibrate", calibrate)
    return runs


def test_calibrate_measures_once_per_inputs(api, fake_calibration):
    message = calibrate_into(CONFIGMAP, "dask", inputs="job-a", quick=True, gpu_preset="l4",
                             threads=2, **client(api))
    assert message.startswith("stored profile 'calibrated' as calibrated.yaml")
    assert fake_calibration == [{"quick": True, "gpu_preset": "l4", "threads": 2}]
    stored = api.configmaps[CONFIGMAP]
    assert yaml.safe_load(stored["calibrated.yaml"]) == {"name": "calibrated", "base": "l4"}
    assert stored["calibrated.inputs"] == "job-a"
    # the same inputs again (a Job recreated after its TTL, a reinstall): nothing measured
    message = calibrate_into(CONFIGMAP, "dask", inputs="job-a", gpu_preset="l4", **client(api))
    assert "already holds calibrated.yaml measured for job-a" in message
    assert len(fake_calibration) == 1 and [r["method"] for r in api.requests] == ["GET", "PATCH", "GET"]
    # other inputs (another image, node type, thread count): measured again
    calibrate_into(CONFIGMAP, "dask", inputs="job-b", gpu_preset="l4", **client(api))
    assert len(fake_calibration) == 2 and api.configmaps[CONFIGMAP]["calibrated.inputs"] == "job-b"


def test_api_errors_carry_the_servers_message(api, tmp_path):
    api.error = (403, FORBIDDEN)
    profile = tmp_path / "profile.yaml"
    profile.write_text("base: h200\n")
    with pytest.raises(ApiError, match=r'PATCH .*/configmaps/demo-eugo-dask-eugo-profile: HTTP 403: '
                                       r'configmaps "demo-eugo-dask-eugo-profile" is forbidden: User') as info:
        store_profile(profile, CONFIGMAP, "dask", **client(api))
    assert info.value.status == 403
    api.error = (500, {})  # a reply without a Status: its raw text
    with pytest.raises(ApiError, match=r"HTTP 500: \{\}"):
        store_profile(profile, CONFIGMAP, "dask", **client(api))


def test_cli_reports_the_api_error_and_fails(api, tmp_path, capsys, monkeypatch):
    api.error = (403, FORBIDDEN)
    profile = tmp_path / "profile.yaml"
    profile.write_text("base: h200\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setattr(k8s.ConfigMapClient, "in_cluster", classmethod(
        lambda cls, configmap, namespace=None, **kw: cls(configmap, namespace or "dask", api.url, "t")))
    assert main(["store", str(profile), CONFIGMAP]) == 1
    assert "cannot patch resource" in capsys.readouterr().err
    api.error = None
    assert main(["store", str(profile), CONFIGMAP, "--key", "t4.yaml"]) == 0
    assert api.configmaps[CONFIGMAP] == {"t4.yaml": "base: h200\n"}


# --- retire: a worker pod's preStop hook -----------------------------------------------------------
def _random(n: int):
    import numpy as np

    return np.random.default_rng().random(n)  # a recomputation would give other numbers


@pytest.mark.timeout(120)
def test_retire_moves_a_pods_results_then_closes_its_workers():
    """Against a real scheduler: the workers of pod "pod-b" (one per GPU, as dask cuda worker
    names them: pod-b-0, pod-b-1) are retired, their results held elsewhere (the same numbers:
    moved, not computed again), the other pods' workers untouched."""
    import os
    import subprocess
    import sys

    import numpy as np
    from distributed import Client, LocalCluster, Worker, wait

    names = ("pod-a", "pod-b-0", "pod-b-1", "pod-b-x", "pod-bb")
    # in this process, on TCP: the command runs in a process of its own
    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=":0") as cluster:
        cluster.worker_spec.update({n: {"cls": Worker, "options": {"nthreads": 1, "name": n}} for n in names})
        cluster.scale(len(names))
        with Client(cluster) as client:
            client.wait_for_workers(len(names), timeout=60)
            futures = {n: client.submit(_random, 1000, workers=[n], pure=False, key=f"r-{n}") for n in names}
            wait(list(futures.values()), timeout=30)
            before = {n: f.result(timeout=30) for n, f in futures.items()}
            result = subprocess.run([sys.executable, "-m", "eugo_dask.k8s", "retire", cluster.scheduler_address,
                                     "--timeout", "60"], env=os.environ | {"POD_NAME": "pod-b"},
                                    capture_output=True, text=True, timeout=90)
            assert result.returncode == 0, result.stderr
            assert "retired pod-b-0, pod-b-1 through" in result.stdout
            left = {ws.name for ws in cluster.scheduler.workers.values()}
            assert left == {"pod-a", "pod-b-x", "pod-bb"}
            for n, f in futures.items():
                assert np.array_equal(f.result(timeout=30), before[n]), n
            holders = client.who_has([futures["pod-b-0"], futures["pod-b-1"]])
            assert all(holders[k] for k in holders)
            again = subprocess.run([sys.executable, "-m", "eugo_dask.k8s", "retire", cluster.scheduler_address,
                                    "--name", "pod-c"], capture_output=True, text=True, timeout=90)
            assert again.returncode == 0 and "no worker of pod pod-c is known" in again.stdout


@pytest.mark.timeout(120)
def test_retire_says_when_no_other_worker_can_take_the_results(capsys):
    """The last worker cannot move what only it holds: the scheduler keeps it, and retire says
    so (it said "retired" whatever the scheduler did)."""
    from distributed import Client, LocalCluster, Worker, wait

    with LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=":0") as cluster:
        cluster.worker_spec["pod-a"] = {"cls": Worker, "options": {"nthreads": 1, "name": "pod-a"}}
        cluster.scale(1)
        with Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
            held = client.submit(_random, 100, pure=False)
            wait(held, timeout=30)
            code = main(["retire", cluster.scheduler_address, "--name", "pod-a", "--timeout", "60"])
            err = capsys.readouterr().err
            assert code == 1 and f"error: {cluster.scheduler_address} could not retire pod-a: no other worker" in err
            assert [ws.name for ws in cluster.scheduler.workers.values()] == ["pod-a"]


def test_retire_says_when_the_scheduler_cannot_be_reached(capsys):
    from eugo_dask.testing import free_port

    code = main(["retire", f"tcp://127.0.0.1:{free_port()}", "--name", "pod-a", "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1 and "error: retiring the workers of pod pod-a through tcp://127.0.0.1:" in err
