"""End-to-end cost of having eugo enabled on a CPU-only machine.

With ``eugo.device: auto`` and no CUDA device the pass leaves every graph unchanged; what is left
is the bridge's own work (reading settings, chunk shapes). This times the same computations with
``optimizations=[eugo]`` and with it off, interleaved, many times, and prints the ratio of the
medians (goal <= 1.02).

    python benchmarks/enabled_overhead.py           # 2048² arrays, 15 rounds
    python benchmarks/enabled_overhead.py --quick   # 512² arrays, 5 rounds
"""

from __future__ import annotations

import statistics
from functools import partial

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask


def workloads(scale: int):
    rng = da.random.default_rng(0)
    a = rng.random((scale, scale), chunks=scale // 4)
    return {
        "matmul+sum": lambda: (a @ a.T + 1).sum(),
        "elementwise": lambda: np.exp(np.sin(a) * 2).mean(axis=0),
        "many small chunks": lambda: (rng.random((scale, scale), chunks=scale // 32) + 1).sum(),
    }


def compute(build, enabled: bool) -> None:
    with dask.config.set({"optimizations": [eugo_dask.eugo] if enabled else []}):
        build().compute(scheduler="threads")


def main() -> None:
    args = _common.parse_args(_common.benchmark_parser(__doc__))
    scale, rounds = (512, 5) if args.quick else (2048, 15)
    assert eugo_dask.read_settings().resolved().device == "none", "run this on a CPU-only machine"
    print(f"{'workload':<20} {'off s':>8} {'on s':>8} {'on/off':>7}")
    ratios = []
    for name, build in workloads(scale).items():
        compute(build, True), compute(build, False)  # warm-up (imports, CPU profile)
        seconds = _common.side_by_side({"off": partial(compute, build, False),
                                        "on": partial(compute, build, True)},
                                       repeat=rounds, summary=statistics.median)
        ratio = seconds["on"] / seconds["off"]
        ratios.append(ratio)
        print(f"{name:<20} {seconds['off']:>8.3f} {seconds['on']:>8.3f} {ratio:>7.3f}")
    print(f"geometric mean on/off: {float(np.exp(np.mean(np.log(ratios)))):.3f}")


if __name__ == "__main__":
    main()
