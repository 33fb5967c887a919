"""Use a cluster deployed with the Helm chart (helm/eugo-dask).

    kubectl port-forward svc/RELEASE-eugo-dask-scheduler 8786 8787
    python examples/connect_to_chart.py tcp://localhost:8786

Turns eugo on for this client, explains the plan, computes, and prints what the scheduler plugin
counted. `--quick` starts a throwaway local scheduler and workers first, so the script runs
anywhere (the tests use it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import eugo_dask


@contextlib.contextmanager
def local_stand_in():
    import eugo_dask.plugin

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(eugo_dask.plugin.EugoSchedulerPlugin())  # the chart preloads it
        yield cluster.scheduler_address


def reported_summary(client: Client, timeout: float = 10.0) -> dict:
    """The plugin's summary once the workers' reports (sent with their heartbeats, a second or
    so after the tasks end) account for the GPU tasks the workers say they ran."""
    per_process = client.run(
        lambda: ((socket.gethostname(), os.getpid()), eugo_dask.device_stats()["tasks"]))
    ran = sum(dict(per_process.values()).values())  # workers sharing a process share its counts
    deadline = time.monotonic() + timeout
    while True:
        summary = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary())
        if sum(summary["tasks"].get("gpu", {}).values()) >= ran or time.monotonic() > deadline:
            return summary
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?", default="tcp://localhost:8786")
    parser.add_argument("--quick", action="store_true", help="against a local stand-in")
    args = parser.parse_args()
    with (local_stand_in() if args.quick else contextlib.nullcontext(args.address)) as address:
        settings = {"optimizations": [eugo_dask.eugo]}
        if args.quick:  # the stand-in has no GPU: plan for, and run on, the emulated device
            settings.update({"eugo.device": "emulated", "eugo.profile": "h200"})
        with Client(address) as client, dask.config.set(settings):
            a = da.random.default_rng(1).random((4096, 4096), chunks=2048, dtype=np.float32)
            x = (a @ a.T).mean(axis=0)
            print(eugo_dask.explain(x))
            x.compute()
            summary = reported_summary(client)
            print("scheduler plugin:", {k: summary[k] for k in ("tasks", "bytes_h2d", "bytes_d2h",
                                                                "fallbacks")})


if __name__ == "__main__":
    main()
