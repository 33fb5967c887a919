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

Then other shapes of graph (the matmul pipeline is not the hardest case): reads of a stored
(h5py- or zarr-like) array and random chunks, each through an elementwise chain into a mean (a
chunk task per chunk: eugo writes a copy in, a device task and a copy back per chunk), on one
size each; and at ~6,000 to ~1,000,000 tasks (quick: ~6,000) a fused elementwise chain of random
chunks (``chain``), the same into a reduction tree (``chain-sum``), ``(z @ z.T).sum()``
(``matmul-sum``) and a ``map_overlap`` stencil with a function of the user's (which stays on the
CPU).

Then two graphs submitted to a distributed scheduler (a separate process, see
``_scheduler_submit.py``), plain, ``plan`` and ``rewrite``, each on a fresh cluster: how long the
scheduler's event loop was blocked while it took the graph (Dask's optimization and eugo's pass
run in an offload thread that shares the GIL with the loop), the scheduler's ``update-graph``
times and its peak memory growth, with eugo's loop blocking, ``update-graph`` time and memory as
ratios to plain Dask's (goal: not much above 1). The graphs (``SCHEDULER_SHAPES``):

- ``pipeline``: the matmul pipeline above;
- ``random-chain``: ``a = da.random.default_rng(0).random((n, n), chunks=8)``,
  ``(np.exp(a) * 2 + a).sum()``: Dask fuses each chunk's creation, chain and partial sum into
  one task (and keeps an alias under the chain's old key, so the scheduler holds two keys per
  chunk), then the reduction tree, 2x2 blocks a step.

    python benchmarks/pass_overhead.py            # 2 to ~1,070,000 tasks; scheduler ~515,000
                                                  # (pipeline) and ~1,470,000 (random-chain)
    python benchmarks/pass_overhead.py --quick    # 2 to ~6,000 tasks; scheduler ~6,000 and ~3,700
    python benchmarks/pass_overhead.py --only-scheduler random-chain [--blocks N]
                                                  # that graph's scheduler rows alone
    python benchmarks/pass_overhead.py --shape chain-sum [--shape stencil ...]
                                                  # those shapes' rows alone

The other graph shapes are in ``SHAPES``.
"""

from __future__ import annotations

import warnings

import _common
import dask
import dask.array as da
import numpy as np
from _scheduler_submit import measure_submission
from dask.array.core import PerformanceWarning
from dask.array.optimization import optimize as dask_optimize
from root_tasks import SyntheticRead

from eugo_dask.graph import ChunkInfo
from eugo_dask.optimization import eugo

SETTINGS = {"eugo.device": "emulated", "eugo.profile": {"base": "h200", "cpu": "server-x86"}}


def _random(blocks: int):
    """Random chunks of 8 x 8, ``blocks`` per side."""
    n = blocks * 8
    return da.random.default_rng(0).random((n, n), chunks=8)


def pipeline(blocks: int):
    """~ blocks**2 * (blocks + 3) tasks."""
    a = _random(blocks)
    with warnings.catch_warnings():  # many small chunks are the point: no PerformanceWarning
        warnings.simplefilter("ignore", PerformanceWarning)
        return (np.exp(a @ a.T) + 1).sum(axis=0)


def _chain_to_mean(a):
    return (da.sin(da.exp(a) * 2 + a.T) ** 2).mean(axis=0)


def reads(blocks: int):
    """Reads of blocks x blocks chunks of a stored array through an elementwise chain."""
    return _chain_to_mean(da.from_array(SyntheticRead(blocks * 8), chunks=8))


def random_chunks(blocks: int):
    """The same chain over random chunks."""
    return _chain_to_mean(_random(blocks))


def stencil(blocks: int):
    """``map_overlap`` with the user's own function, summed by rows (~12 tasks a block)."""
    return _random(blocks).map_overlap(lambda block: block * 2, depth=1).sum(axis=1)


def chain(blocks: int):
    """``(x + 1) * 2`` of random chunks: Dask fuses each chunk's creation and chain into one
    task (and keeps an alias under the chain's old key: two keys a block)."""
    return (_random(blocks) + 1) * 2


def chain_sum(blocks: int):
    """``((x + 1) * 2).sum(axis=0)``: the fused chain's chunk tasks, then a reduction tree."""
    return chain(blocks).sum(axis=0)


def matmul_sum(blocks: int):
    """``(z @ z.T).sum()``: a contraction per block triple (~1.5 blocks³ tasks)."""
    z = _random(blocks)
    return (z @ z.T).sum()


#: name -> (graph builder, blocks per side: full sizes, quick size). The chains, the tree and
#: the stencil at ~6,000, ~60,000, ~250,000 and ~1,000,000 tasks (quick: the first).
SHAPES = {"reads": (reads, (160,), 20), "random": (random_chunks, (160,), 20),
          "chain": (chain, (55, 173, 354, 707), 55),
          "chain-sum": (chain_sum, (50, 160, 326, 652), 50),
          "matmul-sum": (matmul_sum, (16, 34, 55, 88), 16),
          "stencil": (stencil, (23, 71, 146, 291), 23)}


def measure(blocks: int, repeat: int, build=pipeline) -> dict:
    with warnings.catch_warnings():  # many small chunks are the point: no PerformanceWarning
        warnings.simplefilter("ignore", PerformanceWarning)
        x = build(blocks)
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


def random_chain(blocks: int):
    """Random chunks through an elementwise chain into a sum: one fused task per chunk (creation,
    chain, partial sum; plus the alias Dask's fusion leaves under the old key), then the tree."""
    with warnings.catch_warnings():  # many small chunks are the point: no PerformanceWarning
        warnings.simplefilter("ignore", PerformanceWarning)
        a = _random(blocks)
        return (np.exp(a) * 2 + a).sum()


#: name -> (graph builder, blocks per side: full, quick), submitted to a scheduler.
#: pipeline: 72 -> ~515,000 tasks; random-chain: 794 -> ~1,470,000 (2 x 794² + the tree), 40 ->
#: ~3,700
SCHEDULER_SHAPES = {"pipeline": (pipeline, 72, 16), "random-chain": (random_chain, 794, 40)}


def submission(build, blocks: int):
    """``build(blocks)`` submitted to a fresh scheduler per mode (see ``_scheduler_submit.py``):
    yields (mode, figures), plain first."""
    eugo_on = {"optimizations": [eugo], **SETTINGS}
    modes = {"plain": {"optimizations": []}, "plan": eugo_on,
             "rewrite": {**eugo_on, "eugo.min-speedup": 0}}
    for mode, settings in modes.items():
        yield mode, measure_submission(lambda: build(blocks), settings)


def print_submission(shapes: dict[str, int]) -> None:
    """The scheduler's figures for each graph (name -> blocks per side), a row per mode, printed
    as each is measured."""
    print("\non a scheduler: each graph submitted once per mode, one fresh cluster each (loop: the "
          "scheduler's event loop; blocks: " + ", ".join(f"{n} {b}" for n, b in shapes.items())
          + ")")
    print(f"{'shape':<13} {'mode':<8} {'tasks':>9} {'loop max s':>11} {'blocked s':>10} "
          f"{'update s':>9} {'materialize s':>14} {'RSS GiB':>8} {'blocked/plain':>14} "
          f"{'update/plain':>13} {'RSS/plain':>10}", flush=True)
    for name, blocks in shapes.items():
        build = SCHEDULER_SHAPES[name][0]
        plain: dict = {}
        for mode, r in submission(build, blocks):
            plain = plain or r
            print(f"{name:<13} {mode:<8} {r['tasks']:>9} {r['loop_max_s']:>11.2f} "
                  f"{r['loop_blocked_s']:>10.2f} {r['update_s']:>9.2f} {r['materialize_s']:>14.2f} "
                  f"{r['rss_peak_gib']:>8.2f} "
                  f"{_ratio(r['loop_blocked_s'], plain['loop_blocked_s']):>14} "
                  f"{_ratio(r['update_s'], plain['update_s']):>13} "
                  f"{_ratio(r['rss_peak_gib'], plain['rss_peak_gib']):>10}", flush=True)


def _ratio(value: float, plain: float) -> str:
    return f"{value / plain:.2f}" if plain > 0 else "-"


def print_shapes(shapes: dict, quick: bool) -> None:
    """A row per shape and size (``SHAPES``' entries; quick: the quick size alone)."""
    print(f"{'shape':<10} {'tasks':>9} {'dask s':>8} {'plan s':>8} {'plan/dask':>10} "
          f"{'rewrite s':>10} {'rewrite/dask':>13}", flush=True)
    for name, (build, full, small) in shapes.items():
        for blocks in (small,) if quick else full:
            r = measure(blocks, 2 if quick else 3, build)
            print(f"{name:<10} {r['tasks']:>9} {r['dask']:>8.4f} {r['plan']:>8.4f} "
                  f"{r['plan'] / r['dask']:>10.2f} {r['rewrite']:>10.4f} "
                  f"{r['rewrite'] / r['dask']:>13.2f}", flush=True)


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--only-scheduler", choices=sorted(SCHEDULER_SHAPES), metavar="SHAPE",
                        help="only this graph's scheduler rows (one of: "
                             + ", ".join(SCHEDULER_SHAPES) + ")")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), metavar="SHAPE",
                        help="only this shape's rows (repeatable; one of: " + ", ".join(SHAPES)
                             + ")")
    parser.add_argument("--blocks", type=int,
                        help="with --only-scheduler: blocks per side instead of the mode's size")
    args = _common.parse_args(parser)
    if args.blocks is not None and not args.only_scheduler:
        parser.error("--blocks needs --only-scheduler")
    if args.only_scheduler:
        full, quick = SCHEDULER_SHAPES[args.only_scheduler][1:]
        print_submission({args.only_scheduler: args.blocks or (quick if args.quick else full)})
        return
    if args.shape:
        with dask.config.set(SETTINGS):
            print_shapes({name: SHAPES[name] for name in args.shape}, args.quick)
        return
    # from one chunk (a pass's fixed costs: settings, profile, token) to ~1,070,000 tasks
    sizes = [1, 2, 8, 16] if args.quick else [1, 2, 4, 16, 24, 48, 64, 92]
    print(f"{'tasks':>9} {'dask s':>8} {'plan s':>8} {'plan/dask':>10} {'µs/task':>8} "
          f"{'rewrite s':>10} {'rewrite/dask':>13} {'µs/task':>8}")
    with dask.config.set(SETTINGS):
        for blocks in sizes:
            # small graphs take a millisecond or less: more rounds, for a steady best
            repeat = 100 if blocks <= 4 else 2 if args.quick else 3
            r = measure(blocks, repeat)
            n = r["tasks"]
            print(f"{n:>9} {r['dask']:>8.4f} {r['plan']:>8.4f} {r['plan'] / r['dask']:>10.2f} "
                  f"{1e6 * r['plan'] / n:>8.1f} {r['rewrite']:>10.4f} "
                  f"{r['rewrite'] / r['dask']:>13.2f} {1e6 * r['rewrite'] / n:>8.1f}", flush=True)
        print("\nother shapes of graph")
        print_shapes(SHAPES, args.quick)
    print_submission({name: quick if args.quick else full
                      for name, (_, full, quick) in SCHEDULER_SHAPES.items()})


if __name__ == "__main__":
    main()
