"""A heterogeneous cluster on one machine: one GPU worker (the emulated device, GPU=1) and two
CPU workers, the scheduler plugin and its dashboard page.

    python examples/heterogeneous_cluster.py           # keeps the dashboard up for 60 s
    python examples/heterogeneous_cluster.py --quick   # compute, report, exit

Prints where every kind of task ran (from the scheduler plugin's records), what each worker's
device layer did, and the address of the Eugo dashboard page. On a machine with GPUs, start
`dask worker --resources GPU=1` on them and leave eugo.device at auto.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter

import dask
import dask.array as da
import numpy as np
from distributed import Client, Nanny, Scheduler, SpecCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import eugo_dask.plugin

    workers = {
        "gpu": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1}, "silence_logs": logging.WARNING,
                                          "config": {"eugo": {"device": "emulated"}}}},
        "cpu-1": {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.WARNING,
                                            "config": {"eugo": {"device": "none"}}}},
        "cpu-2": {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.WARNING,
                                            "config": {"eugo": {"device": "none"}}}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING) as cluster, \
            Client(cluster) as client:
        client.register_plugin(eugo_dask.plugin.EugoSchedulerPlugin())
        n = 1024 if args.quick else 4096
        a = da.random.default_rng(0).random((n, n), chunks=n // 4, dtype=np.float32)
        x = (np.tanh(a @ a.T) * 2).sum(axis=0)
        with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                              "eugo.min-speedup": 0, "eugo.profile": "h200"}):
            result = x.compute()
        with dask.config.set(optimizations=[]):
            np.testing.assert_allclose(result, x.compute(), rtol=1e-4)
        placements = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.plugins["eugo"].placements))
        print("where each kind of task ran (role: worker -> tasks):")
        for (role, worker), n_tasks in sorted(Counter((r, w) for _, r, w in placements).items()):
            print(f"  {role:<9} {worker:<6} {n_tasks}")
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
        for address, stats in sorted(client.run(eugo_dask.device_stats).items()):
            name = names[address]
            print(f"  {name}: {stats['tasks']} device tasks, {stats['h2d_bytes'] / 1e6:.1f} MB "
                  f"to the device, {stats['d2h_bytes'] / 1e6:.3f} MB back")
        print(f"results match plain Dask; Eugo page: {client.dashboard_link.replace('status', 'eugo')}")
        if not args.quick:
            time.sleep(60)


if __name__ == "__main__":
    main()
