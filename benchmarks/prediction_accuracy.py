"""How well a calibrated profile predicts CPU time on chunk sizes calibration did not use.

Calibrates this machine (``eugo-dask calibrate``, quick with ``--quick``) or loads a profile
(``--profile PATH``), then for each op family times real NumPy calls on sizes outside the
calibration's lists and compares them with the cost model's prediction for the same op. Prints
every case and the median absolute percentage error per family (goal <= 25%). Calibration and
measurements run in this process with the same BLAS threads.

    python benchmarks/prediction_accuracy.py                   # full calibration, best of 15
    python benchmarks/prediction_accuracy.py --quick           # quick calibration, best of 5
    python benchmarks/prediction_accuracy.py --profile p.yaml  # a profile calibrated before
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import _common
import numpy as np

from eugo_dask import load_profile
from eugo_dask.calibrate import calibrate
from eugo_dask.cost_model import Op, Step, estimate_task
from eugo_dask.graph import ArraySpec
from eugo_dask.measure import FULL_SIZES, QUICK_SIZES, best_seconds

RNG = np.random.default_rng(1)


def cases():
    """(family, label, op, inputs, out, fn) on sizes calibration never measured."""
    for dtype in ("float32", "float64"):
        for n in (96, 192, 384, 768, 1536):
            a = RNG.random((n, n)).astype(dtype)
            spec = ArraySpec((n, n), np.dtype(dtype))
            yield ("matmul", f"matmul {n}² {dtype}", Op("matmul", "matmul", 2), [spec, spec], spec,
                   partial(np.matmul, a, a))
    for name, nin in (("add", 2), ("multiply", 2), ("divide", 2), ("sqrt", 1), ("exp", 1), ("sin", 1), ("power", 2)):
        ufunc = getattr(np, name)
        for n in (300_000, 3_000_000):
            x, y = RNG.random(n) + 0.5, RNG.random(n) + 0.5
            spec = ArraySpec((n,), x.dtype)
            args = (x, y) if nin == 2 else (x,)
            yield "elementwise", f"{name} {n:,}", Op("elementwise", name, nin), [spec] * nin, spec, \
                lambda ufunc=ufunc, args=args: ufunc(*args)
    for n in (3 << 11, 1 << 13, 1 << 15, 1 << 17, 1 << 19):
        z = (RNG.random(n) + 1j * RNG.random(n)).astype(np.complex128)
        spec = ArraySpec((n,), z.dtype)
        yield "fft", f"fft {n:,}", Op("fft", "fft"), [spec], spec, lambda z=z: np.fft.fft(z)
    for n in (300_000, 3_000_000, 12_000_000):
        x = RNG.random(n)
        yield "reduction", f"sum {n:,}", Op("reduction", "sum"), [ArraySpec((n,), x.dtype)], \
            ArraySpec((1,), x.dtype), lambda x=x: x.sum()


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--profile", help="a calibrated profile (default: calibrate this machine now)")
    args = _common.parse_args(parser)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        profile = load_profile(calibrate(quick=args.quick,
                                         progress=lambda m: print(f"  {m}", file=sys.stderr)))
    repeat = 5 if args.quick else 15
    used = {family: {n for sizes in (QUICK_SIZES, FULL_SIZES) for n in sizes[family]}
            for family in QUICK_SIZES}
    errors: dict[str, list[float]] = {}
    print(f"{'case':<26} {'measured':>10} {'predicted':>10} {'error':>8}")
    for family, label, op, inputs, out, fn in cases():
        size = out.size if family != "reduction" else inputs[0].size
        assert (int(round(size ** 0.5)) if family == "matmul" else size) not in used[family], label
        measured = best_seconds(fn, repeat=repeat)
        estimate = estimate_task([Step(op, tuple(inputs), out)], inputs, out, profile)
        predicted = estimate.cpu_s - profile.cpu.task_overhead_s  # a raw call, no Dask dispatch
        error = abs(predicted - measured) / measured
        errors.setdefault(family, []).append(error)
        print(f"{label:<26} {measured * 1e3:>8.3f}ms {predicted * 1e3:>8.3f}ms {100 * error:>7.1f}%")
    print()
    print("median absolute percentage error per family (goal <= 25%):")
    for family, errs in errors.items():
        print(f"  {family:<12} {100 * statistics.median(errs):6.1f}%   (n={len(errs)})")


if __name__ == "__main__":
    main()
