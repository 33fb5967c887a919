"""Cost of the eugo pass next to Dask's own array optimization, on the same graphs.

For graphs of growing size (a matmul -> elementwise -> reduction pipeline of small chunks), both
are timed side by side in one run, alternating, best of N:

- ``dask``: ``dask.array.optimization.optimize`` (blockwise fusion, cull, linear fusion);
- ``eugo``: the eugo pass on Dask's output (plan every task, rewrite the GPU ones) with the
  emulated device and min-speedup 0, so every device-capable task is rewritten (the worst case).

Prints tasks, seconds, the ratio eugo/dask (goal <= 0.5) and eugo's microseconds per task (flat
as the graph grows means linear).

    python benchmarks/pass_overhead.py            # up to ~1M tasks
    python benchmarks/pass_overhead.py --quick    # CI: small graphs
"""

from __future__ import annotations

import argparse
import gc
import time

import dask
import dask.array as da
import numpy as np
from dask.array.optimization import optimize as dask_optimize

import eugo_dask
from eugo_dask.optimization import eugo
from eugo_dask.planner import ChunkInfo


def pipeline(blocks: int):
    """~ blocks**2 * (blocks + 3) tasks."""
    n = blocks * 8
    a = da.random.default_rng(0).random((n, n), chunks=8)
    return (np.exp(a @ a.T) + 1).sum(axis=0)


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(blocks: int, repeat: int) -> dict:
    x = pipeline(blocks)
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    chunks = ChunkInfo.from_graph(graph)
    optimized = dask_optimize(graph, keys)
    dask_s = eugo_s = float("inf")
    for _ in range(repeat):  # alternate, so both see the same machine noise
        dask_s = min(dask_s, best_of(lambda: dask_optimize(graph, keys), 1))
        eugo_s = min(eugo_s, best_of(lambda: eugo(optimized, keys, chunk_info=chunks), 1))
    rewritten = eugo(optimized, keys, chunk_info=chunks)
    return {"tasks": len(optimized), "rewritten": len(dict(rewritten)), "dask_s": dask_s,
            "eugo_s": eugo_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small graphs (CI)")
    args = parser.parse_args()
    sizes = [8, 16] if args.quick else [16, 32, 48, 64, 96]
    repeat = 2 if args.quick else 3
    settings = {"eugo.device": "emulated", "eugo.min-speedup": 0,
                "eugo.profile": {"base": "h200", "cpu": "server-x86"}}
    print(f"{'tasks':>9} {'dask s':>9} {'eugo s':>9} {'eugo/dask':>10} {'eugo µs/task':>13}")
    with dask.config.set(settings):
        for blocks in sizes:
            r = measure(blocks, repeat)
            print(f"{r['tasks']:>9} {r['dask_s']:>9.3f} {r['eugo_s']:>9.3f} "
                  f"{r['eugo_s'] / r['dask_s']:>10.2f} {1e6 * r['eugo_s'] / r['tasks']:>13.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
