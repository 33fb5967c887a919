"""Joint vs separate plans: several outputs computed together (``dask.compute(*outputs)``)
against each computed alone, at the default min-speedup and at 0: tasks on the device, copies
to the device and back and their bytes, as planned (``explain(*outputs)``) and as counted while
running (``device_stats()``, threaded scheduler; CuPy with a GPU, else the emulated device).

(a) arrays: one 4096² float32 array in 1024² chunks and six outputs of it: ``(x @ x.T).mean()``,
    ``exp(x).sum(axis=0)``, ``x.std()``, ``x[::2].T + 1``, ``concatenate([x, 2x]).sum()``, an
    anomaly (the mean of four row blocks subtracted from each);
(b) climate: a 730x180x360 float32 daily field (189 MB) in 73-day chunks and six xarray-style
    outputs: a day-of-year climatology, the anomalies' spread, annual and zonal means, a
    transcendental mean, and a per-pixel maximum over a rechunked (time-series) layout.

A joint compute should move no more bytes than the separate ones together (it shares what they
share); the last column is joint / separate.

    python benchmarks/joint_plans.py           # the sizes above
    python benchmarks/joint_plans.py --quick   # 2048² arrays in 512² chunks; a 146x90x180 field
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask


def arrays(n: int, chunk: int) -> dict[str, Any]:
    x = da.random.default_rng(0).random((n, n), chunks=chunk, dtype=np.float32)
    blocks = x.reshape(4, n // 4, n)
    return {
        "matmul mean": (x @ x.T).mean(),
        "exp column sums": np.exp(x).sum(axis=0),
        "std": x.std(),
        "strided transpose": x[::2].T + 1,
        "concatenate sum": da.concatenate([x, x * 2]).sum(),
        "anomaly": (blocks - blocks.mean(axis=0)).reshape(n, n),
    }


def climate(days: int, lat: int, lon: int) -> dict[str, Any]:
    field = da.random.default_rng(1).random((days, lat, lon), chunks=(days // 10, lat, lon),
                                            dtype=np.float32)
    years = field.reshape(2, days // 2, lat, lon)
    climatology = years.mean(axis=0)
    return {
        "climatology": climatology,
        "anomaly spread": (years - climatology).std(axis=(0, 1)),
        "annual means": years.mean(axis=(1, 3)),
        "zonal means": field.mean(axis=2),
        "exp mean": np.exp(field - 1).mean(axis=0),
        "series maximum": field.rechunk((days, lat // 6, lon // 6)).max(axis=0),
    }


#: planned and counted: tasks on the device, copies to it (count, bytes), back (count, bytes)
Figures = np.ndarray


def planned(outputs: list[Any]) -> Figures:
    plan = eugo_dask.explain(*outputs)
    c = plan.copies
    return np.array([len(plan.gpu_keys), c.to_device, c.to_device_bytes, c.to_host,
                     c.to_host_bytes], dtype=float)


def counted(outputs: list[Any]) -> Figures:
    eugo_dask.reset_device_stats()
    with dask.config.set(optimizations=[eugo_dask.eugo]):
        dask.compute(*outputs, scheduler="threads")
    s = eugo_dask.device_stats()
    return np.array([s["tasks"], s["h2d_count"], s["h2d_bytes"], s["d2h_count"], s["d2h_bytes"]],
                    dtype=float)


def row(label: str, figures: Figures) -> str:
    tasks, h2d, h2d_bytes, d2h, d2h_bytes = figures
    return (f"{label:<9} {tasks:>6.0f} {h2d:>6.0f} {h2d_bytes / 1e6:>9.1f} {d2h:>6.0f} "
            f"{d2h_bytes / 1e6:>9.1f}")


def compare(name: str, outputs: dict[str, Any], min_speedup: float,
            measure: Callable[[list[Any]], Figures]) -> tuple[Figures, Figures]:
    separate = sum((measure([o]) for o in outputs.values()), np.zeros(5))
    joint = measure(list(outputs.values()))
    together, apart = joint[2] + joint[4], separate[2] + separate[4]
    moved = together / apart if apart else (1.0 if not together else float("inf"))
    print(f"{name:<10} {min_speedup:>3g}  {row('separate', separate)}")
    print(f"{'':<10} {'':>3}  {row('joint', joint)}  {moved:>6.2f}")
    return separate, joint


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--profile", default="h200",
                        help="eugo.profile (default: the H200 preset beside this machine's CPU)")
    args = _common.parse_args(parser)
    workloads = {"(a) arrays": arrays(2048, 512) if args.quick else arrays(4096, 1024),
                 "(b) climate": climate(146, 90, 180) if args.quick else climate(730, 180, 360)}
    device = "cupy" if _common.has_gpu() else "emulated"
    print(f"device: {device}; profile: {args.profile}")
    header = (f"{'workload':<10} {'min':>3}  {'':<9} {'GPU':>6} {'H2D':>6} {'H2D MB':>9} "
              f"{'D2H':>6} {'D2H MB':>9}  joint/separate bytes")
    for title, measure in (("planned (explain)", planned), ("counted (device_stats)", counted)):
        print(f"\n{title}\n{header}")
        for name, outputs in workloads.items():
            for min_speedup in (2, 0):
                with dask.config.set({"eugo.device": device, "eugo.profile": args.profile,
                                      "eugo.min-speedup": min_speedup}):
                    compare(name.split()[1], outputs, min_speedup, measure)


if __name__ == "__main__":
    main()
