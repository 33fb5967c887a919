"""Testing your own pipelines with eugo on, on a machine without a GPU.

The emulated device (NumPy-backed device arrays that behave like CuPy's where placement depends
on it) runs eugo's GPU tasks anywhere, so a pipeline's placement, copies and results can be
tested in CI. With distributed's ``gen_cluster``::

    from distributed.utils_test import gen_cluster
    from eugo_dask.testing import cpu_worker, device_tasks, emulated_settings, gpu_worker

    @gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
    async def test_my_pipeline(c, s, gpu, cpu):
        result = await c.compute(my_pipeline())
        assert device_tasks(gpu) > 0 and device_tasks(cpu) == 0

``gen_cluster`` copies Dask's config before each test (``reset_config``); eugo's settings survive
the copy. With a ``LocalCluster``, :func:`emulated_gpu_cluster` starts one GPU worker and CPU
workers with the scheduler plugin. Counts are per worker (:func:`device_tasks`), which tells
workers apart where several share a process.

:func:`process_cluster` starts a real cluster of separate processes (``dask scheduler`` with
eugo's plugin preloaded, ``dask worker`` per spec), the setting where a client's config does not
reach the scheduler and device arrays cross process boundaries; it yields the
:class:`ProcessCluster` (kill a worker, read the logs) and a connected client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from eugo_dask.array_optimize import bridge
from eugo_dask.optimization import eugo
from eugo_dask.runtime import RAN_ON_CPU, RAN_ON_DEVICE

#: An H200 beside a representative server CPU, both presets: plans that do not depend on the
#: machine the test runs on.
H200_SERVER = {"base": "h200", "cpu": "server-x86"}


def emulated_settings(*, min_speedup: float = 0, profile: Any = None,
                      resource: str = "GPU") -> dict[str, Any]:
    """Dask config that turns eugo on with the emulated device (``min_speedup=0``: every task
    that can run on a device does, so a test exercises the device path).

    It carries eugo's hook (``array_optimize``) too: ``distributed.utils_test`` snapshots Dask's
    config when it is imported and ``gen_cluster`` restores that snapshot before each test, so
    where it was imported before ``eugo_dask`` the snapshot has no hook, and eugo would be off."""
    return {
        "array_optimize": bridge,
        "optimizations": [eugo],
        "eugo.device": "emulated",
        "eugo.min-speedup": min_speedup,
        "eugo.profile": H200_SERVER if profile is None else profile,
        "eugo.resource": resource,
    }


def gpu_worker(nthreads: int = 1, *, resource: str = "GPU",
               host: str = "127.0.0.1") -> tuple[str, int, dict[str, Any]]:
    """A worker spec for ``gen_cluster(nthreads=[...])`` that advertises the GPU resource."""
    return (host, nthreads, {"resources": {resource: 1}})


def cpu_worker(nthreads: int = 1, *, host: str = "127.0.0.1") -> tuple[str, int]:
    """A worker spec for ``gen_cluster(nthreads=[...])`` without the GPU resource."""
    return (host, nthreads)


def device_tasks(worker: Any) -> int:
    """GPU tasks ``worker`` ran on its device."""
    return int(getattr(worker, "eugo_ran", {}).get(RAN_ON_DEVICE, 0))


def cpu_path_tasks(worker: Any) -> int:
    """GPU tasks ``worker`` ran on its CPU (fallbacks and re-routed tasks)."""
    return int(getattr(worker, "eugo_ran", {}).get(RAN_ON_CPU, 0))


@contextlib.contextmanager
def emulated_gpu_cluster(*, cpu_workers: int = 1, threads_per_worker: int = 1,
                         resource: str = "GPU", **settings: Any) -> Iterator[Any]:
    """A ``LocalCluster`` (workers in this process) with one GPU worker on the emulated device,
    ``cpu_workers`` CPU workers and the eugo scheduler plugin, with eugo's settings in force
    (``emulated_settings(**settings)``). Yields a connected ``Client``."""
    import dask
    from distributed import Client, LocalCluster, Worker

    from eugo_dask.plugin import EugoSchedulerPlugin

    with dask.config.set(emulated_settings(resource=resource, **settings)):
        with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
            cluster.worker_spec.update({
                "gpu": {"cls": Worker, "options": {"nthreads": threads_per_worker,
                                                    "resources": {resource: 1}}},
                **{f"cpu-{i}": {"cls": Worker, "options": {"nthreads": threads_per_worker}}
                   for i in range(cpu_workers)},
            })
            cluster.scale(1 + cpu_workers)
            with Client(cluster) as client:
                # registered as a user would: the scheduler starts it (scheduler.add_plugin
                # would not), and it installs eugo's worker plugin on every worker
                client.register_plugin(EugoSchedulerPlugin(resource=resource))
                client.wait_for_workers(1 + cpu_workers, timeout=60)
                yield client


# ---------------------------------------------------------------------------------------------
# A cluster of separate processes
# ---------------------------------------------------------------------------------------------
#: The ``dask`` command of this Python environment.
DASK_CLI = str(Path(sys.executable).with_name("dask"))


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ProcessCluster:
    """A scheduler and workers started from the ``dask`` CLI, each logging to ``log_dir``."""

    address: str
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    _logs: list[IO[str]] = field(default_factory=list)

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

    def pid(self, name: str) -> int:
        return self.procs[name].pid

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


def _listening_scheduler(log_dir: Path, env: dict[str, str], preload_plugin: bool,
                         scheduler_env: dict[str, str]) -> ProcessCluster:
    """A scheduler process listening on a free port: started again on another port where
    another process took the first before the scheduler bound it (three tries); each wait
    bounded."""
    for _ in range(3):
        port = free_port()
        cluster = ProcessCluster(f"tcp://127.0.0.1:{port}", log_dir, env=env)
        args = ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address",
                ":0", "--no-show"]
        if preload_plugin:
            args += ["--preload", "eugo_dask.plugin"]
        cluster._start("scheduler", args, scheduler_env)
        deadline = time.monotonic() + 60
        while cluster.procs["scheduler"].poll() is None and time.monotonic() < deadline:
            if "Scheduler at:" in (log_dir / "scheduler.log").read_text():
                return cluster
            time.sleep(0.1)
        logs = cluster.logs()
        cluster.close()
        if "Address already in use" not in logs:
            raise RuntimeError(f"the scheduler did not start:\n{logs}")
    raise RuntimeError(f"the scheduler found no free port in three tries:\n{logs}")


@contextlib.contextmanager
def process_cluster(log_dir: Path, *, workers: dict[str, dict[str, Any]],
                    preload_plugin: bool = True, wait_for: int | None = None,
                    scheduler_env: dict[str, str] | None = None,
                    pythonpath: Sequence[str] = ()) -> Iterator[tuple[ProcessCluster, Any]]:
    """Start a scheduler (``--preload eugo_dask.plugin`` unless told otherwise; environment
    ``scheduler_env``) and workers (name -> :meth:`ProcessCluster.add_worker` options), and
    yield the cluster and a connected ``Client``. The processes start without this process's
    ``DASK_*`` variables; ``pythonpath`` goes first on theirs (where the array-likes and
    functions of a test live). Every wait is bounded: a cluster that does not come up raises
    with its logs."""
    from distributed import Client

    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*pythonpath, env.get("PYTHONPATH")]))
    cluster = _listening_scheduler(Path(log_dir), env, preload_plugin, scheduler_env or {})
    try:
        # (workers start once the scheduler listens: a worker's own server, on a port of the
        # system's choosing, could otherwise take the scheduler's, and a client would then
        # connect to it and wait for a handshake that never comes)
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
