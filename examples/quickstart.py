"""Quickstart: see what eugo would put on a GPU, then run it (on a CPU-only machine too).

    python examples/quickstart.py            # 8192² arrays
    python examples/quickstart.py --quick    # 4096² arrays (what the tests run)

1. ``eugo_dask.explain`` prints the placement of every task, grouped by task prefix, with the
   estimates and a reason for each: matmul goes to the GPU, the cheap reduction over host data
   stays on the CPU, aggregation always does.
2. The same computation runs with ``optimizations=[eugo]`` on the *emulated* device (NumPy
   arrays of their own type, every transfer counted), and the result is compared with plain Dask.

The plan is priced with fixed figures, an H200 beside the ``server-x86`` CPU preset, so it prints
the same on every machine (the README shows it verbatim and a test keeps it so). For plans priced
for your own CPU, drop ``"cpu"`` from the profile (it is then measured) or calibrate with
``eugo-dask calibrate``; on a machine with CuPy and a GPU, drop ``eugo.device`` (``auto`` finds it).
"""

from __future__ import annotations

import argparse

import dask
import dask.array as da
import numpy as np

import eugo_dask
from eugo_dask import eugo

#: An H200 beside a reference server CPU (presets): no figure measured on this machine.
PROFILE = {"base": "h200", "cpu": "server-x86"}


def pipeline(n: int, chunk: int):
    rng = da.random.default_rng(42)
    a = rng.random((n, n), chunks=chunk, dtype=np.float32)
    b = rng.random((n, n), chunks=chunk, dtype=np.float32)
    field = np.sin(np.exp(-(a @ b) / n))  # matmul, then an elementwise transform
    return field, field.mean(axis=0), a.sum()  # ... a reduction of it, and one over host data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small arrays")
    args = parser.parse_args()
    n, chunk = (4096, 2048) if args.quick else (8192, 4096)

    field, profile_mean, host_sum = pipeline(n, chunk)
    settings = {"eugo.device": "emulated", "eugo.profile": PROFILE}
    print(f"planned for eugo.profile {PROFILE} (fixed figures: the same plan on every machine)")
    print()
    with dask.config.set(settings):
        print(eugo_dask.explain(profile_mean))
        print()
        print(eugo_dask.explain(host_sum))
        print()
        expected = dask.compute(profile_mean, host_sum)
        eugo_dask.reset_device_stats()
        with dask.config.set(optimizations=[eugo]):
            result = dask.compute(profile_mean, host_sum)
    stats = eugo_dask.device_stats()
    print(f"device: {stats['tasks']} tasks, {stats['h2d_count']} copies to the device "
          f"({stats['h2d_bytes'] / 1e6:.1f} MB), {stats['d2h_count']} back "
          f"({stats['d2h_bytes'] / 1e6:.3f} MB), {stats['fallbacks']} fallbacks")
    for got, want in zip(result, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert type(got) is type(want)
    print("results identical to plain Dask:", all(np.array_equal(g, w) for g, w in zip(result, expected)))


if __name__ == "__main__":
    main()
