"""Keep a calibrated profile in a Kubernetes ConfigMap (the Helm chart's calibration Job), and
retire a worker pod's Dask workers before the pod goes (its preStop hook).

    python -m eugo_dask.k8s calibrate CONFIGMAP [--key calibrated.yaml] [--inputs ID]
                                      [--quick] [--gpu-preset NAME] [--threads N]
    python -m eugo_dask.k8s store PROFILE.yaml CONFIGMAP [--key calibrated.yaml]
    python -m eugo_dask.k8s retire SCHEDULER [--name POD] [--timeout SECONDS]

``retire`` asks the scheduler to retire the workers named ``POD`` (default: ``$POD_NAME``) or
``POD-<n>`` (``dask cuda worker`` names its GPU processes so): their results move to the other
workers and they close, so a pod removed by a scale-down, a rollout or a drain loses none. TLS
comes from Dask's config, as for the worker itself.

``calibrate`` measures this machine (``eugo_dask.calibrate``) and stores the profile under
``--key``, with ``--inputs`` (the chart passes its Job's name, a checksum of the Job's pod) under
``<key stem>.inputs``; when the ConfigMap already holds a profile for the same inputs it measures
nothing. ``store`` writes a profile file measured elsewhere. The chart never renders these keys,
so neither ``helm upgrade`` nor a GitOps sync overwrites them.

Uses the pod's service-account token and the in-cluster API address, with the standard library
only (no Kubernetes client in the image). What to measure and where is the chart's business.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KEY = "calibrated.yaml"


class ApiError(RuntimeError):
    """The API server refused a request; the message carries its own explanation."""

    def __init__(self, method: str, url: str, status: int, message: str):
        super().__init__(f"{method} {url}: HTTP {status}: {message}")
        self.status = status


def api_server_url(host: str, port: str | int = 443) -> str:
    """The API server's URL from ``KUBERNETES_SERVICE_HOST``/``_PORT`` (IPv6 hosts bracketed)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"https://{host}:{port}"


def inputs_key(key: str) -> str:
    """The ConfigMap key that records what the profile under ``key`` was measured for."""
    return f"{Path(key).stem}.inputs"


@dataclass(frozen=True)
class ConfigMapClient:
    """GET and merge-PATCH one ConfigMap."""

    configmap: str
    namespace: str
    api_url: str
    token: str
    ca_file: str | None = None

    @classmethod
    def in_cluster(cls, configmap: str, namespace: str | None = None, *,
                   api_url: str | None = None, token: str | None = None,
                   ca_file: str | None = None) -> ConfigMapClient:
        """From the pod's service account and environment; keyword arguments override them."""
        if namespace is None:
            namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        if api_url is None:
            api_url = api_server_url(os.environ["KUBERNETES_SERVICE_HOST"],
                                     os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
        if token is None:
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
        if ca_file is None and api_url.startswith("https"):
            ca_file = str(SERVICE_ACCOUNT / "ca.crt")
        return cls(configmap, namespace, api_url, token, ca_file)

    @property
    def url(self) -> str:
        return f"{self.api_url}/api/v1/namespaces/{self.namespace}/configmaps/{self.configmap}"

    def _request(self, method: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(self.url, data=data, method=method, headers=headers)
        context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                text = response.read().decode() or "{}"
                return response.status, json.loads(text)
        except urllib.error.HTTPError as e:
            raise ApiError(method, self.url, e.code, _status_message(e)) from None

    def data(self) -> dict[str, str]:
        """The ConfigMap's ``data``."""
        return self._request("GET")[1].get("data") or {}

    def patch_data(self, data: dict[str, str]) -> int:
        """Merge ``data`` into the ConfigMap's; returns the HTTP status."""
        return self._request("PATCH", {"data": data})[0]


def _status_message(error: urllib.error.HTTPError) -> str:
    """The API server's ``Status.message`` (or its raw reply) for a failed request."""
    text = error.read().decode(errors="replace").strip()
    try:
        return json.loads(text)["message"]
    except (ValueError, KeyError, TypeError):
        return text or str(error.reason)


def store_profile(profile_path: str | os.PathLike, configmap: str, namespace: str | None = None, *,
                  key: str = DEFAULT_KEY, inputs: str | None = None, **client: Any) -> int:
    """Write the profile file under ``key`` of ``configmap`` (and ``inputs`` under
    :func:`inputs_key`); returns the HTTP status. ``client``: :meth:`ConfigMapClient.in_cluster`
    overrides (``api_url``, ``token``, ``ca_file``)."""
    data = {key: Path(profile_path).read_text()}
    if inputs is not None:
        data[inputs_key(key)] = inputs
    return ConfigMapClient.in_cluster(configmap, namespace, **client).patch_data(data)


def calibrate_into(configmap: str, namespace: str | None = None, *, key: str = DEFAULT_KEY,
                   inputs: str | None = None, quick: bool = False, gpu_preset: str = "h200",
                   threads: int | None = None, **client: Any) -> str:
    """Measure this machine and store the profile, unless ``configmap`` already holds one
    measured for ``inputs``. Returns what happened, for the log."""
    import yaml

    from eugo_dask.calibrate import calibrate

    api = ConfigMapClient.in_cluster(configmap, namespace, **client)
    stored = api.data()
    if inputs is not None and key in stored and stored.get(inputs_key(key)) == inputs:
        return f"ConfigMap {configmap} already holds {key} measured for {inputs}: nothing to do"
    profile = calibrate(quick=quick, gpu_preset=gpu_preset, threads=threads,
                        progress=lambda message: print(f"  {message}", file=sys.stderr))
    data = {key: yaml.safe_dump(profile, sort_keys=False)}
    if inputs is not None:
        data[inputs_key(key)] = inputs
    status = api.patch_data(data)
    return f"stored profile {profile['name']!r} as {key} in ConfigMap {configmap} (HTTP {status})"


def _pod_workers(workers: dict[str, Any], pod: str) -> list[str]:
    """The names of the scheduler's ``workers`` (its identity's) that run in pod ``pod``: named
    ``pod``, or ``pod-<n>`` as ``dask cuda worker`` names one process per GPU."""
    names = sorted(str(w.get("name")) for w in workers.values())
    return [n for n in names if n == pod or (n.startswith(f"{pod}-") and n[len(pod) + 1:].isdigit())]


async def _retire(scheduler: str, pod: str) -> tuple[list[str], list[str]]:
    """(the pod's workers, those the scheduler retired)."""
    from distributed.core import rpc
    from distributed.security import Security

    connection_args = Security().get_connection_args("client")
    async with rpc(scheduler, connection_args=connection_args) as remote:
        names = _pod_workers((await remote.identity())["workers"], pod)
        if not names:
            return [], []
        # (their nannies close with them: the container exits once its results have moved)
        retired = await remote.retire_workers(names=names, close_workers=True, remove=True,
                                              stimulus_id=f"eugo-k8s-retire-{pod}")
    return names, sorted(str(info.get("name")) for info in retired.values())


def retire_pod(scheduler: str, pod: str, *, timeout: float = 300) -> tuple[bool, str]:
    """Retire the Dask workers of pod ``pod`` through ``scheduler``, waiting at most ``timeout``
    seconds. Returns whether none is left holding results the others lack, and what happened,
    for the log."""
    import asyncio

    names, retired = asyncio.run(asyncio.wait_for(_retire(scheduler, pod), timeout))
    if not names:
        return True, f"no worker of pod {pod} is known to {scheduler}: nothing to retire"
    kept = [n for n in names if n not in retired]
    if kept:
        # the scheduler keeps a worker whose only copies of results no other worker can take
        return False, (f"{scheduler} could not retire {', '.join(kept)}: no other worker could "
                       f"take results only they hold (those are lost with the pod)"
                       + (f"; retired {', '.join(retired)}" if retired else ""))
    return True, f"retired {', '.join(names)} through {scheduler}: their results moved to other workers"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eugo_dask.k8s", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("calibrate", help="measure this machine and store the profile")
    store = commands.add_parser("store", help="store a profile file")
    retire = commands.add_parser("retire", help="retire this pod's Dask workers (preStop)")
    retire.add_argument("scheduler", help="the scheduler's address (tcp:// or tls://)")
    retire.add_argument("--name", default=os.environ.get("POD_NAME"),
                        help="the pod's name (default: $POD_NAME)")
    retire.add_argument("--timeout", type=float, default=300.0, help="seconds to wait at most")
    store.add_argument("profile", type=Path)
    for sub in (run, store):
        sub.add_argument("configmap")
        sub.add_argument("--namespace", default=None, help="default: the pod's own")
        sub.add_argument("--key", default=DEFAULT_KEY, help="the ConfigMap key for the profile")
        sub.add_argument("--inputs", default=None, help="what the profile is measured for")
    run.add_argument("--quick", action="store_true")
    run.add_argument("--gpu-preset", default="h200")
    run.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "retire":
        return _retire_command(parser, args)
    try:
        if args.command == "store":
            status = store_profile(args.profile, args.configmap, args.namespace, key=args.key,
                                   inputs=args.inputs)
            print(f"stored {args.profile} as {args.key} in ConfigMap {args.configmap} (HTTP {status})")
        else:
            print(calibrate_into(args.configmap, args.namespace, key=args.key, inputs=args.inputs,
                                 quick=args.quick, gpu_preset=args.gpu_preset, threads=args.threads))
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _retire_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``retire``: 0 once the pod's workers are retired (or none is known), 1 where the scheduler
    could not be reached, did not finish in time, or could not move results only they hold (the
    pod goes anyway: Kubernetes sends SIGTERM after the hook; the message is in its events)."""
    if not args.name:
        parser.error("retire: give --name or set POD_NAME")
    try:
        done, message = retire_pod(args.scheduler, args.name, timeout=args.timeout)
    except (OSError, TimeoutError) as e:
        print(f"error: retiring the workers of pod {args.name} through {args.scheduler}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(message if done else f"error: {message}", file=sys.stdout if done else sys.stderr)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
