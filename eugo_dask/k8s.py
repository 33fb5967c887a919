"""Store a calibrated profile in a Kubernetes ConfigMap (the Helm chart's calibration Job).

    python -m eugo_dask.k8s PROFILE.yaml CONFIGMAP [NAMESPACE]

Uses the pod's service-account token and the in-cluster API address, with the standard library
only (no Kubernetes client in the image): one merge-patch of ``data["profile.yaml"]``.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request
from pathlib import Path

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def store_profile(profile_path: str | os.PathLike, configmap: str, namespace: str | None = None, *,
                  api_url: str | None = None, token: str | None = None,
                  ca_file: str | None = None) -> int:
    """PATCH ``profile.yaml`` of ``configmap``; returns the HTTP status."""
    if namespace is None:
        namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
    if api_url is None:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        api_url = f"https://{host}:{port}"
    if token is None:
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
    if ca_file is None and api_url.startswith("https"):
        ca_file = str(SERVICE_ACCOUNT / "ca.crt")
    body = json.dumps({"data": {"profile.yaml": Path(profile_path).read_text()}}).encode()
    request = urllib.request.Request(
        f"{api_url}/api/v1/namespaces/{namespace}/configmaps/{configmap}", data=body,
        method="PATCH", headers={"Authorization": f"Bearer {token}",
                                 "Content-Type": "application/merge-patch+json"})
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        return response.status


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    status = store_profile(*argv)
    print(f"stored {argv[0]} in ConfigMap {argv[1]} (HTTP {status})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
