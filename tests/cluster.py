"""A real cluster of separate processes: ``dask scheduler`` and ``dask worker`` from the CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from distributed import Client

DASK_CLI = str(Path(sys.executable).with_name("dask"))


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProcessCluster:
    address: str
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    _logs: list = field(default_factory=list)

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        self._logs.append(log)
        self.procs[name] = subprocess.Popen([DASK_CLI, *args], env={**self.env, **env},
                                            stdout=log, stderr=subprocess.STDOUT)

    def add_worker(self, name: str, *, gpu: bool = False, nthreads: int = 1,
                   env: dict[str, str] | None = None, extra: list[str] | None = None) -> None:
        """A worker; ``gpu=True`` advertises ``GPU=1`` and runs the emulated device."""
        args = ["worker", self.address, "--nthreads", str(nthreads), "--name", name,
                "--no-dashboard", "--no-nanny", *(extra or [])]
        worker_env = dict(env or {})
        if gpu:
            args += ["--resources", "GPU=1"]
            worker_env.setdefault("DASK_EUGO__DEVICE", "emulated")
        self._start(name, args, worker_env)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.log_dir.glob("*.log")))

    def close(self) -> None:
        for proc in list(self.procs.values())[::-1]:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self._logs:
            log.close()


@contextlib.contextmanager
def process_cluster(log_dir: Path, *, workers: dict[str, dict], preload_plugin: bool = True,
                    wait_for: int | None = None, scheduler_env: dict[str, str] | None = None,
                    ) -> Iterator[tuple[ProcessCluster, Client]]:
    """Start a scheduler (``--preload eugo_dask.plugin`` unless told otherwise; environment
    ``scheduler_env``) and workers (name -> add_worker options), and yield a connected client."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    # tests define array-likes the processes must unpickle
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cluster = ProcessCluster(f"tcp://127.0.0.1:{port}", log_dir, env=env)
    try:
        args = ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address",
                ":0", "--no-show"]
        if preload_plugin:
            args += ["--preload", "eugo_dask.plugin"]
        cluster._start("scheduler", args, scheduler_env or {})
        for name, options in workers.items():
            cluster.add_worker(name, **options)
        client = None
        deadline = time.monotonic() + 60
        while client is None:
            try:
                client = Client(cluster.address, timeout=5)
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(cluster.logs()) from None
                time.sleep(0.5)
        with client:
            client.wait_for_workers(len(workers) if wait_for is None else wait_for, timeout=60)
            yield cluster, client
    finally:
        cluster.close()
