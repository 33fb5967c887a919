"""Reads stay queued root tasks with eugo: peak tasks processing and peak worker memory, plain
Dask vs eugo, on one cluster of separate processes.

A large read -> compute -> reduce: ``from_array`` over a synthetic reader of an N² float32 array
in 600² blocks (each read is a root task distributed queues), ``sin(x)**2 + cos(x)`` per block
(eugo offloads it to the GPU worker: emulated device, min-speedup 0), then ``.sum()``. The
cluster is ``dask scheduler --preload eugo_dask.plugin``, a GPU worker (``GPU=1``, emulated
device, 2 threads) and two CPU workers (1 thread each), all separate processes. The same
collection is computed plain and with eugo, alternating; while each runs, a periodic callback
on the scheduler samples every 10 ms the tasks processing on all workers, the tasks queued and
the keys held in memory, and one on each worker samples its resident memory. Prints the peaks
side by side, with their ratio eugo/plain, where the compute ran, and that the results agree.

Reads stay queued, but their consumers run on the GPU worker, and distributed's queuing bounds
what each worker is processing, not what waits for a consumer elsewhere (dask/distributed#9164:
root-ish tasks with restricted dependents). Where the device consumes blocks more slowly than the
reads produce them (here: the emulated device, NumPy on shared cores), reads run ahead. A second
cluster with ``--memory-limit`` on every worker shows what bounds it: distributed's own spilling
and pausing (rows marked ``*``).

    python benchmarks/root_tasks.py           # 24000² float32 in 600² blocks: 1,600 reads, 2.3 GB; 1 GiB limit
    python benchmarks/root_tasks.py --quick   # 4800² in 600² blocks: 64 reads; 512 MiB limit
"""

from __future__ import annotations

import tempfile

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask
from eugo_dask.testing import H200_SERVER, process_cluster

BLOCK = 600
MiB = 2**20


class SyntheticRead:
    """An N² float32 array-like whose blocks are made when read (stands in for zarr or HDF5:
    the reads are root tasks, and no file is needed)."""

    dtype = np.dtype("f4")

    def __init__(self, n: int) -> None:
        self.shape = (n, n)
        self.ndim = 2

    def __getitem__(self, index):
        rows, cols = (range(*s.indices(n)) for s, n in zip(index, self.shape))
        return np.full((len(rows), len(cols)), (rows.start % 7 + cols.start % 5) / 10, dtype="f4")


def pipeline(n: int):
    x = da.from_array(SyntheticRead(n), chunks=BLOCK)
    return (np.sin(x) ** 2 + np.cos(x)).sum()


def _start_scheduler_sampling(dask_scheduler) -> None:
    from tornado.ioloop import PeriodicCallback

    peaks = {"processing": 0, "queued": 0, "in_memory": 0}

    def sample() -> None:
        workers = dask_scheduler.workers.values()
        now = {"processing": sum(len(ws.processing) for ws in workers),
               "queued": len(dask_scheduler.queued),
               "in_memory": sum(len(ws.has_what) for ws in workers)}
        for name, value in now.items():
            peaks[name] = max(peaks[name], value)

    callback = PeriodicCallback(sample, 10)
    callback.start()
    dask_scheduler._root_tasks_benchmark = (callback, peaks)


def _stop_scheduler_sampling(dask_scheduler) -> dict:
    callback, peaks = dask_scheduler._root_tasks_benchmark
    callback.stop()
    return peaks


def _start_worker_sampling(dask_worker) -> None:
    import psutil
    from tornado.ioloop import PeriodicCallback

    process = psutil.Process()
    rss = process.memory_info().rss
    peak = {"base": rss, "peak": rss}

    def sample() -> None:
        peak["peak"] = max(peak["peak"], process.memory_info().rss)

    callback = PeriodicCallback(sample, 10)
    callback.start()
    dask_worker._root_tasks_benchmark = (callback, peak)


def _stop_worker_sampling(dask_worker) -> tuple[str, int]:
    callback, peak = dask_worker._root_tasks_benchmark
    callback.stop()
    return dask_worker.name, peak["peak"] - peak["base"]


def run_once(client, n: int, settings: dict) -> dict:
    client.run_on_scheduler(_start_scheduler_sampling)
    client.run(_start_worker_sampling)
    with dask.config.set(settings):
        result = float(client.compute(pipeline(n)).result(timeout=1800))
    peaks = client.run_on_scheduler(_stop_scheduler_sampling)
    growth = dict(client.run(_stop_worker_sampling).values())
    return {**peaks, "rss": growth, "result": result}


def measure(n: int, runs: dict[str, dict], *, rounds: int, memory_limit: str | None) -> dict:
    """Compute the pipeline with each of ``runs``' settings ``rounds`` times, alternating, on a
    fresh process cluster (``--memory-limit`` on every worker when given). Returns the runs'
    peaks by name, and how many tasks ran on the GPU worker's device."""
    extra = ["--memory-limit", memory_limit] if memory_limit else []
    workers = {"gpu": {"gpu": True, "nthreads": 2, "extra": extra},
               "cpu-0": {"extra": extra}, "cpu-1": {"extra": extra}}
    with tempfile.TemporaryDirectory() as logs, process_cluster(logs, workers=workers) as (_, client):
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, settings in runs.items():
                results[name].append(run_once(client, n, settings))
        stats = client.run(eugo_dask.device_stats)  # each worker's own count, not a heartbeat's
        warnings = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.plugins["eugo"].warnings))
    return {"runs": results, "on_device": sum(st["tasks"] for st in stats.values()),
            "warnings": warnings}


def print_runs(results: dict[str, list[dict]], label: str = "") -> None:
    for name, runs in results.items():
        for r in runs:
            rss = r["rss"]
            print(f"{name + label:<6} {r['processing']:>10} {r['queued']:>7} {r['in_memory']:>9} "
                  f"{rss['gpu'] / MiB:>20.0f} {rss['cpu-0'] / MiB:>6.0f} {rss['cpu-1'] / MiB:>6.0f}")


def main() -> None:
    args = _common.parse_args(_common.benchmark_parser(__doc__))
    n = 4800 if args.quick else 24000
    rounds = 1 if args.quick else 2
    limit = "512MiB" if args.quick else "1GiB"
    plain = {"optimizations": []}
    eugo = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated", "eugo.min-speedup": 0,
            "eugo.profile": H200_SERVER}
    print(f"{n}² float32 in {BLOCK}² blocks: {(n // BLOCK) ** 2} reads, "
          f"{n * n * 4 / 2**30:.2f} GiB; workers: gpu (2 threads, emulated device), cpu-0, cpu-1")
    free = measure(n, {"plain": plain, "eugo": eugo}, rounds=rounds, memory_limit=None)
    limited = measure(n, {"eugo": eugo}, rounds=1, memory_limit=limit)
    print(f"{'run':<6} {'processing':>10} {'queued':>7} {'in memory':>9} "
          f"{'RSS growth MiB: gpu':>20} {'cpu-0':>6} {'cpu-1':>6}")
    print_runs(free["runs"])
    print(f"with --memory-limit {limit} on every worker (distributed spills and pauses):")
    print_runs(limited["runs"], "*")
    worst = {name: {"processing": max(r["processing"] for r in runs),
                    "memory": max(max(r["rss"].values()) for r in runs)}
             for name, runs in free["runs"].items()}
    print(f"peak processing eugo/plain: {worst['eugo']['processing'] / worst['plain']['processing']:.2f}; "
          f"peak worker RSS growth eugo/plain: "
          f"{worst['eugo']['memory'] / max(worst['plain']['memory'], 1):.2f}")
    results = [r["result"] for m in (free, limited) for runs in m["runs"].values() for r in runs]
    agree = all(np.isclose(r, results[0], rtol=1e-4) for r in results)
    on_device = free["on_device"] + limited["on_device"]
    print(f"eugo ran {on_device} tasks on the GPU worker's device; results agree: {agree}")
    for warning in dict.fromkeys(free["warnings"] + limited["warnings"]):
        print(f"plugin warned: {warning}")
    if not agree or not free["on_device"] or not limited["on_device"]:
        raise SystemExit("the eugo runs did not offload, or the results differ")


if __name__ == "__main__":
    main()
