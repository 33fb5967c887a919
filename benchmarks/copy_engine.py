"""The copy engine's host half: staging throughput with 1, 2, 4 and 8 copy threads against one memcpy.

A copy between a GPU and Dask's pageable chunks is a DMA (53-55 GB/s measured on an H200 host)
and a host memcpy through a staging buffer: eugo_dask.devices.copies.HostCopier splits that
memcpy over threads, as CupyDevice runs it for each staging chunk. Both directions are measured
here, on the host alone (no GPU needed; the staging buffer is ordinary memory here, pinned on a
GPU host):

- to device: a pageable chunk copied into a reused staging buffer, one staging chunk at a time;
- back, new result: the staging buffer copied into a new result array (np.empty), which pays
  the first touch of every page, as a result copied back does;
- back, pre-touched: the same into an array written before (a reused or pooled result).

Against: one np.copyto of the whole chunk into pre-touched memory, the memcpy one core does. Each
case is timed side by side with the others, rounds rotated, the median kept; ratios are to the
single memcpy. This machine's figures say what splitting gains on its cores; on a 2-core machine
shared with other work, threads past 2 cannot gain.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import _common
import numpy as np  # after _common: it pins BLAS threads before NumPy loads

from eugo_dask.devices.copies import HostCopier

MiB = 1 << 20
THREADS = (1, 2, 4, 8)


def _staged(copier: HostCopier, src: np.ndarray, staging: np.ndarray) -> None:
    """``src`` through the staging buffer, one staging chunk at a time (to the device)."""
    chunk = staging.size
    for offset in range(0, src.size, chunk):
        size = min(chunk, src.size - offset)
        copier.copy(staging[:size], src[offset:offset + size])


def _unstaged(copier: HostCopier, staging: np.ndarray, dst: np.ndarray) -> None:
    """The staging buffer into ``dst``, one staging chunk at a time (back from the device)."""
    chunk = staging.size
    for offset in range(0, dst.size, chunk):
        size = min(chunk, dst.size - offset)
        copier.copy(dst[offset:offset + size], staging[:size])


def measure(nbytes: int, staging_bytes: int, piece_bytes: int, rounds: int) -> dict[str, float]:
    """Seconds (median of ``rounds``) of every case, measured side by side."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    staging = np.ones(staging_bytes, np.uint8)  # written once: resident, as a pinned buffer is
    touched = np.ones(nbytes, np.uint8)
    copiers = {n: HostCopier(n, piece_bytes) for n in THREADS}
    runs: dict[str, Callable[[], object]] = {"one memcpy": lambda: np.copyto(touched, src)}
    for n, copier in copiers.items():
        runs[f"to device, {n} thread(s)"] = lambda c=copier: _staged(c, src, staging)
        runs[f"back new, {n} thread(s)"] = lambda c=copier: _unstaged(c, staging, np.empty(nbytes, np.uint8))
        runs[f"back touched, {n} thread(s)"] = lambda c=copier: _unstaged(c, staging, touched)
    for fn in runs.values():  # warm: the copy threads started, pages of src and touched resident
        fn()
    return _common.side_by_side(runs, repeat=rounds, summary=statistics.median)


def main(argv: list[str] | None = None) -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--piece", type=int, default=1, help="least MiB per copy thread (eugo.copy-piece)")
    args = _common.parse_args(parser, argv)
    nbytes = (32 if args.quick else 256) * MiB
    staging, rounds = 8 * MiB, 5 if args.quick else 9
    seconds = measure(nbytes, staging, args.piece * MiB, rounds)
    base = seconds["one memcpy"]
    print(f"{nbytes // MiB} MiB chunk, {staging // MiB} MiB staging chunks, pieces >= {args.piece} MiB, "
          f"median of {rounds} rounds side by side")
    print(f"{'case':<28}{'GB/s':>8}{'x one memcpy':>14}")
    print(f"{'one memcpy':<28}{nbytes / base / 1e9:>8.2f}{1.0:>14.2f}")
    for case in ("to device", "back new", "back touched"):
        for n in THREADS:
            s = seconds[f"{case}, {n} thread(s)"]
            print(f"{f'{case}, {n} thread(s)':<28}{nbytes / s / 1e9:>8.2f}{base / s:>14.2f}")


if __name__ == "__main__":
    main()
