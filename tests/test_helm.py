"""The Helm chart, offline: lint, schema, Kubernetes validation, semantic checks, and the
rendered container commands run as real local processes against each other."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmValuesError

from .cluster import DASK_CLI, free_port

CHART = Path(__file__).resolve().parents[1] / "helm" / "eugo-dask"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
VALUE_SETS = [("default", {})] + [(p.stem, yaml.safe_load(p.read_text())) for p in CI_VALUES]
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
MONITORING_CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}


def render(values: dict, name: str = "demo") -> list[dict]:
    manifests = Chart.load(CHART).render(values, name=name, namespace="dask")
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_ci_values_files_cover_the_options():
    assert {p.stem for p in CI_VALUES} >= {"gpu-off", "cuda-worker", "calibration", "ingress",
                                           "pdb-monitoring"}


@pytest.mark.parametrize("name, values", VALUE_SETS, ids=[n for n, _ in VALUE_SETS])
def test_lint_strict_reports_nothing(name, values):
    report = helm_python.lint(str(CHART), values, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name, values", VALUE_SETS, ids=[n for n, _ in VALUE_SETS])
def test_manifests_validate_strictly(name, values, version):
    docs = render(values)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in MONITORING_CRDS:
            continue  # CRDs: no schema in kubernetes-validate, allowed explicitly
        # an unknown kind raises SchemaNotFoundError, which fails the test
        kubernetes_validate.validate(doc, version, strict=True)


def test_semantics_the_schemas_miss():
    docs = render(yaml.safe_load((CHART / "ci" / "pdb-monitoring.yaml").read_text()))
    deployments = by_kind(docs, "Deployment")
    selectors = {}
    for name, d in deployments.items():
        spec = d["spec"]
        labels = spec["template"]["metadata"]["labels"]
        for k, v in spec["selector"]["matchLabels"].items():
            assert labels[k] == v, (name, k)  # selectors match their pods
        selectors[name] = json.dumps(spec["selector"]["matchLabels"], sort_keys=True)
        pod = spec["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {"mountPath": "/tmp", "name": "scratch"} in container["volumeMounts"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"
        assert "CUDA_VISIBLE_DEVICES" not in json.dumps(container)
    assert len(set(selectors.values())) == len(selectors) == 3  # distinct groups
    scheduler = deployments["demo-eugo-dask-scheduler"]
    assert scheduler["spec"]["strategy"]["type"] == "Recreate"
    assert scheduler["spec"]["replicas"] == 1
    command = scheduler["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["dask", "scheduler"] and "--preload" in command
    assert command[command.index("--preload") + 1] == "eugo_dask.plugin"
    gpu = deployments["demo-eugo-dask-gpu-worker"]["spec"]["template"]["spec"]
    (gpu_container,) = gpu["containers"]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1  # = gpusPerWorker
    assert "--resources" in gpu_container["command"]
    assert gpu_container["command"][gpu_container["command"].index("--resources") + 1] == "GPU=1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    cpu_container = deployments["demo-eugo-dask-cpu-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "--resources" not in cpu_container["command"]
    assert "nvidia.com/gpu" not in json.dumps(cpu_container["resources"])
    assert {"name": "DASK_EUGO__DEVICE", "value": "none"} in cpu_container["env"]
    service = by_kind(docs, "Service")["demo-eugo-dask-scheduler"]
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in service["spec"]["ports"]} == {8786, 8787}
    assert set(by_kind(docs, "PodDisruptionBudget")) == {"demo-eugo-dask-cpu-worker", "demo-eugo-dask-gpu-worker"}
    assert not by_kind(docs, "HorizontalPodAutoscaler")


def test_cuda_worker_mode():
    docs = render(yaml.safe_load((CHART / "ci" / "cuda-worker.yaml").read_text()))
    pod = by_kind(docs, "Deployment")["demo-eugo-dask-gpu-worker"]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[:3] == ["dask", "cuda", "worker"]
    assert command[command.index("--rmm-pool-size") + 1] == "24GB"
    assert command[command.index("--device-memory-limit") + 1] == "0.8"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert pod["runtimeClassName"] == "nvidia"


def test_calibration_job_can_write_only_its_configmap():
    docs = render(yaml.safe_load((CHART / "ci" / "calibration.yaml").read_text()))
    (job,) = by_kind(docs, "Job").values()
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True  # the one pod that needs the API
    assert "eugo-dask calibrate --quick --gpu-preset h100-sxm" in pod["containers"][0]["command"][2]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    (role,) = by_kind(docs, "Role").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["demo-eugo-dask-eugo-profile"],
                              "verbs": ["get", "patch"]}]
    assert "demo-eugo-dask-eugo-profile" in by_kind(docs, "ConfigMap")


@pytest.mark.parametrize(
    "values, match",
    [
        ({"gpuWorkers": {"mode": "gpu"}}, r"mode"),
        ({"eugo": {"device": "tpu"}}, r"device"),
        ({"gpuWorkers": {"gpusPerWorker": 0}}, r"gpusPerWorker"),
        ({"gpuWorkers": {"gpusPerWorker": 2}}, r"gpusPerWorker"),  # worker mode: one GPU per pod
        ({"cpuWorkers": {"replica": 3}}, r"replica"),
        ({"eugo": {"minSpeedup": -1}}, r"minSpeedup"),
        ({"calibration": {"gpuPreset": "h300"}}, r"gpuPreset"),
    ],
)
def test_bad_values_rejected_with_a_clear_message(values, match):
    with pytest.raises(HelmValuesError, match=match):
        Chart.load(CHART).validate_schema(values)


def _container(docs: list[dict], deployment: str) -> dict:
    return by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"][0]


def _local(command: list[str], env: list[dict], rewrites: dict[str, str], pod_name: str,
           scratch: Path) -> tuple[list[str], dict[str, str]]:
    """A container's command and environment for a local process: addresses and ports
    rewritten, $(VAR) expanded, the dask CLI of this environment."""
    variables = {e["name"]: e.get("value", pod_name) for e in env}
    out = []
    for arg in command:
        for old, new in rewrites.items():
            arg = arg.replace(old, new)
        out.append(re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], arg))
    assert out[0] == "dask"
    out[0] = DASK_CLI
    local_env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    root = str(Path(__file__).resolve().parents[1])
    local_env["PYTHONPATH"] = root
    for name, value in variables.items():
        local_env[name] = str(scratch) + value[4:] if value.startswith("/tmp") else value
    return out, local_env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rendered_commands_run_as_local_processes(tmp_path):
    values = {"eugo": {"device": "emulated"}, "cpuWorkers": {"replicas": 1, "memoryLimit": "2GiB"},
              "gpuWorkers": {"memoryLimit": "2GiB"}}
    docs = render(values)
    port, dash = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    rewrites = {"tcp://demo-eugo-dask-scheduler:8786": address, ":8787": f":{dash}",
                ":8788": ":0"}
    procs, logs = [], []
    try:
        for deployment, name in (("demo-eugo-dask-scheduler", "scheduler"),
                                 ("demo-eugo-dask-gpu-worker", "gpu-worker-0"),
                                 ("demo-eugo-dask-cpu-worker", "cpu-worker-0")):
            c = _container(docs, deployment)
            command, env = _local(c["command"], c["env"], rewrites, name, tmp_path)
            if name == "scheduler":
                command[command.index("--port") + 1] = str(port)
            log = open(tmp_path / f"{name}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            if name == "scheduler":
                time.sleep(2)
        (test_pod,) = [d for d in docs if d["kind"] == "Pod"]
        c = test_pod["spec"]["containers"][0]
        script = str(CHART / "files" / "helm-test.py")
        command, env = _local(["dask"], c["env"], rewrites, "test", tmp_path)
        env["DASK_SCHEDULER_ADDRESS"] = address
        result = subprocess.run([sys.executable, script], env=env, capture_output=True,
                                text=True, timeout=180)
        logs_text = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
        assert result.returncode == 0, result.stdout + result.stderr + logs_text
        assert "connected to" in result.stdout and result.stdout.strip().endswith("ok")
        on_gpu = int(re.search(r"eugo: (\d+) tasks ran on GPU workers", result.stdout).group(1))
        assert on_gpu > 0
        # the scheduler loaded the plugin and the GPU group's worker ran the device work
        from distributed import Client

        import eugo_dask

        with Client(address, timeout=30) as client:
            assert "eugo" in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
            stats = client.run(eugo_dask.device_stats)
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            by_name = {names[a]: s for a, s in stats.items()}
        assert by_name["gpu-worker-0"]["tasks"] > 0 and by_name["cpu-worker-0"]["tasks"] == 0
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
