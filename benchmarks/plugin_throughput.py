"""Scheduler throughput with the eugo plugin vs without, on the same LocalCluster.

A graph of small-chunk tasks (eugo on, emulated device, min-speedup 0, so every task carries
eugo's annotations and the plugin has work on each) runs repeatedly, alternating with the plugin
registered and unregistered, in one run. Prints tasks per second for each, the ratio of the
medians with/without (goal >= 0.97) and the time spent inside the plugin's hooks as a share of
the runs with it (measured by a timing subclass). The cluster runs in this process on few cores,
so the ratio carries the scheduler's own noise; the hook share is the steadier figure.

    python benchmarks/plugin_throughput.py           # ~28,000 tasks per graph, 5 rounds
    python benchmarks/plugin_throughput.py --quick   # ~2,500 tasks per graph, 3 rounds
    python benchmarks/plugin_throughput.py --quick --dual  # the chunk tasks dual, decided by it

``--dual``: ``eugo.dispatch: dual`` with ``dual-from: 0`` and the default min-speedup, so the
fused chunk tasks carry both paths and the plugin decides each (a root: at submission); the
plugin is registered before the graph is planned (without it the pass plans ``static``), and
without it the dual tasks run their CPU path.
"""

from __future__ import annotations

import statistics
import time

import _common
import dask
import dask.array as da
from distributed import Client, LocalCluster

import eugo_dask
from eugo_dask.plugin import EugoSchedulerPlugin


def graph(blocks: int):
    x = da.random.default_rng(0).random((blocks * 4, blocks * 4), chunks=4)
    return ((x + 1) * 2).sum(axis=0)


class TimedPlugin(EugoSchedulerPlugin):
    """The plugin, with the time spent in its per-task hooks added up."""

    def _fresh_state(self) -> None:  # runs on __init__ and on unpickling in the scheduler
        super()._fresh_state()
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
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--dual", action="store_true", help="the chunk tasks dual (see above)")
    args = _common.parse_args(parser)
    blocks, rounds = (27, 3) if args.quick else (91, 5)
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                "eugo.min-speedup": 0, "eugo.profile": {"base": "h200", "cpu": "server-x86"},
                "distributed.admin.large-graph-warning-threshold": "1GB"}
    if args.dual:
        settings |= {"eugo.min-speedup": 2, "eugo.dispatch": "dual", "eugo.dual-from": 0}
    with dask.config.set(settings), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, resources={"GPU": 1},
        dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        if args.dual:  # (planned where the plugin runs: dual tasks)
            client.register_plugin(TimedPlugin())
        (optimized,) = dask.optimize(graph(blocks))  # plan once; every run submits the same graph
        if args.dual:
            client.unregister_scheduler_plugin("eugo")
        n_tasks = len(optimized.__dask_graph__())
        print(f"tasks per graph: {n_tasks}", flush=True)
        optimized.compute()  # warm-up
        seconds: dict[bool, list[float]] = {True: [], False: []}
        hook_s = 0.0
        for i in range(rounds):  # alternating which goes first
            for with_plugin in ((False, True) if i % 2 else (True, False)):
                if with_plugin:
                    client.register_plugin(TimedPlugin())
                start = time.perf_counter()
                optimized.compute()
                seconds[with_plugin].append(time.perf_counter() - start)
                if with_plugin:
                    plugin = cluster.scheduler.plugins["eugo"]
                    assert plugin.placements, "plugin saw no task"
                    if args.dual:
                        assert plugin.dual.sent, "plugin decided no dual task"
                        print(f"  dual tasks sent: {dict(plugin.dual.sent)}", flush=True)
                    hook_s += plugin.hook_s
                    client.unregister_scheduler_plugin("eugo")
        on = n_tasks / statistics.median(seconds[True])
        off = n_tasks / statistics.median(seconds[False])
        print(f"without plugin: {off:,.0f} tasks/s   with plugin: {on:,.0f} tasks/s   "
              f"ratio {on / off:.3f} (median of {rounds} runs each, alternating)")
        with_s = sum(seconds[True])
        print(f"time in plugin hooks: {hook_s:.3f} s of {with_s:.2f} s ({100 * hook_s / with_s:.2f}%)")


if __name__ == "__main__":
    main()
