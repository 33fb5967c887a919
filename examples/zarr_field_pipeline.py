"""A real-world-shaped pipeline: a 2-D field stored in zarr is low-pass filtered with FFTs,
projected onto a basis with a matmul, and reduced to per-mode energies.

    python examples/zarr_field_pipeline.py           # 8192² field
    python examples/zarr_field_pipeline.py --quick   # 1024² field

Reads stay on the CPU (I/O), the FFTs and the projection go to the GPU where the plan says they
pay, the reduction of device-resident data runs there and ships back a few bytes. Runs on the
emulated device without a GPU and checks the result against plain Dask.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import zarr

import eugo_dask


def build(store: Path, n: int, modes: int):
    field = da.from_zarr(str(store))
    k2 = np.fft.fftfreq(n)[:, None] ** 2 + np.fft.fftfreq(n)[None, :] ** 2
    low_pass = da.from_array((k2 < 0.02).astype(np.complex64), chunks=(n, n), name="low-pass")
    smooth = da.fft.ifft2(da.fft.fft2(field.rechunk((n, n))) * low_pass).real.astype(np.float32)
    basis = da.random.default_rng(0).standard_normal((n, modes), chunks=(n, modes), dtype=np.float32)
    projected = smooth.rechunk((n // 4, n)) @ basis
    return (projected ** 2).sum(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, modes = (1024, 64) if args.quick else (8192, 256)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "field.zarr"
        z = zarr.open_array(str(store), mode="w", shape=(n, n), chunks=(n // 4, n), dtype="f4")
        z[:] = np.random.default_rng(1).random((n, n), dtype=np.float32)
        energies = build(store, n, modes)
        with dask.config.set({"eugo.device": "emulated", "eugo.profile": "h200"}):
            print(eugo_dask.explain(energies))
            eugo_dask.reset_device_stats()
            with dask.config.set(optimizations=[eugo_dask.eugo]):
                result = energies.compute()
        expected = energies.compute()
        np.testing.assert_allclose(result, expected, rtol=1e-4)
        stats = eugo_dask.device_stats()
        print(f"device: {stats['tasks']} tasks; {stats['h2d_bytes'] / 1e6:.1f} MB in, "
              f"{stats['d2h_bytes'] / 1e6:.3f} MB out; results match plain Dask")


if __name__ == "__main__":
    main()
