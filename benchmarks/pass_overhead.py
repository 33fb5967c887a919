"""Cost of the eugo pass next to Dask's own array optimization, on the same graphs.

For graphs of growing size (a matmul -> elementwise -> reduction pipeline of small chunks), both
are timed side by side in one run, alternating, best of N:

- ``dask``: ``dask.array.optimization.optimize`` (blockwise fusion, cull, linear fusion);
- ``plan``: the eugo pass on Dask's output with the default min-speedup (8x8 chunks never pay:
  every task is planned, none rewritten);
- ``rewrite``: the same with min-speedup 0, so every device-capable task is also rewritten (the
  worst case).

Prints tasks, seconds, the ratios to Dask's optimization (goal <= 0.5) and eugo's microseconds
per task (flat as the graph grows means linear).

    python benchmarks/pass_overhead.py            # ~6,000 to ~900,000 tasks
    python benchmarks/pass_overhead.py --quick    # ~900 and ~6,000 tasks
"""

from __future__ import annotations

import _common
import dask
import dask.array as da
import numpy as np
from dask.array.optimization import optimize as dask_optimize

from eugo_dask.graph import ChunkInfo
from eugo_dask.optimization import eugo


def pipeline(blocks: int):
    """~ blocks**2 * (blocks + 3) tasks."""
    n = blocks * 8
    a = da.random.default_rng(0).random((n, n), chunks=8)
    return (np.exp(a @ a.T) + 1).sum(axis=0)


def measure(blocks: int, repeat: int) -> dict:
    x = pipeline(blocks)
    graph, keys = x.__dask_graph__(), x.__dask_keys__()
    chunks = ChunkInfo.from_graph(graph)
    optimized = dask_optimize(graph, keys)
    runs = {
        "dask": lambda: dask_optimize(graph, keys),
        # default min-speedup: 8x8 chunks never pay, so eugo plans every task, rewrites none
        "plan": lambda: eugo(optimized, keys, chunk_info=chunks),
        # min-speedup 0: every device-capable task is rewritten (the worst case)
        "rewrite": lambda: _with_min_speedup_zero(lambda: eugo(optimized, keys, chunk_info=chunks)),
    }
    return {"tasks": len(optimized), **_common.side_by_side(runs, repeat=repeat)}


def _with_min_speedup_zero(fn):
    with dask.config.set({"eugo.min-speedup": 0}):
        return fn()


def main() -> None:
    args = _common.parse_args(_common.benchmark_parser(__doc__))
    sizes = [8, 16] if args.quick else [16, 24, 48, 64, 88]
    repeat = 2 if args.quick else 3
    settings = {"eugo.device": "emulated", "eugo.profile": {"base": "h200", "cpu": "server-x86"}}
    print(f"{'tasks':>9} {'dask s':>8} {'plan s':>8} {'plan/dask':>10} {'µs/task':>8} "
          f"{'rewrite s':>10} {'rewrite/dask':>13} {'µs/task':>8}")
    with dask.config.set(settings):
        for blocks in sizes:
            r = measure(blocks, repeat)
            n = r["tasks"]
            print(f"{n:>9} {r['dask']:>8.3f} {r['plan']:>8.3f} {r['plan'] / r['dask']:>10.2f} "
                  f"{1e6 * r['plan'] / n:>8.1f} {r['rewrite']:>10.3f} "
                  f"{r['rewrite'] / r['dask']:>13.2f} {1e6 * r['rewrite'] / n:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
