"""A stand-in for the Kubernetes API server: one namespace's ConfigMaps over HTTP or HTTPS, on
IPv4 or IPv6 loopback, recording each request; an error can be set to answer every request."""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

FORBIDDEN = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
             "message": 'configmaps "demo-eugo-dask-eugo-profile" is forbidden: User '
                        '"system:serviceaccount:dask:demo-eugo-dask-calibrate" cannot patch resource '
                        '"configmaps" in API group "" in the namespace "dask"'}


class FakeApiServer:
    def __init__(self, namespace: str = "dask", *, host: str = "127.0.0.1",
                 tls_dir: Path | None = None):
        self.namespace = namespace
        self.configmaps: dict[str, dict[str, str]] = {}
        self.requests: list[dict[str, Any]] = []
        self.error: tuple[int, dict] | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _configmap(self) -> str | None:
                prefix = f"/api/v1/namespaces/{server.namespace}/configmaps/"
                return self.path[len(prefix):] if self.path.startswith(prefix) else None

            def _reply(self, status: int, body: dict) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append({"method": self.command, "path": self.path, "body": body,
                                        "auth": self.headers["Authorization"],
                                        "type": self.headers["Content-Type"]})
                name = self._configmap()
                if server.error is not None:
                    return self._reply(*server.error)
                if name not in server.configmaps:
                    return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound",
                                             "message": f'configmaps "{name}" not found'})
                if self.command == "PATCH":
                    server.configmaps[name].update(body["data"])
                self._reply(200, {"kind": "ConfigMap", "metadata": {"name": name},
                                  "data": server.configmaps[name]})

            do_GET = do_PATCH = _handle

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.httpd = Server((host, 0), Handler)
        self.host, self.port = host, self.httpd.server_address[1]
        self.scheme = "http"
        if tls_dir is not None:
            self.ca_file = make_certificate(tls_dir, host)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls_dir / "tls.crt", tls_dir / "tls.key")
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_certificate(directory: Path, host: str) -> str:
    """A self-signed certificate for ``host`` (its own CA); returns the CA file."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=kubernetes", "-addext", f"subjectAltName=IP:{host}",
                    "-keyout", str(directory / "tls.key"), "-out", str(directory / "tls.crt")],
                   check=True, capture_output=True)
    return str(directory / "tls.crt")
