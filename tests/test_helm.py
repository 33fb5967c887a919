"""The Helm chart, offline: lint, schema, Kubernetes validation, kustomize, semantic checks,
upgrades, and the rendered container commands run as real local processes against each other."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmRenderError, HelmValuesError

from .cluster import DASK_CLI, free_port
from .fake_k8s import FakeApiServer, make_certificate

CHART = Path(__file__).resolve().parents[1] / "helm" / "eugo-dask"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
VALUE_SETS = {"default": {}} | {p.stem: yaml.safe_load(p.read_text()) for p in CI_VALUES}
NAMES = list(VALUE_SETS)
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
MONITORING_CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}
#: KEDA's ScaledObject CRD as KEDA's repository holds it (the commit in the file's header)
KEDA_CRD = Path(__file__).parent / "fixtures" / "keda" / "keda.sh_scaledobjects.yaml"
CRDS = MONITORING_CRDS | {("keda.sh/v1alpha1", "ScaledObject")}
KUBECTL = str(Path(sys.executable).with_name("kubectl"))
PRESETS = {"h200", "h100-sxm", "h100-pcie", "a100", "l4", "t4"}


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML that rejects a mapping with the same key twice (PyYAML keeps the last silently;
    kustomize, Flux and Argo CD refuse the manifest)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}",
                                                    node.start_mark)
        return super().construct_mapping(node, deep=deep)


def render_text(values: dict, **options) -> dict[str, str]:
    options = {"name": "demo", "namespace": "dask"} | options
    return Chart.load(CHART).render(values, **options)


def render(values: dict, **options) -> list[dict]:
    docs = []
    for path, text in render_text(values, **options).items():
        if not path.endswith("NOTES.txt"):
            docs += [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d]
    return docs


@cache
def rendered(name: str) -> tuple[dict, ...]:
    """The manifests of one of VALUE_SETS (do not modify them)."""
    return tuple(render(VALUE_SETS[name]))


def by_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs) -> dict[str, dict]:
    """Every pod template and pod, by the name of its object."""
    pods = {}
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            pods[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            pods[d["metadata"]["name"]] = d["spec"]
    return pods


def gpus(pod: dict, resource: str = "nvidia.com/gpu") -> int:
    return sum(c.get("resources", {}).get("limits", {}).get(resource, 0) for c in pod["containers"])


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def args_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def calibration_job(docs) -> dict:
    (job,) = by_kind(docs, "Job").values()
    return job


# --- lint, schema, validation, kustomize ------------------------------------------------------
def test_ci_values_files_cover_the_options():
    assert set(NAMES) >= {"default", "gpu-off", "cuda-worker", "calibration", "ingress",
                          "pdb-monitoring", "two-gpu-types", "everything", "tls", "autoscaling"}


@pytest.mark.parametrize("name", NAMES)
def test_lint_strict_reports_nothing(name):
    report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", NAMES)
def test_manifests_validate_strictly(name, version):
    docs = rendered(name)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # CRDs: no schema in kubernetes-validate (ScaledObject: its own CRD's, below)
        # an unknown kind raises SchemaNotFoundError, which fails the test
        kubernetes_validate.validate(doc, version, strict=True)


def _crd_schema(crd: dict, version: str) -> dict:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields of ``value`` its structural schema does not declare: the API server prunes them
    silently (and kubectl --validate=strict refuses them), so a misspelt field would do nothing."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and "properties" in schema:
        out = []
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [f for key, item in value.items() for f in unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")]
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value) for f in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_scaled_objects_validate_against_kedas_crd(name):
    """The ScaledObjects against the openAPIV3Schema of KEDA's own CRD (vendored from
    kedacore/keda): types, required fields, enums, and no field the API server would prune."""
    import jsonschema

    crd = next(d for d in yaml.safe_load_all(KEDA_CRD.read_text()) if d)
    schema = _crd_schema(crd, "v1alpha1")
    scaled = [d for d in rendered(name) if d["kind"] == "ScaledObject"]
    assert bool(scaled) == (name == "autoscaling")
    for doc in scaled:
        assert doc["apiVersion"] == f"{crd['spec']['group']}/v1alpha1"
        jsonschema.validate(doc, schema)
        assert unknown_fields(doc["spec"], schema["properties"]["spec"]) == []
    # the check has teeth: a misspelt field, a wrong type, a missing target
    spec = schema["properties"]["spec"]
    assert unknown_fields({"minReplicas": 0}, spec) == [".minReplicas"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "metrics-api", "metadata": {"targetValue": 32}}]}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": {"triggers": []}}, schema)


def kustomize(tmp_path: Path, manifests: str) -> subprocess.CompletedProcess:
    (tmp_path / "chart.yaml").write_text(manifests)
    (tmp_path / "kustomization.yaml").write_text("resources: [chart.yaml]\n")
    return subprocess.run([KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", NAMES)
def test_kubectl_kustomize_takes_the_rendered_chart(name, tmp_path):
    """What post-renderers, Flux and Argo CD do with the chart's output."""
    texts = render_text(VALUE_SETS[name])
    result = kustomize(tmp_path, "\n---\n".join(t for p, t in texts.items() if not p.endswith("NOTES.txt")))
    assert result.returncode == 0, result.stderr
    out = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert len(out) == len(rendered(name))


def test_kustomize_rejects_duplicate_label_keys(tmp_path):
    """The check above has teeth: the label keys the chart once wrote twice."""
    manifest = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n  labels:\n"
                "    app.kubernetes.io/name: a\n    app.kubernetes.io/name: a\n")
    result = kustomize(tmp_path, manifest)
    assert result.returncode != 0 and "already" in result.stderr.lower() + result.stdout.lower()
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate keys"):
        yaml.load(manifest, Loader=UniqueKeyLoader)


def test_renders_as_a_subchart_of_an_umbrella_chart_with_global_values(tmp_path):
    """Helm passes `global` to every subchart: the schema must take it (it refused it, so an
    umbrella chart did not render)."""
    umbrella = tmp_path / "platform"
    shutil.copytree(CHART, umbrella / "charts" / "eugo-dask")
    (umbrella / "templates").mkdir()
    (umbrella / "Chart.yaml").write_text(
        "apiVersion: v2\nname: platform\nversion: 0.1.0\n"
        "dependencies:\n  - name: eugo-dask\n    version: 0.2.0\n")
    values = {"global": {"imageRegistry": "registry.example.com"},
              "eugo-dask": {"workerGroups": [{"name": "cpu", "replicas": 3}]}}
    texts = Chart.load(umbrella).render(values, name="demo", namespace="dask")
    docs = [d for p, t in texts.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    assert by_kind(docs, "Deployment")["demo-eugo-dask-cpu-worker"]["spec"]["replicas"] == 3
    report = helm_python.lint(str(umbrella), values, strict=True, with_subcharts=True)
    assert report["errors"] == [], report


@pytest.mark.parametrize(
    "values, match",
    [
        ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200", "mode": "gpu"}}]}, r"workerGroups/0/gpu/mode"),
        ({"eugo": {"device": "tpu"}}, r"eugo/device"),
        ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200", "count": 0}}]}, r"workerGroups/0/gpu/count"),
        # worker mode: one GPU per pod
        ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200", "count": 2}}]}, r"workerGroups/0/gpu/count"),
        ({"workerGroups": [{"name": "gpu", "gpu": {"count": 1}}]}, r"workerGroups/0/gpu.*type"),
        ({"workerGroups": [{"name": "cpu", "replica": 3}]}, r"replica"),
        ({"workerGroups": [{"replicas": 3}]}, r"workerGroups/0.*name"),
        ({"workerGroups": [{"name": "GPU_big"}]}, r"workerGroups/0/name"),
        ({"workerGroups": []}, r"workerGroups"),
        ({"workerDefaults": {"livenessProbe": {"httpget": {}}}}, r"workerDefaults/livenessProbe.*httpget"),
        ({"eugo": {"minSpeedup": -1}}, r"eugo/minSpeedup"),
        ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h300"}}]}, r"workerGroups/0/gpu/type"),
        ({"networkPolicy": {"clients": [{}]}}, r"networkPolicy/clients/0"),
        ({"imagePullSecrets": ["regcred"]}, r"imagePullSecrets/0"),
    ],
)
def test_bad_values_rejected_with_a_clear_message(values, match):
    with pytest.raises(HelmValuesError, match=match):
        Chart.load(CHART).validate_schema(values)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"workerGroups": [{"name": "a"}, {"name": "a"}]},
         r'workerGroups\[1\].name: "a" is used by an earlier group'),
        ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200", "count": 4, "mode": "cuda-worker"}}]},
         r"workerGroups\[0\] \(gpu\).memoryLimit: dask cuda worker applies it to each of its 4 GPU "
         r"processes, so it must be auto.*got \"4GiB\""),
        ({"workerGroups": [{"name": "cpu"}], "calibration": {"enabled": True}},
         r"calibration.enabled: the calibration Job measures the first GPU group, and workerGroups has none"),
    ],
)
def test_values_the_schema_cannot_judge_fail_the_render(values, match):
    with pytest.raises(HelmRenderError, match=match):
        render(values)


@pytest.mark.parametrize("memory_limit, container", [("17GiB", "16Gi"), ("17.2GB", "16Gi"), ("18 G", "16Gi"), ("2Gi", "1Gi")])
def test_a_memory_limit_above_the_containers_is_refused(memory_limit, container):
    """Dask spills, pauses and restarts a worker by its memoryLimit: above the container's limit
    the kernel kills it first (OOMKilled), and nothing tied the two."""
    group = {"name": "cpu", "memoryLimit": memory_limit, "resources": {"limits": {"memory": container}}}
    with pytest.raises(HelmRenderError, match=rf"workerGroups\[0\] \(cpu\).memoryLimit: {memory_limit} is above the "
                                              rf"container's memory limit {container} \(resources.limits.memory\)"):
        render({"workerGroups": [group]})


@pytest.mark.parametrize("memory_limit, container", [("16GiB", "16Gi"), ("16 GB", "16Gi"), ("0.9", "16Gi"), ("auto", "1Gi"), ("1Gi", "1Gi")])
def test_a_memory_limit_at_or_below_the_containers_renders(memory_limit, container):
    group = {"name": "cpu", "memoryLimit": memory_limit, "resources": {"limits": {"memory": container}}}
    (worker,) = pod_specs(render({"workerGroups": [group]}))["demo-eugo-dask-cpu-worker"]["containers"]
    assert args_after(worker["args"], "--memory-limit") == memory_limit


LONG_RELEASE = "r" * 53  # the longest release name Helm allows


@pytest.mark.parametrize("name", ["default", "everything", "calibration", "two-gpu-types"])
def test_every_name_and_label_fits_63_characters_with_a_53_character_release_name(name):
    """The API server refuses names (and label values) over 63 characters: the profile ConfigMap
    was 76 with a 53-character release name."""
    values = VALUE_SETS[name] | {"ingress": {"enabled": True}}
    docs = render(values, name=LONG_RELEASE, namespace="n" * 63)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(set(names)) == len(names)
    for d in docs:
        assert len(d["metadata"]["name"]) <= 63, (d["kind"], d["metadata"]["name"])
        assert d["metadata"]["name"].startswith("r" * 20), d["metadata"]["name"]
        templates = [d["spec"]["template"]["metadata"]] if d["kind"] in ("Deployment", "Job") else []
        for meta in [d["metadata"], *templates]:
            for key, value in meta.get("labels", {}).items():
                assert len(str(value)) <= 63, (d["kind"], key, value)
    by = {k: by_kind(docs, k) for k in ("Deployment", "Service", "ConfigMap")}
    (scheduler,) = [n for n in by["Service"] if n.endswith("-scheduler")]
    assert scheduler in by["Deployment"]
    # what refers to a name finds it: the workers' scheduler address, the mounted ConfigMaps
    for pod_name, pod in pod_specs(docs).items():
        (c,) = pod["containers"]
        if c["args"][0] == "dask" and "scheduler" not in c["args"][:2]:
            assert f"://{scheduler}:8786" in " ".join(c["args"]), pod_name
        for volume in pod["volumes"]:
            if "configMap" in volume and volume["configMap"]["name"].startswith("rrr"):  # the chart's
                assert volume["configMap"]["name"] in by["ConfigMap"], (pod_name, volume)
    notes = render_text(values, name=LONG_RELEASE)["eugo-dask/templates/NOTES.txt"]
    assert f"svc/{scheduler} " in notes
    assert all(f"deployment/{n}" in notes for n in by["Deployment"] if n.endswith("-worker"))


# --- pods -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_pods_run_under_tini_with_their_own_labels_and_pull_secrets(name):
    docs = rendered(name)
    secrets = VALUE_SETS[name].get("imagePullSecrets")
    for pod_name, pod in pod_specs(docs).items():
        for c in pod["containers"]:
            # `command` would replace the image's ENTRYPOINT (tini) and make Python PID 1
            assert "command" not in c and c["args"], (pod_name, c["name"])
        assert pod.get("imagePullSecrets") == secrets, pod_name
        assert pod["automountServiceAccountToken"] is (pod_name.startswith("demo-eugo-dask-calibrate")), pod_name
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {"mountPath": "/tmp", "name": "scratch"} in container["volumeMounts"]
        (scratch,) = [v for v in pod["volumes"] if v["name"] == "scratch"]
        assert scratch["emptyDir"]["sizeLimit"], pod_name
        for port in container.get("ports", []):
            assert port["name"].startswith(("tcp-", "http-")), (pod_name, port)  # Istio
        assert "CUDA_VISIBLE_DEVICES" not in json.dumps(container)
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            for k, v in d["spec"].get("selector", {}).get("matchLabels", {}).items():
                assert labels[k] == v, (d["metadata"]["name"], k)  # selectors match their pods
            assert "helm.sh/chart" not in labels  # a chart upgrade alone restarts no pod


@pytest.mark.parametrize("name", NAMES)
def test_pods_without_gpus_see_none_and_stay_off_gpu_nodes(name):
    pods = pod_specs(rendered(name))
    assert any(gpus(p) == 0 for p in pods.values())
    for pod_name, pod in pods.items():
        (container,) = pod["containers"]
        affinity = pod.get("affinity", {}).get("nodeAffinity")
        if gpus(pod):
            assert "NVIDIA_VISIBLE_DEVICES" not in env(container)  # the device plugin sets it
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert "nvidia.com/gpu.present" not in json.dumps(affinity or {})
        else:
            # the CUDA base image sets NVIDIA_VISIBLE_DEVICES=all
            assert env(container)["NVIDIA_VISIBLE_DEVICES"] == "void", pod_name
            terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            keys = {e["key"] for t in terms for e in t["matchExpressions"]}
            assert keys == {"nvidia.com/gpu.present", "cloud.google.com/gke-accelerator",
                            "k8s.amazonaws.com/accelerator"}, pod_name
            assert "tolerations" not in pod or all(t.get("key") != "nvidia.com/gpu" for t in pod["tolerations"])


def test_a_group_affinity_with_node_affinity_replaces_the_non_gpu_one():
    own = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}
    docs = render({"workerGroups": [{"name": "cpu", "affinity": {"nodeAffinity": own}}],
                   "nonGpuNodeAffinity": None})
    pods = pod_specs(docs)
    assert pods["demo-eugo-dask-cpu-worker"]["affinity"] == {"nodeAffinity": own}
    assert "affinity" not in pods["demo-eugo-dask-scheduler"]  # nonGpuNodeAffinity off


@pytest.mark.parametrize("name", NAMES)
def test_gpu_groups_roll_without_a_spare_gpu(name):
    for d in by_kind(rendered(name), "Deployment").values():
        pod = d["spec"]["template"]["spec"]
        strategy = d["spec"].get("strategy")
        if d["metadata"]["name"].endswith("-scheduler"):
            assert strategy == {"type": "Recreate"}
        elif gpus(pod):
            assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_default_chart():
    docs = rendered("default")
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"demo-eugo-dask-scheduler", "demo-eugo-dask-cpu-worker", "demo-eugo-dask-gpu-worker"}
    scheduler = deployments["demo-eugo-dask-scheduler"]
    assert scheduler["spec"]["replicas"] == 1
    template = scheduler["spec"]["template"]
    assert template["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    (container,) = template["spec"]["containers"]
    assert container["args"][:2] == ["dask", "scheduler"]
    assert args_after(container["args"], "--preload") == "eugo_dask.plugin"
    assert {"name": "profile", "mountPath": "/etc/eugo", "readOnly": True} in container["volumeMounts"]
    assert container["livenessProbe"]["timeoutSeconds"] >= 10
    assert env(container)["DASK_EUGO__CLUSTER_PROFILE"] == '["h200"]'
    assert "DASK_EUGO__PROFILE" not in json.dumps(docs)  # clients keep auto: the cluster decides
    gpu = deployments["demo-eugo-dask-gpu-worker"]["spec"]["template"]["spec"]
    (gpu_container,) = gpu["containers"]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert args_after(gpu_container["args"], "--resources") == "GPU=1"
    assert env(gpu_container)["DASK_EUGO__DEVICE"] == "auto"
    cpu = deployments["demo-eugo-dask-cpu-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "--resources" not in cpu["args"] and "nvidia.com/gpu" not in json.dumps(cpu["resources"])
    assert env(cpu)["DASK_EUGO__DEVICE"] == "none"
    for worker in (gpu_container, cpu):
        # a busy worker must not be killed: no liveness probe unless asked for
        assert "livenessProbe" not in worker and worker["readinessProbe"]["httpGet"]["path"] == "/health"
    service = by_kind(docs, "Service")["demo-eugo-dask-scheduler"]
    assert service["spec"]["type"] == "ClusterIP"
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("tcp-comm", 8786), ("http-dashboard", 8787)}
    assert not by_kind(docs, "HorizontalPodAutoscaler") and not by_kind(docs, "Job")
    (test_pod,) = by_kind(docs, "Pod").values()
    test_env = env(test_pod["spec"]["containers"][0])
    assert test_env["EUGO_TEST_WORKERS"] == "3" and test_env["EUGO_TEST_PROFILE"] == "h200"


def test_a_client_setting_changes_no_pod_template():
    """eugo.minSpeedup and eugo.learn are client defaults: changing one changed the scheduler's
    and every worker's pod template, and so restarted the cluster (the scheduler with Recreate,
    losing every result)."""
    values = VALUE_SETS["everything"]
    before = render(values, revision=1, is_install=True)
    after = render(values | {"eugo": values["eugo"] | {"minSpeedup": 3.0, "learn": True}}, revision=2, is_upgrade=True)
    templates = {}
    for docs in (before, after):
        for d in docs:
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
                templates.setdefault(d["metadata"]["name"], []).append(d["spec"]["template"])
    assert len(templates) == 3
    for name, (one, two) in templates.items():
        assert one == two, name
    # the code the chart runs as a client (helm test) still gets them
    (test_pod,) = by_kind(after, "Pod").values()
    test_env = env(test_pod["spec"]["containers"][0])
    assert test_env["DASK_EUGO__MIN_SPEEDUP"] == "3" and test_env["DASK_EUGO__LEARN"] == "true"


def test_network_policy_admits_only_the_release_and_named_clients_to_8786():
    docs = rendered("everything")
    policies = by_kind(docs, "NetworkPolicy")
    release = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}
    notebooks = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "notebooks"}}}
    ingress_nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    scheduler = policies["demo-eugo-dask-scheduler"]["spec"]
    assert scheduler["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    comm, dashboard = scheduler["ingress"]
    assert comm == {"from": [release, notebooks], "ports": [{"port": "tcp-comm", "protocol": "TCP"}]}
    assert dashboard == {"from": [release, ingress_nginx], "ports": [{"port": "http-dashboard", "protocol": "TCP"}]}
    workers = policies["demo-eugo-dask-workers"]["spec"]
    assert {"key": "app.kubernetes.io/component", "operator": "In",
            "values": ["cpu-worker", "gpu-worker"]} in workers["podSelector"]["matchExpressions"]
    assert workers["ingress"][0] == {"from": [release, notebooks]}
    # every pod of the release carries the label the policy admits
    for pod_name in pod_specs(docs):
        (d,) = [d for d in docs if d["metadata"]["name"] == pod_name and d["kind"] in ("Deployment", "Job", "Pod")]
        labels = d["metadata"]["labels"] if d["kind"] == "Pod" else d["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "demo"
    # by default: release only on 8786, dashboards open (Ingress controller, Prometheus)
    default = by_kind(rendered("default"), "NetworkPolicy")["demo-eugo-dask-scheduler"]["spec"]["ingress"]
    assert default == [{"from": [release], "ports": [{"port": "tcp-comm", "protocol": "TCP"}]},
                       {"ports": [{"port": "http-dashboard", "protocol": "TCP"}]}]
    assert not by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_external_traffic_policy_keeps_client_addresses_for_ip_block_peers():
    """A LoadBalancer with NetworkPolicy ipBlock peers sees node IPs unless the Service's
    externalTrafficPolicy is Local, which could not be set."""
    values = {"service": {"type": "LoadBalancer", "externalTrafficPolicy": "Local"},
              "networkPolicy": {"clients": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}}
    service = by_kind(render(values), "Service")["demo-eugo-dask-scheduler"]
    assert service["spec"]["externalTrafficPolicy"] == "Local"
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(service, version, strict=True)
    assert "externalTrafficPolicy" not in by_kind(rendered("default"), "Service")["demo-eugo-dask-scheduler"]["spec"]


def test_ingress_serves_the_dashboard_only():
    (ingress,) = by_kind(rendered("ingress"), "Ingress").values()
    backends = [p["backend"]["service"]["port"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]]
    assert backends == [{"name": "http-dashboard"}]


def test_everything_reaches_the_pods():
    docs = rendered("everything")
    pods = pod_specs(docs)
    scheduler = pods["demo-eugo-dask-scheduler"]
    (container,) = scheduler["containers"]
    assert container["image"] == "registry.example.com/eugo-dask:0.1.0"
    assert container["args"][-2:] == ["--idle-timeout", "2h"]
    assert json.loads(env(container)["DASK_EUGO__CLUSTER_PROFILE"]) == ["/etc/eugo-site/profile.yaml", "l4"]
    assert {"name": "site-profile", "mountPath": "/etc/eugo-site", "readOnly": True} in container["volumeMounts"]
    assert "livenessProbe" not in container  # null turns it off
    assert scheduler["serviceAccountName"] == "dask-scheduler" and scheduler["priorityClassName"] == "dask-high"
    service = by_kind(docs, "Service")["demo-eugo-dask-scheduler"]
    assert service["metadata"]["annotations"] == {"networking.gke.io/load-balancer-type": "Internal"}
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    cpu, gpu = pods["demo-eugo-dask-cpu-worker"], pods["demo-eugo-dask-gpu-worker"]
    for pod in (cpu, gpu):
        (c,) = pod["containers"]
        assert pod["serviceAccountName"] == "dask-worker"
        assert env(c)["AWS_REGION"] == "eu-west-1"
        assert [e["name"] for e in c["env"]].count("DASK_TEMPORARY_DIRECTORY") == 1
        assert env(c)["DASK_TEMPORARY_DIRECTORY"] == "/scratch"  # the group's env wins
        assert c["livenessProbe"]["timeoutSeconds"] == 30
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert cpu["containers"][0]["args"][-4:] == ["--lifetime", "8h", "--lifetime-stagger", "10m"]
    assert gpu["containers"][0]["image"] == "registry.example.com/eugo-dask:0.1.0-cuda"
    assert gpu["containers"][0]["imagePullPolicy"] == "Always"
    assert gpu["priorityClassName"] == "dask-gpu" and "priorityClassName" not in cpu
    deployments = by_kind(docs, "Deployment")
    assert deployments["demo-eugo-dask-cpu-worker"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 0}
    labels = deployments["demo-eugo-dask-gpu-worker"]["spec"]["template"]["metadata"]
    assert labels["labels"]["team"] == "analytics" and labels["annotations"] == {"example.com/team": "analytics"}
    job = calibration_job(docs)["spec"]["template"]["spec"]
    assert job["priorityClassName"] == "dask-low" and not by_kind(docs, "PriorityClass")
    assert job["containers"][0]["image"] == "registry.example.com/eugo-dask:0.1.0-cuda"
    assert set(by_kind(docs, "PodDisruptionBudget")) == {"demo-eugo-dask-cpu-worker", "demo-eugo-dask-gpu-worker"}


def test_tls_reaches_every_dask_process():
    docs = rendered("tls")
    pods = pod_specs(docs)
    for name in ("demo-eugo-dask-scheduler", "demo-eugo-dask-cpu-worker", "demo-eugo-dask-gpu-worker", "demo-eugo-dask-test"):
        (c,) = pods[name]["containers"]
        assert env(c)["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True", name
        assert env(c)["DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT"] == "/etc/dask/tls/tls.crt", name
        assert {"name": "dask-tls", "mountPath": "/etc/dask/tls", "readOnly": True} in c["volumeMounts"]
        assert {"name": "dask-tls", "secret": {"secretName": "dask-tls"}} in pods[name]["volumes"]
    assert args_after(pods["demo-eugo-dask-scheduler"]["containers"][0]["args"], "--protocol") == "tls"
    assert pods["demo-eugo-dask-gpu-worker"]["containers"][0]["args"][2] == "tls://demo-eugo-dask-scheduler:8786"
    notes = render_text(VALUE_SETS["tls"])["eugo-dask/templates/NOTES.txt"]
    assert "tls://demo-eugo-dask-scheduler:8786" in notes
    # the port-forward line printed tcp:// under TLS, which the scheduler refuses
    assert 'Client("tls://localhost:8786", security=Security(tls_ca_file=' in notes and "tcp://" not in notes
    assert 'Client("tcp://localhost:8786")' in render_text({})["eugo-dask/templates/NOTES.txt"]
    with pytest.raises(HelmRenderError, match=r"tls.secretName: tls.enabled needs a Secret with ca.crt, tls.crt and tls.key"):
        render({"tls": {"enabled": True}})


def test_cuda_worker_mode():
    pod = pod_specs(rendered("cuda-worker"))["demo-eugo-dask-gpu-worker"]
    args = pod["containers"][0]["args"]
    assert args[:3] == ["dask", "cuda", "worker"]
    assert args_after(args, "--rmm-pool-size") == "24GB"
    assert args_after(args, "--set-rmm-allocator-for-libs") == "cupy"  # CuPy uses the RMM pool
    assert args_after(args, "--device-memory-limit") == "0.8"
    assert args_after(args, "--memory-limit") == "auto"  # split among the 4 GPU processes
    assert args_after(args, "--resources") == "GPU=1"  # per GPU process
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert pod["containers"][0]["image"].endswith(":0.1.0-cuda")
    assert pod["runtimeClassName"] == "nvidia"


def _free_port_pair() -> int:
    """A port P with P + 1 free too."""
    import socket

    for _ in range(50):
        port = free_port()
        with contextlib.closing(socket.socket()) as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two free ports in a row")


async def _cuda_worker_dashboards(pod: str, dashboard_address: str, processes: int) -> dict[str, int]:
    """What dask cuda worker builds (dask_cuda/cuda_worker.py: one Nanny per GPU, each with the
    same dashboard_address and the name <name>-<n>), without GPUs: worker name -> its
    dashboard port, as the scheduler sees it, each answering /health there."""
    from distributed import Nanny, Scheduler

    async with Scheduler(dashboard_address=":0", host="127.0.0.1") as scheduler:
        nannies = [Nanny(scheduler.address, nthreads=1, name=f"{pod}-{n}", dashboard_address=dashboard_address,
                         host="127.0.0.1", memory_limit="1GiB") for n in range(processes)]
        import asyncio

        await asyncio.gather(*nannies)
        try:
            ports = {str(ws.name): ws.services["dashboard"] for ws in scheduler.workers.values()}
            for port in ports.values():
                health = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/health", timeout=10)
                assert health.read() == b"ok"
            return ports
        finally:
            await asyncio.gather(*(n.close() for n in nannies))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_gpu_process_of_a_cuda_worker_pod_serves_its_own_declared_port(monkeypatch):
    """dask cuda worker handed every GPU process the same --dashboard-address: one took 8788 and
    the others random ports, so the pod's probes and metrics reached one GPU's worker only. With
    the rendered nanny preload, GPU process n serves on 8788 + n, the port the pod declares."""
    import asyncio

    import dask
    import distributed  # noqa: F401  (its config defaults in place before dask.config.set)

    values = {"workerGroups": [{"name": "cpu"}, {"name": "gpu", "memoryLimit": "auto",
                                                  "gpu": {"type": "h200", "count": 2, "mode": "cuda-worker"}}]}
    (c,) = pod_specs(render(values))["demo-eugo-dask-gpu-worker"]["containers"]
    declared = {p["containerPort"]: p["name"] for p in c["ports"]}
    assert declared == {8788: "http-dashboard", 8789: "http-gpu-1"}
    base = _free_port_pair()
    monkeypatch.setenv("POD_NAME", "gpu-pod")
    # the rendered environment, as Dask reads it
    preload = dask.config.collect_env({k: v for k, v in env(c).items() if k.startswith("DASK_DISTRIBUTED__NANNY")})
    with dask.config.set({"distributed.nanny.preload": preload["distributed"]["nanny"]["preload"]}):
        ports = asyncio.run(_cuda_worker_dashboards("gpu-pod", f":{base}", 2))
    assert ports == {"gpu-pod-0": base, "gpu-pod-1": base + 1}
    # without it (as before): the second process is elsewhere (fresh ports: the first run's
    # worker processes may still hold theirs)
    base = _free_port_pair()
    with dask.config.set({"distributed.nanny.preload": []}):
        ports = asyncio.run(_cuda_worker_dashboards("gpu-pod", f":{base}", 2))
    assert base in ports.values() and base + 1 not in ports.values(), ports


def test_cuda_worker_groups_get_the_cuda_image_or_are_refused():
    """`dask cuda` is only in the eugo-dask-cuda image: with the default image a cuda-worker
    group crash-looped (No such command 'cuda')."""
    group = {"name": "gpu", "memoryLimit": "auto", "gpu": {"type": "h200", "count": 2, "mode": "cuda-worker"}}
    values = {"workerGroups": [{"name": "cpu"}, group]}
    pods = pod_specs(render(values))
    assert pods["demo-eugo-dask-gpu-worker"]["containers"][0]["image"] == "ghcr.io/eugo/eugo-dask:0.1.0-cuda"
    assert pods["demo-eugo-dask-cpu-worker"]["containers"][0]["image"] == "ghcr.io/eugo/eugo-dask:0.1.0"
    pods = pod_specs(render(values | {"image": {"repository": "registry.example.com/eugo-dask", "tag": "0.2.0"}}))
    assert pods["demo-eugo-dask-gpu-worker"]["containers"][0]["image"] == "registry.example.com/eugo-dask:0.2.0-cuda"
    own = {"workerGroups": [{"name": "cpu"}, group | {"image": {"repository": "registry.example.com/eugo-dask-cuda", "tag": "1"}}]}
    assert pod_specs(render(own))["demo-eugo-dask-gpu-worker"]["containers"][0]["image"] == "registry.example.com/eugo-dask-cuda:1"
    for wrong in ({"workerDefaults": {"image": {"tag": "0.2.0"}}}, {"workerGroups": [group | {"image": {"tag": "0.1.0"}}]}):
        with pytest.raises(HelmRenderError, match=r"workerGroups\[\d\] \(gpu\).image: gpu.mode cuda-worker runs `dask cuda "
                                                  r"worker`, which only the eugo-dask-cuda image has.*got ghcr.io/eugo/eugo-dask:0.[12].0\."):
            render(values | wrong)


def _bytes(quantity: str) -> float:
    from dask.utils import parse_bytes

    return parse_bytes(quantity.replace("i", "iB") if quantity[-1] == "i" else quantity)


@pytest.mark.parametrize("name", NAMES)
def test_workers_spill_below_their_scratch_limit_and_request_it(name):
    """Dask's spill was unlimited, /tmp an emptyDir with a sizeLimit, and no ephemeral-storage
    requested: past the limit the kubelet evicted the worker and its results were lost."""
    docs = rendered(name)
    for pod_name, pod in pod_specs(docs).items():
        (container,) = pod["containers"]
        (scratch,) = [v for v in pod["volumes"] if v["name"] == "scratch"]
        limit = scratch["emptyDir"]["sizeLimit"]
        assert container["resources"]["requests"]["ephemeral-storage"] == limit, pod_name
        if pod_name.endswith("-worker"):
            processes = gpus(pod) if container["args"][1] == "cuda" else 1
            max_spill = int(env(container)["DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL"])
            assert 0 < max_spill * processes < _bytes(limit), pod_name
    if name == "default":
        (gpu,) = pod_specs(docs)["demo-eugo-dask-gpu-worker"]["containers"]
        assert env(gpu)["DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL"] == str(16 * 2**30)
    if name == "cuda-worker":  # four GPU processes, each with its own spill
        (gpu,) = pod_specs(docs)["demo-eugo-dask-gpu-worker"]["containers"]
        assert env(gpu)["DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL"] == str(4 * 2**30)


def test_a_spill_cap_at_or_above_the_scratch_limit_is_refused():
    with pytest.raises(HelmRenderError, match=r"workerGroups\[0\] \(cpu\).maxSpill: 20Gi must be below scratchSizeLimit 20Gi"):
        render({"workerGroups": [{"name": "cpu", "maxSpill": "20Gi"}]})
    cpu = pod_specs(render({"workerGroups": [{"name": "cpu", "maxSpill": False}]}))["demo-eugo-dask-cpu-worker"]
    assert "DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL" not in env(cpu["containers"][0])


def test_gpu_resource_name_for_mig_and_time_slicing():
    """nvidia.com/gpu was hard-coded: where the device plugin offers MIG profiles or a renamed
    time-slicing resource, the pods stayed Pending."""
    values = {"workerGroups": [{"name": "cpu"}, {"name": "mig", "gpu": {"type": "h200", "resourceName": "nvidia.com/mig-1g.18gb"}}],
              "calibration": {"enabled": True}}
    docs = render(values)
    pods = pod_specs(docs)
    mig = pods["demo-eugo-dask-mig-worker"]
    assert gpus(mig, "nvidia.com/mig-1g.18gb") == 1 and gpus(mig) == 0
    assert gpus(calibration_job(docs)["spec"]["template"]["spec"], "nvidia.com/mig-1g.18gb") == 1
    assert "nvidia.com/gpu\"" not in json.dumps([p["containers"] for p in pods.values()])
    with pytest.raises(HelmValuesError, match=r"workerGroups/1/gpu/resourceName"):
        render({"workerGroups": [{"name": "cpu"}, {"name": "mig", "gpu": {"type": "h200", "resourceName": "a b"}}]})


def test_two_gpu_types_are_two_groups_priced_by_the_first():
    docs = rendered("two-gpu-types")
    pods = pod_specs(docs)
    assert {n: gpus(p) for n, p in pods.items() if "worker" in n} == {
        "demo-eugo-dask-cpu-worker": 0, "demo-eugo-dask-l4-worker": 1, "demo-eugo-dask-t4-worker": 1}
    assert args_after(pods["demo-eugo-dask-l4-worker"]["containers"][0]["args"], "--resources") == "GPU=2"
    assert pods["demo-eugo-dask-t4-worker"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
    assert env(pods["demo-eugo-dask-scheduler"]["containers"][0])["DASK_EUGO__CLUSTER_PROFILE"] == '["l4"]'
    test_env = env(pods["demo-eugo-dask-test"]["containers"][0])
    assert test_env["EUGO_TEST_WORKERS"] == "9" and test_env["EUGO_TEST_GPU"] == "true"


def test_without_gpu_groups_there_is_no_gpu_anywhere():
    docs = rendered("gpu-off")
    assert not any(gpus(p) for p in pod_specs(docs).values())
    assert "nvidia.com/gpu\"" not in json.dumps([d for d in docs if d["kind"] != "NetworkPolicy"])
    scheduler = pod_specs(docs)["demo-eugo-dask-scheduler"]["containers"][0]
    assert "DASK_EUGO__CLUSTER_PROFILE" not in env(scheduler)
    assert env(pod_specs(docs)["demo-eugo-dask-test"]["containers"][0])["EUGO_TEST_GPU"] == "false"


def test_one_flag_scales_one_group():
    """`--set workerReplicas.gpu=1`, as Helm's own --set parser reads it, scales the GPU group
    alone (`--set workerGroups[1].replicas=1` replaces the list: the schema refuses it)."""
    values = helm_python.parse_set_string("workerReplicas.gpu=1")
    assert values == {"workerReplicas": {"gpu": 1}}
    docs = render(values)
    deployments = by_kind(docs, "Deployment")
    assert deployments["demo-eugo-dask-gpu-worker"]["spec"]["replicas"] == 1
    assert deployments["demo-eugo-dask-cpu-worker"]["spec"]["replicas"] == 2
    (test_pod,) = by_kind(docs, "Pod").values()
    assert env(test_pod["spec"]["containers"][0])["EUGO_TEST_WORKERS"] == "3"
    notes = render_text(values)["eugo-dask/templates/NOTES.txt"]
    assert "gpu: 1 × 1 GPU" in notes and "--set workerReplicas.<group>=<fewer>" in notes
    with pytest.raises(HelmValuesError, match=r"workerGroups/0"):
        render(helm_python.parse_set_string("workerGroups[1].replicas=1"))
    with pytest.raises(HelmRenderError, match=r'workerReplicas.gpus: no worker group is named "gpus" \(groups: cpu, gpu\)'):
        render(helm_python.parse_set_string("workerReplicas.gpus=1"))


# --- GPU groups that follow the GPU work -------------------------------------------------------
def test_autoscaled_gpu_groups_scale_on_the_schedulers_gpu_backlog():
    docs = rendered("autoscaling")
    scaled = by_kind(docs, "ScaledObject")
    deployments = by_kind(docs, "Deployment")
    assert set(scaled) == {"demo-eugo-dask-gpu-worker", "demo-eugo-dask-l4-worker"}
    gpu = scaled["demo-eugo-dask-gpu-worker"]["spec"]
    assert gpu["scaleTargetRef"] == {"name": "demo-eugo-dask-gpu-worker"}
    assert (gpu["minReplicaCount"], gpu["maxReplicaCount"]) == (0, 8)
    (trigger,) = gpu["triggers"]
    assert trigger["type"] == "metrics-api"
    assert trigger["metadata"] == {"url": "http://demo-eugo-dask-scheduler.dask.svc:8787/metrics", "format": "prometheus",
                                   "valueLocation": "eugo_gpu_backlog", "targetValue": "16", "activationTargetValue": "0"}
    assert scaled["demo-eugo-dask-l4-worker"]["spec"]["triggers"][0]["metadata"]["targetValue"] == "32"
    # scale-down one pod a minute, each retiring its workers first
    assert gpu["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 60}]
    # KEDA owns their replicas: a rendered count would reset it at every upgrade
    assert "replicas" not in deployments["demo-eugo-dask-gpu-worker"]["spec"]
    assert "replicas" not in deployments["demo-eugo-dask-l4-worker"]["spec"]
    assert deployments["demo-eugo-dask-cpu-worker"]["spec"]["replicas"] == 2
    # a group may be at zero: the scheduler plans GPU work for workers yet to start
    scheduler = env(pod_specs(docs)["demo-eugo-dask-scheduler"]["containers"][0])
    assert scheduler["DASK_EUGO__GPU_WORKERS_ON_DEMAND"] == "True"
    assert "DASK_EUGO__GPU_WORKERS_ON_DEMAND" not in env(pod_specs(rendered("default"))["demo-eugo-dask-scheduler"]["containers"][0])
    one = {"workerGroups": [{"name": "cpu"}, {"name": "gpu", "gpu": {"type": "h200"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}]}
    assert "DASK_EUGO__GPU_WORKERS_ON_DEMAND" not in env(pod_specs(render(one))["demo-eugo-dask-scheduler"]["containers"][0])
    # the helm test counts the workers there are at least
    (test_pod,) = by_kind(docs, "Pod").values()
    assert env(test_pod["spec"]["containers"][0])["EUGO_TEST_WORKERS"] == "3"
    # with the dashboards narrowed, KEDA may still read the scheduler's /metrics
    policy = by_kind(docs, "NetworkPolicy")["demo-eugo-dask-scheduler"]["spec"]["ingress"][1]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in policy["from"]
    assert len(policy["from"]) == 3  # the release, monitoring, KEDA (once for two groups)
    notes = render_text(VALUE_SETS["autoscaling"])["eugo-dask/templates/NOTES.txt"]
    assert "gpu: 0-8 (KEDA, on eugo_gpu_backlog) × 1 GPU" in notes
    assert "Watch gpu, l4 scale:  kubectl get scaledobject,hpa -n dask -w" in notes


@pytest.mark.parametrize("values, error, match", [
    ({"workerGroups": [{"name": "cpu", "autoscaling": {"maxReplicas": 3}}]}, HelmRenderError,
     r"workerGroups\[0\] \(cpu\).autoscaling: only GPU groups scale, on the scheduler's GPU backlog"),
    ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}]},
     HelmRenderError, r"workerGroups\[0\] \(gpu\).autoscaling: minReplicas 3 is above maxReplicas 2"),
    ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200"}, "autoscaling": {"maxReplicas": 2}}], "workerReplicas": {"gpu": 1}},
     HelmRenderError, r"workerReplicas.gpu: the group autoscales"),
    ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200"}, "autoscaling": {"minReplicas": 0}}]},
     HelmValuesError, r"workerGroups/0/autoscaling.*maxReplicas"),
    ({"workerGroups": [{"name": "gpu", "gpu": {"type": "h200"}, "autoscaling": {"maxReplicas": 2, "max": 3}}]},
     HelmValuesError, r"workerGroups/0/autoscaling.*max"),
])
def test_autoscaling_values_that_cannot_work_are_refused(values, error, match):
    with pytest.raises(error, match=match):
        render(values)


@pytest.mark.parametrize("name", NAMES)
def test_every_worker_pod_retires_its_workers_before_it_goes(name):
    """A pod removed by a scale-down, a rollout or a drain lost its results: the preStop hook
    now retires its workers through the scheduler (results move), within a grace period that
    leaves it the time."""
    docs = rendered(name)
    scheduler = "tls" if VALUE_SETS[name].get("tls", {}).get("enabled") else "tcp"
    for pod_name, pod in pod_specs(docs).items():
        if not pod_name.endswith("-worker"):
            continue
        (container,) = pod["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:5] == ["python", "-m", "eugo_dask.k8s", "retire", f"{scheduler}://demo-eugo-dask-scheduler:8786"]
        timeout = int(args_after(command, "--timeout"))
        assert pod["terminationGracePeriodSeconds"] == timeout + 30, pod_name
        assert env(container)["POD_NAME"] is None  # (from the downward API: the hook's --name)
    if name == "autoscaling":
        assert pod_specs(docs)["demo-eugo-dask-gpu-worker"]["terminationGracePeriodSeconds"] == 630


# --- calibration ------------------------------------------------------------------------------
def test_calibration_job_measures_the_gpu_workers_machine():
    docs = rendered("calibration")
    job = calibration_job(docs)
    spec = job["spec"]
    assert spec["activeDeadlineSeconds"] > 0
    # no TTL: once it deleted the Job, every upgrade or sync re-created it
    assert "ttlSecondsAfterFinished" not in spec
    pod = spec["template"]["spec"]
    worker = pod_specs(docs)["demo-eugo-dask-gpu-worker"]
    (container,) = pod["containers"]
    assert container["args"][:5] == ["python", "-m", "eugo_dask.k8s", "calibrate", "demo-eugo-dask-eugo-profile"]
    assert args_after(container["args"], "--threads") == "4" == args_after(worker["containers"][0]["args"], "--nthreads")
    assert args_after(container["args"], "--gpu-preset") == "h100-sxm"
    assert args_after(container["args"], "--key") == "calibrated.yaml"
    assert args_after(container["args"], "--inputs") == "$(JOB_NAME)"
    assert container["env"][0] == {"name": "JOB_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['job-name']"}}}
    # the workers' requests (not BestEffort), one GPU, the workers' placement
    def without_scratch(resources):  # each pod requests its own /tmp emptyDir's size
        return resources | {"requests": {k: v for k, v in resources["requests"].items() if k != "ephemeral-storage"}}

    assert without_scratch(container["resources"]) == without_scratch(worker["containers"][0]["resources"])
    assert container["resources"]["requests"]["cpu"] == "4"
    assert pod["runtimeClassName"] == worker["runtimeClassName"] == "nvidia"
    assert pod["tolerations"] == worker["tolerations"]
    assert pod["automountServiceAccountToken"] is True
    # ordered behind the workers: a lower priority, never preempting; preemption is no failure
    (priority,) = by_kind(docs, "PriorityClass").values()
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    assert priority["value"] < 0 and priority["preemptionPolicy"] == "Never" and not priority["globalDefault"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in spec["podFailurePolicy"]["rules"]
    (role,) = by_kind(docs, "Role").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["demo-eugo-dask-eugo-profile"], "verbs": ["get", "patch"]}]
    scheduler = pod_specs(docs)["demo-eugo-dask-scheduler"]["containers"][0]
    assert json.loads(env(scheduler)["DASK_EUGO__CLUSTER_PROFILE"]) == ["/etc/eugo/calibrated.yaml", "h100-sxm"]


def test_an_upgrade_keeps_the_job_and_the_calibrated_profile():
    values = VALUE_SETS["calibration"]
    install = render(values, revision=1, is_install=True)
    job, configmap = calibration_job(install), by_kind(install, "ConfigMap")["demo-eugo-dask-eugo-profile"]
    assert "data" not in configmap  # the Job's key is never rendered, so never overwritten
    assert configmap["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert re.fullmatch(r"demo-eugo-dask-calibrate-[0-9a-f]{10}", job["metadata"]["name"])
    upgrade = render(values, revision=2, is_upgrade=True)
    assert calibration_job(upgrade) == job
    assert by_kind(upgrade, "ConfigMap")["demo-eugo-dask-eugo-profile"] == configmap
    # values the measurement does not depend on: same Job
    unrelated = values | {"eugo": {"minSpeedup": 3.0}, "tests": {"enabled": False}}
    unrelated["workerGroups"] = [{"name": "cpu", "replicas": 8}, values["workerGroups"][1] | {"replicas": 5}]
    assert calibration_job(render(unrelated, revision=3, is_upgrade=True))["metadata"]["name"] == job["metadata"]["name"]
    # what it measures changes: a new Job (a Job's pod template cannot be changed in place)
    for change in ({"image": {"tag": "0.2.0"}}, {"nthreads": 8}, {"nodeSelector": {"pool": "l4"}},
                   {"resources": {"requests": {"cpu": "8", "memory": "16Gi"}}}):
        changed = values | {"workerGroups": [values["workerGroups"][0], values["workerGroups"][1] | change]}
        assert calibration_job(render(changed, revision=3, is_upgrade=True))["metadata"]["name"] != job["metadata"]["name"], change


def test_calibrating_a_cuda_worker_group_requests_one_gpus_share():
    """The Job measures one GPU (one process of nthreads threads): with a cuda-worker group it
    requested the whole 4-GPU pod's CPU and memory, a node's worth for one GPU."""
    values = VALUE_SETS["cuda-worker"] | {"calibration": {"enabled": True}}
    docs = render(values)
    (container,) = calibration_job(docs)["spec"]["template"]["spec"]["containers"]
    (worker,) = pod_specs(docs)["demo-eugo-dask-gpu-worker"]["containers"]
    assert worker["resources"]["requests"]["cpu"] == "16" and worker["resources"]["limits"]["memory"] == "64Gi"
    resources = container["resources"]
    assert resources["requests"]["cpu"] == "4000m"
    assert int(resources["requests"]["memory"]) == int(resources["limits"]["memory"]) == 16 * 2**30
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["ephemeral-storage"] == "2Gi"  # the Job's own scratch
    odd = values | {"workerGroups": [values["workerGroups"][0], values["workerGroups"][1] | {
        "resources": {"requests": {"cpu": "1500m", "memory": "10G"}}, "gpu": values["workerGroups"][1]["gpu"] | {"count": 3}}]}
    (container,) = calibration_job(render(odd))["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "500m"
    assert container["resources"]["requests"]["memory"] == str(10**10 // 3)


PROFILE_MOUNT = {"name": "profile", "mountPath": "/etc/eugo", "readOnly": True}
#: optional: a worker pod starts whether or not the ConfigMap exists yet
PROFILE_VOLUME = {"name": "profile", "configMap": {"name": "demo-eugo-dask-eugo-profile", "optional": True}}


def _profile_reading(pod: dict) -> tuple[str | None, bool, bool]:
    """A pod's eugo.cluster-profile, whether it mounts the profile ConfigMap at /etc/eugo and
    whether it has that ConfigMap as a volume (optional)."""
    (c,) = pod["containers"]
    return (env(c).get("DASK_EUGO__CLUSTER_PROFILE"), PROFILE_MOUNT in c["volumeMounts"],
            PROFILE_VOLUME in pod["volumes"])


@pytest.mark.parametrize("name, values", [
    ("calibration", VALUE_SETS["calibration"]),
    ("cuda-worker", VALUE_SETS["cuda-worker"] | {"calibration": {"enabled": True}}),
])
def test_the_calibrated_gpu_group_copies_by_the_calibrated_profile(name, values):
    """The calibration Job measures the first GPU group's machine and the scheduler prices
    copies by its per-size rates: that group's workers (dask worker or dask cuda worker) mount
    the profile ConfigMap read-only and read the scheduler's eugo.cluster-profile, the calibrated
    path first (they mounted nothing and copied by the built-in rules). CPU workers get neither;
    the Job measures as before (the same pod, so the same name)."""
    docs = render(values)
    pods = pod_specs(docs)
    scheduler = env(pods["demo-eugo-dask-scheduler"]["containers"][0])["DASK_EUGO__CLUSTER_PROFILE"]
    assert json.loads(scheduler)[0] == "/etc/eugo/calibrated.yaml"
    gpu = pods["demo-eugo-dask-gpu-worker"]
    assert _profile_reading(gpu) == (scheduler, True, True)
    assert [v for v in gpu["volumes"] if v["name"] == "profile"] == [PROFILE_VOLUME]
    assert _profile_reading(pods["demo-eugo-dask-cpu-worker"]) == (None, False, False)
    job = calibration_job(docs)["spec"]["template"]["spec"]
    assert _profile_reading(job) == (None, False, False)
    notes = render_text(values)["eugo-dask/templates/NOTES.txt"]
    assert 'The "gpu" workers copy by the calibrated profile\'s per-size copy paths once it is stored.' in notes
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRDS:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_only_the_calibrated_group_copies_by_the_calibration():
    """One Job calibrates the first GPU group: the L4 workers copy by it, the T4 workers (another
    machine) keep the runtime's built-in rules."""
    values = VALUE_SETS["two-gpu-types"] | {"calibration": {"enabled": True}}
    pods = pod_specs(render(values))
    assert _profile_reading(pods["demo-eugo-dask-l4-worker"]) == ('["/etc/eugo/calibrated.yaml","l4"]', True, True)
    assert _profile_reading(pods["demo-eugo-dask-t4-worker"]) == (None, False, False)
    assert _profile_reading(pods["demo-eugo-dask-cpu-worker"]) == (None, False, False)


def test_gpu_workers_read_a_profile_only_where_it_is_more_than_their_preset():
    """Without calibration or an eugo.profile the scheduler plans with the group's preset, which
    has no per-size copies: the workers' pod templates stay as they were. An eugo.profile of
    one's own reaches the first GPU group as the scheduler has it (a path counts where that group
    mounts it too); a group's own env entry replaces the chart's."""
    for name in ("default", "two-gpu-types", "autoscaling", "tls"):
        for pod_name, pod in pod_specs(rendered(name)).items():
            if pod_name.endswith("-worker"):
                assert _profile_reading(pod) == (None, False, False), (name, pod_name)
    pods = pod_specs(rendered("everything"))  # eugo.profile: /etc/eugo-site/profile.yaml
    assert _profile_reading(pods["demo-eugo-dask-gpu-worker"]) == ('["/etc/eugo-site/profile.yaml","l4"]', False, False)
    assert _profile_reading(pods["demo-eugo-dask-cpu-worker"]) == (None, False, False)
    values = VALUE_SETS["calibration"]
    own = {"name": "DASK_EUGO__CLUSTER_PROFILE", "value": "/etc/site/gpu.yaml"}
    values = values | {"workerGroups": [values["workerGroups"][0], values["workerGroups"][1] | {"env": [own]}]}
    (c,) = pod_specs(render(values))["demo-eugo-dask-gpu-worker"]["containers"]
    assert [e for e in c["env"] if e["name"] == own["name"]] == [own]


def test_calibration_ttl_only_when_asked_for():
    values = VALUE_SETS["calibration"]
    assert "ttlSecondsAfterFinished" not in calibration_job(render(values))["spec"]
    ttl = calibration_job(render(values | {"calibration": values["calibration"] | {"ttlSecondsAfterFinished": 0}}))
    assert ttl["spec"]["ttlSecondsAfterFinished"] == 0


def _fake_service_account(root: Path, ca_file: str) -> Path:
    account = root / "serviceaccount"
    account.mkdir(parents=True)
    (account / "token").write_text("job-token")
    (account / "namespace").write_text("dask")
    shutil.copy(ca_file, account / "ca.crt")
    return account


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("openssl"),
                    reason="needs root and unshare(1) to mount a service account, openssl for the API's certificate")
@pytest.mark.timeout(120)
def test_rendered_calibration_job_runs_against_an_ipv6_api_server(tmp_path):
    """The Job's container as rendered, with the pod's service account mounted where Kubernetes
    mounts it, against an HTTPS API server on [::1]: measures once, then finds its profile."""
    docs = rendered("calibration")
    job = calibration_job(docs)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    job_name = job["metadata"]["name"]
    with FakeApiServer(host="::1", tls_dir=tmp_path / "tls") as api:
        api.configmaps["demo-eugo-dask-eugo-profile"] = {}
        account = _fake_service_account(tmp_path, api.ca_file)
        variables = {"JOB_NAME": job_name, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                     "DASK_TEMPORARY_DIRECTORY": str(tmp_path / "dask")}
        assert set(env(container)) == set(variables)
        args = [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], a) for a in container["args"]]
        assert args[0] == "python"
        local_env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")} | variables | {
            "KUBERNETES_SERVICE_HOST": "::1", "KUBERNETES_SERVICE_PORT": str(api.port),
            "PYTHONPATH": str(CHART.parents[1])}
        script = ('mount -t tmpfs tmpfs /run && mkdir -p /run/secrets/kubernetes.io '
                  '&& cp -r "$1" /run/secrets/kubernetes.io/serviceaccount && shift && exec "$@"')
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "_",
                   str(account), sys.executable, *args[1:]]
        first = subprocess.run(command, env=local_env, capture_output=True, text=True, timeout=90)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "stored profile" in first.stdout
        stored = api.configmaps["demo-eugo-dask-eugo-profile"]
        assert stored["calibrated.inputs"] == job_name
        profile = yaml.safe_load(stored["calibrated.yaml"])
        assert profile["cpu"]["threads"] == 4 and profile["name"] == "h100-sxm-calibrated-cpu"
        assert {r["auth"] for r in api.requests} == {"Bearer job-token"}
        # recreated after its TTL, or a reinstall: nothing to measure
        second = subprocess.run(command, env=local_env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0 and "nothing to do" in second.stdout, second.stdout + second.stderr
        assert [r["method"] for r in api.requests] == ["GET", "PATCH", "GET"]


# --- the rendered commands as local processes -------------------------------------------------
def _local(args: list[str], env_list: list[dict], rewrites: dict[str, str], pod_name: str,
           scratch: Path) -> tuple[list[str], dict[str, str]]:
    """A container's args and environment for a local process: addresses, ports and paths
    rewritten, $(VAR) expanded, the dask CLI of this environment."""
    variables = {e["name"]: e.get("value", pod_name) for e in env_list}
    for name, value in variables.items():
        value = str(scratch) + value[4:] if value.startswith("/tmp") else value
        for old, new in rewrites.items():
            value = value.replace(old, new)
        variables[name] = value
    out = []
    for arg in args:
        for old, new in rewrites.items():
            arg = arg.replace(old, new)
        out.append(re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], arg))
    assert out[0] == "dask"
    out[0] = DASK_CLI
    local_env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    local_env["PYTHONPATH"] = str(CHART.parents[1])
    return out, local_env | variables


def _plan_profiles(address: str) -> list[str]:
    from distributed import Client

    with Client(address, timeout=30) as client:
        return [p["profile"] for p in client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary()["plans"])]


@contextlib.contextmanager
def launched(values: dict, tmp_path: Path, rewrites: dict[str, str]) -> Iterator[tuple[str, Callable]]:
    """The rendered scheduler, GPU-worker and CPU-worker containers as local processes; yields
    the scheduler's address and a function that runs the helm test pod's script (with extra
    environment) and returns its output."""
    docs = render(values)
    port, dash = free_port(), free_port()
    scheme = "tls" if values.get("tls", {}).get("enabled") else "tcp"
    address = f"{scheme}://127.0.0.1:{port}"
    rewrites = {f"{scheme}://demo-eugo-dask-scheduler:8786": address, ":8787": f":{dash}", ":8788": ":0"} | rewrites
    pods = pod_specs(docs)
    procs, logs = [], []
    try:
        for deployment, name in (("demo-eugo-dask-scheduler", "scheduler"),
                                 ("demo-eugo-dask-gpu-worker", "gpu-worker-0"),
                                 ("demo-eugo-dask-cpu-worker", "cpu-worker-0")):
            (c,) = pods[deployment]["containers"]
            args, local_env = _local(c["args"], c["env"], rewrites, name, tmp_path)
            if name == "scheduler":
                args[args.index("--port") + 1] = str(port)
            log = open(tmp_path / f"{name}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(args, env=local_env, stdout=log, stderr=subprocess.STDOUT))
            if name == "scheduler":
                time.sleep(2)
        (c,) = pods["demo-eugo-dask-test"]["containers"]
        _, test_env = _local(["dask"], c["env"], rewrites, "test", tmp_path)

        def helm_test(**extra_env: str) -> str:
            result = subprocess.run([sys.executable, str(CHART / "files" / "helm-test.py")],
                                    env=test_env | {"DASK_SCHEDULER_ADDRESS": address} | extra_env,
                                    capture_output=True, text=True, timeout=180)
            logs_text = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
            assert result.returncode == 0, result.stdout + result.stderr + logs_text
            assert "connected to" in result.stdout and result.stdout.strip().endswith("ok")
            on_gpu = int(re.search(r"eugo: (\d+) tasks ran on a GPU, as the workers report", result.stdout).group(1))
            assert on_gpu > 0
            return result.stdout

        yield address, helm_test
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


LOCAL = {"eugo": {"device": "emulated"},
         "workerGroups": [{"name": "cpu", "memoryLimit": "2GiB"},
                          {"name": "gpu", "memoryLimit": "2GiB", "gpu": {"type": "t4"}}]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rendered_commands_run_as_local_processes(tmp_path):
    profile_dir = tmp_path / "etc-eugo"
    profile_dir.mkdir()
    values = LOCAL | {"calibration": {"enabled": True}}
    with launched(values, tmp_path, {"/etc/eugo": str(profile_dir)}) as (address, helm_test):
        # nothing calibrated yet: the test client's auto is planned with the GPU group's preset
        assert "planned with profile t4" in helm_test(EUGO_TEST_PROFILE="t4")
        # the Job stores its profile (here: as the kubelet projects the ConfigMap's new key)
        (profile_dir / "calibrated.yaml").write_text("name: calibrated-here\nbase: t4\n")
        helm_test(EUGO_TEST_PROFILE="calibrated-here")
        assert _plan_profiles(address)[-2:] == ["t4", "calibrated-here"]
        # the scheduler loaded the plugin and the GPU group's worker ran the device work
        from distributed import Client

        import eugo_dask

        with Client(address, timeout=30) as client:
            stats = client.run(eugo_dask.device_stats)
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            by_name = {names[a]: s for a, s in stats.items()}
        assert by_name["gpu-worker-0"]["tasks"] > 0 and by_name["cpu-worker-0"]["tasks"] == 0


#: A worker preload: the worker's CuPy is the stand-in (tests/fake_cupy.py), one device.
STAND_IN_CUPY = str(Path(__file__).with_name("stand_in_cupy.py"))
MiB = 1 << 20
#: What a calibration of this machine found: from 16 MiB page-locked in place to the device and
#: straight into pinned blocks back (the built-in rules stage both ways below 64 MiB).
CALIBRATED = {"name": "calibrated-here", "base": "t4", "link": {"copies_by_size": {
    "h2d": [{"bytes": 2 * MiB, "bytes_per_s": 9e9, "path": "staged", "threads": 2},
            {"bytes": 16 * MiB, "bytes_per_s": 2.4e10, "path": "registered"}],
    "d2h": [{"bytes": 2 * MiB, "bytes_per_s": 8e9, "path": "staged", "threads": 2},
            {"bytes": 16 * MiB, "bytes_per_s": 2.5e10, "path": "pinned"}]}}}


def _copy_round_trip(nbytes: int) -> tuple[bool, str, str]:
    """A chunk to the device and back through the runtime's transfer tasks, on a GPU worker:
    whether it came back equal, and the path each copy took (as device_stats counts them)."""
    import numpy as np

    import eugo_dask
    from eugo_dask.runtime import to_device, to_host

    eugo_dask.reset_device_stats()
    host = np.arange(nbytes // 8, dtype=np.float64)
    on_device = to_device(host, "cupy")
    assert type(on_device).__module__ == "tests.fake_cupy", type(on_device)  # it went to the device
    back = to_host(on_device, "cupy")
    stats = eugo_dask.device_stats()
    return (bool(np.array_equal(back, host)),
            "registered" if stats["h2d_registered"] else "staged" if stats["h2d_staged"] else "direct",
            "pinned" if stats["d2h_pinned"] else "staged" if stats["d2h_staged"] else "direct")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rendered_gpu_worker_copies_by_the_calibrated_profile_once_it_is_stored(tmp_path):
    """The rendered GPU worker, a real `dask worker` with the chart's environment and its CuPy
    the stand-in: before the calibration Job stored its profile (nothing at the mounted path) it
    copies by the built-in rules and warns of nothing; once the profile appears there (as the
    kubelet projects the ConfigMap's new key) it takes the path calibration measured best at
    each size. (It copied by the built-in rules whatever the Job stored.)"""
    from distributed import Client

    from eugo_dask.profile import profile_dict

    profile_dir = tmp_path / "etc-eugo"
    profile_dir.mkdir()
    values = {"calibration": {"enabled": True},
              "workerGroups": [{"name": "cpu", "memoryLimit": "2GiB"},
                               {"name": "gpu", "memoryLimit": "2GiB", "extraArgs": ["--preload", STAND_IN_CUPY],
                                "gpu": {"type": "t4"}}]}
    with launched(values, tmp_path, {"/etc/eugo": str(profile_dir)}) as (address, _), \
            Client(address, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)

        def copies(nbytes: int) -> tuple[bool, str, str]:
            return client.submit(_copy_round_trip, nbytes, workers=["gpu-worker-0"], pure=False).result(timeout=60)

        assert copies(32 * MiB) == (True, "staged", "staged")  # the built-in rules
        (profile_dir / "calibrated.yaml").write_text(yaml.safe_dump(profile_dict(CALIBRATED)))
        assert copies(32 * MiB) == (True, "registered", "pinned")
        assert copies(2 * MiB) == (True, "staged", "staged")  # per size: the 2 MiB point stages
        log = (tmp_path / "gpu-worker-0.log").read_text()  # (before the processes stop)
    assert "cannot be read" not in log and "Traceback" not in log and "ERROR" not in log, log


def _random(n: int):
    import numpy as np

    return np.random.default_rng().random(n)  # computed again, other numbers


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rendered_pre_stop_hook_retires_the_pod_before_it_goes(tmp_path):
    """The scale-down path: the GPU worker pod's rendered preStop command, run against the
    rendered scheduler, moves the pod's results to the CPU worker before its worker closes."""
    import numpy as np
    from distributed import Client, wait

    values = LOCAL | {"workerGroups": [LOCAL["workerGroups"][0], LOCAL["workerGroups"][1] | {
        "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}]}
    with launched(values, tmp_path, {}) as (address, helm_test):
        (c,) = pod_specs(render(values))["demo-eugo-dask-gpu-worker"]["containers"]
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            held = client.submit(_random, 10_000, workers=["gpu-worker-0"], pure=False)
            wait(held, timeout=30)
            before = held.result(timeout=30)
            assert list(client.who_has([held]).values()) == [(next(
                a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "gpu-worker-0"),)]
            local_env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
            local_env |= {"PYTHONPATH": str(CHART.parents[1]), "POD_NAME": "gpu-worker-0"}
            hook = [sys.executable if a == "python" else a.replace("tcp://demo-eugo-dask-scheduler:8786", address)
                    for a in command]
            result = subprocess.run(hook, env=local_env, capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "retired gpu-worker-0" in result.stdout
            assert {w["name"] for w in client.scheduler_info()["workers"].values()} == {"cpu-worker-0"}
            assert np.array_equal(held.result(timeout=30), before)  # moved, not computed again


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl to make a certificate")
def test_rendered_commands_with_tls_admit_only_certificate_holders(tmp_path):
    certs = tmp_path / "tls"
    shutil.copy(make_certificate(certs, "127.0.0.1"), certs / "ca.crt")
    with launched(LOCAL | VALUE_SETS["tls"], tmp_path, {"/etc/dask/tls": str(certs)}) as (address, helm_test):
        assert address.startswith("tls://")
        helm_test()
        # a client that trusts the CA but whose own certificate it did not sign is turned away
        other = tmp_path / "other"
        make_certificate(other, "127.0.0.1")
        plain = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        code = ("from distributed import Client, Security\n"
                f"Client({address!r}, timeout=5, security=Security(tls_ca_file={str(certs / 'ca.crt')!r}, "
                f"tls_client_cert={str(other / 'tls.crt')!r}, tls_client_key={str(other / 'tls.key')!r}))")
        result = subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and re.search(r"SSL\w*Error", result.stderr), result.stderr
        deadline = time.monotonic() + 10  # the scheduler logs the refusal as it closes the connection
        while "TLS handshake failed" not in (tmp_path / "scheduler.log").read_text():
            assert time.monotonic() < deadline, "the scheduler did not refuse the handshake"
            time.sleep(0.1)


KEEP_CACHE_AND_HISTORY = """
from eugo_dask import history, measure
measure.measure_local_cpu = lambda: {"measured": True}  # (the cache's life, not the measuring)
measure.cached_local_cpu()
learned = history.RuntimeHistory(history.default_history_path(), min_samples=1)
for _ in range(3):
    learned.record("matmul", "gpu", 2**23, 0.01)
learned.save()
print(len(history.RuntimeHistory(history.default_history_path(), min_samples=1)))
"""


def test_pods_keep_their_cache_and_history_in_the_scratch_volume(tmp_path):
    """Every pod's XDG_CACHE_HOME lies in its /tmp emptyDir, which the kubelet makes 0777
    (setgid under the chart's fsGroup) without the sticky bit: eugo keeps its CPU cache and
    learned durations there all the same, in a directory of its own made 0700. (Before, eugo
    refused the place for the directory above it: no pod kept either.)"""
    for pod_name, pod in pod_specs(render(LOCAL)).items():
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert env["XDG_CACHE_HOME"].startswith("/tmp/"), pod_name
        assert {"mountPath": "/tmp", "name": "scratch"} in container["volumeMounts"]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(0o2777)  # the emptyDir as the kubelet leaves it
    local_env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "XDG_"))}
    local_env |= {"PYTHONPATH": str(CHART.parents[1]),
                  "XDG_CACHE_HOME": str(scratch) + env["XDG_CACHE_HOME"][len("/tmp"):]}
    result = subprocess.run([sys.executable, "-c", KEEP_CACHE_AND_HISTORY], env=local_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "not using" not in result.stderr, result.stderr
    assert int(result.stdout) > 0  # the durations learned, read back from disk
    kept = sorted(p.name.split("-")[0] for p in (scratch / "cache" / "eugo-dask").iterdir())
    assert kept == ["cpu", "history"], kept
