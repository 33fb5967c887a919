"""Reads paced to the device with eugo: peak tasks processing, peak worker memory and wall time,
plain Dask vs eugo with reads unpaced and paced, each run on a fresh cluster of separate processes.

A large read -> compute -> reduce: ``from_array`` over a synthetic reader of an N² float32 array
in 600² blocks (each read is a root task distributed queues), ``sin(x)**2 + cos(x)`` per block
(eugo offloads it to the GPU worker: emulated device, min-speedup 0), then ``.sum()``. The
cluster is ``dask scheduler --preload eugo_dask.plugin``, a GPU worker (``GPU=1``, emulated
device, 2 threads) and two CPU workers (1 thread each), all separate processes, started afresh
for each run (a worker's resident memory does not fall back after a run). The same collection
is computed plain (``plain``), with eugo and ``eugo.read-ahead: null`` (``unpaced``: reads
queued by distributed alone) and with eugo as it is (``eugo``: reads paced), in turn, each
round; while each runs, a periodic callback on the scheduler samples every 10 ms the tasks
processing on all workers, the tasks queued and the keys held in memory, and one on each worker
samples its resident memory. Prints each run's peaks and wall time, the worst peaks' ratios
eugo/plain (the bound: 2x for tasks processing, 1.5x for memory) and the best wall times' ratio
eugo/unpaced (within 5%), what ran on the device, and that the results agree.

Distributed's queuing bounds what each worker is processing, not what waits for a consumer on
another worker (dask/distributed#9164: root-ish tasks with restricted dependents): unpaced, where
the device consumes blocks more slowly than the reads produce them (here: the emulated device,
NumPy on shared cores), reads run ahead and their blocks wait in memory on the GPU worker. Paced,
eugo's scheduler plugin holds a read back until the block read W places before it is consumed
and its result copied back (:mod:`eugo_dask.gates`: a dependency on the scheduler only, taken
away before the read is sent, so nothing is fetched for it): W is the reads the workers take at
once plus ``eugo.read-ahead`` (2) per GPU slot, 9 here. The plugin also holds each copy to the
device back until the device task 3 places before its consumer (among those that consume a
copy) has ended
(``benchmarks/device_memory.py``).

Here the emulated device's kernels (NumPy, a few ms a block) are not what bounds the run: tasks'
overheads and transfers on 2 shared cores are. ``--slow-device`` makes the GPU worker's device
take 50 ms a task (``tests/slow_device.py``), so that it consumes blocks more slowly than they
are read, the case pacing is for.

    python benchmarks/root_tasks.py           # 24000² float32 in 600² blocks: 1,600 reads, 2.3 GB; 2 rounds
    python benchmarks/root_tasks.py --quick   # 4800² in 600² blocks: 64 reads; 3 rounds
    python benchmarks/root_tasks.py --quick --slow-device   # the device takes 50 ms a block
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask
from eugo_dask.testing import process_cluster

BLOCK = 600
SLOW_DEVICE = str(Path(__file__).resolve().parents[1] / "tests" / "slow_device.py")
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
        start = time.perf_counter()
        result = float(client.compute(pipeline(n)).result(timeout=1800))
        wall = time.perf_counter() - start
    peaks = client.run_on_scheduler(_stop_scheduler_sampling)
    growth = dict(client.run(_stop_worker_sampling).values())
    return {**peaks, "rss": growth, "result": result, "wall": wall}


def measure(n: int, runs: dict[str, dict], *, rounds: int, slow_device: bool = False) -> dict:
    """Compute the pipeline with each of ``runs``' settings ``rounds`` times, in turn, each run
    on a fresh process cluster (with ``slow_device``, the GPU worker's device takes 50 ms a
    task): a worker's resident memory does not go back to where it was after a run (the
    allocator keeps what it got), so on one cluster a run that followed the unpaced one grew by
    nothing. Returns the runs' peaks by name, how many tasks ran on the GPU worker's device, and
    what the plugin warned of."""
    workers, _ = _common.emulated_cluster(["--preload", SLOW_DEVICE] if slow_device else [])
    results: dict[str, list[dict]] = {name: [] for name in runs}
    on_device = 0
    warnings: list[str] = []
    for _ in range(rounds):
        for name, settings in runs.items():
            with tempfile.TemporaryDirectory() as logs, \
                    process_cluster(logs, workers=workers) as (_, client):
                results[name].append(run_once(client, n, settings))
                # each worker's own count, not a heartbeat's
                on_device += sum(st["tasks"] for st in client.run(eugo_dask.device_stats).values())
                warnings += client.run_on_scheduler(
                    lambda dask_scheduler: list(dask_scheduler.plugins["eugo"].warnings))
    return {"runs": results, "on_device": on_device, "warnings": warnings}


def print_runs(results: dict[str, list[dict]]) -> None:
    for name, runs in results.items():
        for r in runs:
            rss = r["rss"]
            print(f"{name:<8} {r['processing']:>10} {r['queued']:>7} {r['in_memory']:>9} "
                  f"{rss['gpu'] / MiB:>20.0f} {rss['cpu-0'] / MiB:>6.0f} {rss['cpu-1'] / MiB:>6.0f}"
                  f" {r['wall']:>7.2f}")


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--slow-device", action="store_true",
                        help="the GPU worker's device takes 50 ms a task (tests/slow_device.py)")
    args = _common.parse_args(parser)
    n = 4800 if args.quick else 24000
    rounds = 3 if args.quick else 2
    plain = {"optimizations": []}
    _, eugo = _common.emulated_cluster([])
    unpaced = {**eugo, "eugo.read-ahead": None}
    print(f"{n}² float32 in {BLOCK}² blocks: {(n // BLOCK) ** 2} reads, "
          f"{n * n * 4 / 2**30:.2f} GiB; workers: gpu (2 threads, emulated device"
          f"{', 50 ms a task' if args.slow_device else ''}), cpu-0, cpu-1")
    measured = measure(n, {"plain": plain, "unpaced": unpaced, "eugo": eugo}, rounds=rounds,
                       slow_device=args.slow_device)
    runs = measured["runs"]
    print(f"{'run':<8} {'processing':>10} {'queued':>7} {'in memory':>9} "
          f"{'RSS growth MiB: gpu':>20} {'cpu-0':>6} {'cpu-1':>6} {'wall s':>7}")
    print_runs(runs)
    worst = {name: {"processing": max(r["processing"] for r in rs),
                    "memory": max(max(r["rss"].values()) for r in rs),
                    "wall": min(r["wall"] for r in rs)}
             for name, rs in runs.items()}

    def ratio(name: str, base: str, what: str) -> str:
        return f"{worst[name][what] / max(worst[base][what], 1e-9):.2f}"

    print(f"peak processing eugo/plain: {ratio('eugo', 'plain', 'processing')} (unpaced/plain: "
          f"{ratio('unpaced', 'plain', 'processing')}); peak worker RSS growth eugo/plain: "
          f"{ratio('eugo', 'plain', 'memory')} (unpaced/plain: {ratio('unpaced', 'plain', 'memory')}); "
          f"best wall eugo/unpaced: {ratio('eugo', 'unpaced', 'wall')} "
          f"(eugo/plain: {ratio('eugo', 'plain', 'wall')})")
    results = [r["result"] for rs in runs.values() for r in rs]
    agree = all(np.isclose(r, results[0], rtol=1e-4) for r in results)
    print(f"eugo ran {measured['on_device']} tasks on the GPU worker's device; results agree: {agree}")
    for warning in dict.fromkeys(measured["warnings"]):
        print(f"plugin warned: {warning}")
    if not agree or not measured["on_device"]:
        raise SystemExit("the eugo runs did not offload, or the results differ")


if __name__ == "__main__":
    main()
