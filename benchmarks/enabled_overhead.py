"""End-to-end cost of having eugo enabled on a CPU-only machine.

With ``eugo.device: auto`` and no CUDA device the pass leaves every graph unchanged; what is left
is the bridge's own work (reading settings, chunk shapes). This times the same computations with
``optimizations=[eugo]`` and with it off, interleaved, many times, and prints the ratio of the
medians (goal <= 1.02).

    python benchmarks/enabled_overhead.py           # full
    python benchmarks/enabled_overhead.py --quick   # CI
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def timed(build, enabled: bool) -> float:
    settings = {"optimizations": [eugo_dask.eugo] if enabled else []}
    with dask.config.set(settings):
        start = time.perf_counter()
        build().compute(scheduler="threads")
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    scale, rounds = (512, 5) if args.quick else (2048, 15)
    assert eugo_dask.read_settings().resolved().device == "none", "run this on a CPU-only machine"
    print(f"{'workload':<20} {'off s':>8} {'on s':>8} {'on/off':>7}")
    ratios = []
    for name, build in workloads(scale).items():
        timed(build, True), timed(build, False)  # warm-up (imports, CPU profile)
        off, on = [], []
        for i in range(rounds):  # interleaved, alternating which goes first
            for enabled in ((True, False) if i % 2 else (False, True)):
                (on if enabled else off).append(timed(build, enabled))
        ratio = statistics.median(on) / statistics.median(off)
        ratios.append(ratio)
        print(f"{name:<20} {statistics.median(off):>8.3f} {statistics.median(on):>8.3f} {ratio:>7.3f}")
    print(f"geometric mean on/off: {float(np.exp(np.mean(np.log(ratios)))):.3f}")


if __name__ == "__main__":
    main()
