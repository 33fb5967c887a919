"""Pipelines that mix work eugo offloads with work it keeps on the CPU, measured side by side:
all-CPU, eugo (CuPy with a GPU, else the emulated device) and naive all-GPU (CuPy only).

(a) a zarr store -> elementwise -> matmul -> reduction;
(b) an FFT low-pass filter over a 2-D field;
(c) many small chunks (where eugo should offload nothing and cost nothing).

    python benchmarks/mixed_pipelines.py           # 2048² and 1024² arrays
    python benchmarks/mixed_pipelines.py --quick   # 512² and 256² arrays
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import _common
import dask
import dask.array as da
import numpy as np

import eugo_dask


def zarr_pipeline(store: Path, n: int, chunk: int):
    import zarr

    z = zarr.open_array(str(store), mode="w", shape=(n, n), chunks=(chunk, chunk), dtype="f4")
    z[:] = np.random.default_rng(0).random((n, n), dtype=np.float32)

    def build(hook=lambda a: a):
        a = hook(da.from_zarr(str(store)))
        w = np.tanh(a * 2 - 1)
        return (w @ w.T).mean(axis=0)

    return build


def fft_filter(n: int, chunk: int):
    field = np.random.default_rng(1).random((n, n), dtype=np.float32)
    k = np.fft.fftfreq(n)[:, None] ** 2 + np.fft.fftfreq(n)[None, :] ** 2
    low_pass = (k < 0.01).astype(np.complex64)

    def build(hook=lambda a: a):
        x = hook(da.from_array(field, chunks=(chunk, n), name="field"))
        spectrum = da.fft.fft2(x.rechunk((n, n)))
        return da.fft.ifft2(spectrum * hook(da.from_array(low_pass, chunks=(n, n), name="lp"))).real

    return build


def small_chunks(n: int):
    data = np.random.default_rng(2).random((n, n))

    def build(hook=lambda a: a):
        return (hook(da.from_array(data, chunks=32, name="small")) + 1).sum(axis=0)

    return build


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--profile", default="h200", help="eugo.profile for eugo's choices")
    args = _common.parse_args(parser)
    scale = 1 if args.quick else 4
    with tempfile.TemporaryDirectory() as tmp:
        pipelines = {
            "(a) zarr > elementwise > matmul > mean": zarr_pipeline(Path(tmp) / "a.zarr", 512 * scale, 256 * scale),
            "(b) FFT low-pass filter": fft_filter(512 * scale, 128 * scale),
            "(c) many small chunks": small_chunks(256 * scale),
        }
        device = "cupy" if _common.has_gpu() else "emulated device"
        print(f"eugo ran on: {device}; profile for its choices: {args.profile}")
        print(f"{'pipeline':<40} {'tasks on GPU':>13} {'all-CPU':>10} {'eugo':>10} {'eugo/CPU':>9} "
              f"{'naive all-GPU':>14}  copies to / from device")
        for name, build in pipelines.items():
            with dask.config.set({"eugo.profile": args.profile}):
                plan = eugo_dask.explain(build(), device="emulated")
            expected = _common.compute_plain(build)
            eugo_dask.reset_device_stats()
            result = _common.compute_eugo(build, args.profile)
            _common.check_same_result(result, expected)
            stats = eugo_dask.device_stats()
            runs = {"cpu": partial(_common.compute_plain, build),
                    "eugo": partial(_common.compute_eugo, build, args.profile)}
            if _common.has_gpu():
                runs["naive"] = partial(_common.naive_all_gpu, build)
            seconds = _common.side_by_side(runs)
            cpu_s, eugo_s = seconds["cpu"], seconds["eugo"]
            naive = seconds.get("naive", _common.NOT_MEASURED)
            print(f"{name:<40} {len(plan.gpu_keys):>5} of {len(plan):<5} {_common.fmt(cpu_s):>10} "
                  f"{_common.fmt(eugo_s):>10} {eugo_s / cpu_s:>9.2f} {_common.fmt(naive):>14}  "
                  f"{stats['h2d_bytes'] / 1e6:.1f} MB / {stats['d2h_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
