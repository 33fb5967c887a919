"""The seed lesson's six workloads, measured: CPU, GPU, transfer, eugo's choice and eugo's time
next to all-CPU and naive all-GPU (every chunk ``map_blocks(cupy.asarray)``).

Each workload is float32, host-resident, one chunk. Without a CUDA device the GPU, transfer and
naive all-GPU columns say "not measured" (never invented) and eugo runs on the emulated device,
which shows its choice, its overhead and that the result matches, not GPU speed.

    python benchmarks/seed_table.py                       # the seed's sizes (needs ~12 GB RAM)
    python benchmarks/seed_table.py --medium              # 1/8 of the big sizes (the GPU check)
    python benchmarks/seed_table.py --quick               # 1/64 of the big sizes (CI)
    python benchmarks/seed_table.py --plot seed_table.png --profile eugo-profile.yaml
"""

from __future__ import annotations

from pathlib import Path

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask
from eugo_dask.runtime import get_device

M = 2**20
#: (label, kind, size at full scale, size with --medium (1/8 of the elements), with --quick)
ROWS = [
    ("Matmul {n}²", "matmul", 8192, 2896, 1024),
    ("Elementwise {n}", "elementwise", 512 * M, 64 * M, 8 * M),
    ("FFT {n}²", "fft", 4096, 1448, 512),
    ("Sum {n}", "sum", 512 * M, 64 * M, 8 * M),
    ("Matmul {n}²", "matmul", 256, 256, 256),
    ("Elementwise {n}", "elementwise", 10_000, 10_000, 10_000),
]


def gauss_sine(x):
    """The elementwise transform: two transcendentals per element (exp and sin)."""
    return np.exp(-x * x) * np.sin(x)


def make_inputs(kind: str, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (n, n) if kind in ("matmul", "fft") else (n,)
    count = 2 if kind == "matmul" else 1
    return [rng.random(shape, dtype=np.float32) for _ in range(count)]


def apply(kind: str, arrays: list, xp=np):
    """The workload on NumPy, CuPy or Dask arrays."""
    if kind == "matmul":
        return arrays[0] @ arrays[1]
    if kind == "elementwise":
        return gauss_sine(arrays[0])
    if kind == "fft":
        return (da.fft if xp is da else xp.fft).fft2(arrays[0])
    return arrays[0].sum()


def label(text: str, n: int) -> str:
    size = f"{n // M}M" if n >= M and n % M == 0 else f"{n // 1000}K" if n >= 1000 and n % 1000 == 0 else str(n)
    return text.format(n=size)


def measure_row(text: str, kind: str, n: int, profile) -> dict:
    arrays = make_inputs(kind, n)
    row = {"workload": label(text, n)}

    def build(hook=lambda a: a):
        return apply(kind, [hook(da.from_array(a, chunks=a.shape, name=f"in{i}"))
                            for i, a in enumerate(arrays)], xp=da)

    with dask.config.set(_common.eugo_settings(profile)):
        plan = eugo_dask.explain(build())
    main = max(plan, key=lambda d: d.cpu_s)
    row["choice"] = main.device
    row["reason"] = main.reason
    expected = _common.compute_plain(build)
    eugo_dask.reset_device_stats()
    result = _common.compute_eugo(build, profile)
    _common.check_same_result(result, expected)
    runs = {"cpu": lambda: apply(kind, arrays),
            "all_cpu": lambda: _common.compute_plain(build),
            "eugo": lambda: _common.compute_eugo(build, profile)}
    if _common.has_gpu():
        import cupy

        sync = cupy.cuda.Device().synchronize
        on_device = [cupy.asarray(a) for a in arrays]

        def gpu_compute():
            apply(kind, on_device, xp=cupy)
            sync()

        def transfer():
            moved = [cupy.asarray(a) for a in arrays]
            cupy.asnumpy(apply(kind, moved, xp=cupy))
            sync()

        gpu_compute()
        runs.update(gpu=gpu_compute, with_transfer=transfer, naive_gpu=lambda: _common.naive_all_gpu(build))
    row.update(_common.side_by_side(runs))
    if _common.has_gpu():
        row["transfer"] = max(row.pop("with_transfer") - row["gpu"], 0.0)
    else:
        row["gpu"] = row["transfer"] = row["naive_gpu"] = _common.NOT_MEASURED
    return row


COLUMNS = [("workload", "Workload"), ("cpu", "CPU"), ("gpu", "GPU"), ("transfer", "Transfer"),
           ("choice", "eugo"), ("eugo", "eugo time"), ("all_cpu", "all-CPU"),
           ("naive_gpu", "naive all-GPU")]


def print_table(rows: list[dict], device: str) -> None:
    widths = [max(len(title), *(len(_common.fmt(r[k])) for r in rows)) for k, title in COLUMNS]
    print(f"eugo ran on: {device}")
    print("  ".join(title.ljust(w) for (_, title), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(_common.fmt(r[k]).ljust(w) for (k, _), w in zip(COLUMNS, widths)))
    print()
    for r in rows:
        print(f"{r['workload']}: {r['reason']}")


def plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("cpu", "CPU (NumPy)"), ("all_cpu", "all-CPU (Dask)"), ("eugo", f"eugo ({device})"),
              ("naive_gpu", "naive all-GPU"), ("gpu", "GPU compute")]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        xs = [j + i * width for j, r in enumerate(rows) if not isinstance(r[key], str)]
        ys = [r[key] for r in rows if not isinstance(r[key], str)]
        if ys:
            ax.bar(xs, ys, width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['workload']}\neugo: {r['choice'].upper()}" for r in rows])
    ax.set_title("The seed's six workloads, measured here (columns not measured are left out)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--medium", action="store_true", help="1/8 of the big sizes")
    parser.add_argument("--profile", default="h200",
                        help="eugo.profile for eugo's choices (default: h200 + this CPU)")
    parser.add_argument("--plot", type=Path, default=Path("seed_table.png"))
    args = _common.parse_args(parser)
    device = "cupy" if _common.has_gpu() else "emulated device"
    # the table shows steady state: the device is started first (in a fresh process a
    # calibrated profile's first-use costs keep a graph on the CPU that does not repay them)
    get_device(_common.eugo_settings(args.profile)["eugo.device"])
    rows = [measure_row(text, kind, quick if args.quick else medium if args.medium else full, args.profile)
            for text, kind, full, medium, quick in ROWS]
    print_table(rows, device)
    plot(rows, args.plot, device)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
