"""Scheduler throughput with the eugo plugin vs without, on the same LocalCluster.

A graph of >= 20,000 small-chunk tasks (eugo on, emulated device, min-speedup 0, so every task
carries eugo's annotations and the plugin has work on each) runs repeatedly, alternating with the
plugin registered and unregistered. Prints tasks per second for each and the ratio with/without
(goal >= 0.97). The machine is shared and the cluster runs in one process on few cores, so the
ratio is noisy; the time spent inside the plugin's hooks, as a share of the run, is printed too
(measured in-process with a timing subclass).

    python benchmarks/plugin_throughput.py           # 5 rounds
    python benchmarks/plugin_throughput.py --quick   # CI
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask.plugin import EugoSchedulerPlugin


def graph(blocks: int):
    x = da.random.default_rng(0).random((blocks * 4, blocks * 4), chunks=4)
    return ((x + 1) * 2).sum(axis=0)


class TimedPlugin(EugoSchedulerPlugin):
    """The plugin, with the time spent in each hook added up."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_s = 0.0

    def update_graph(self, *args, **kwargs):
        start = time.perf_counter()
        super().update_graph(*args, **kwargs)
        self.hook_s += time.perf_counter() - start

    def transition(self, *args, **kwargs):
        start = time.perf_counter()
        super().transition(*args, **kwargs)
        self.hook_s += time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    blocks, rounds = (80, 1) if args.quick else (80, 5)
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                "eugo.min-speedup": 0, "eugo.profile": {"base": "h200", "cpu": "server-x86"},
                "distributed.admin.large-graph-warning-threshold": "1GB"}
    with dask.config.set(settings), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, resources={"GPU": 1},
        dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        x = graph(blocks)
        (optimized,) = dask.optimize(x)  # plan once; both runs submit the same graph
        n_tasks = len(optimized.__dask_graph__())
        rates: dict[bool, list[float]] = {True: [], False: []}
        optimized.compute()  # warm-up
        for i in range(rounds):
            for with_plugin in ((False, True) if i % 2 else (True, False)):
                if with_plugin:
                    client.register_plugin(EugoSchedulerPlugin())
                start = time.perf_counter()
                optimized.compute()
                rates[with_plugin].append(n_tasks / (time.perf_counter() - start))
                if with_plugin:
                    assert cluster.scheduler.plugins["eugo"].placements, "plugin saw no task"
                    client.unregister_scheduler_plugin("eugo")
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        timed = TimedPlugin()
        cluster.scheduler.add_plugin(timed)
        start = time.perf_counter()
        optimized.compute()
        elapsed = time.perf_counter() - start
        cluster.scheduler.remove_plugin(timed.name)
        print(f"tasks per graph: {n_tasks}")
        print(f"without plugin: {off:,.0f} tasks/s   with plugin: {on:,.0f} tasks/s   "
              f"ratio {on / off:.3f}")
        print(f"time in plugin hooks: {timed.hook_s:.3f} s of {elapsed:.2f} s "
              f"({100 * timed.hook_s / elapsed:.2f}%)")


if __name__ == "__main__":
    main()
