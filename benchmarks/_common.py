"""Shared by the benchmarks: one command line, BLAS threads pinned, timing, the devices available
here, and the naive all-GPU baseline.

Every benchmark takes ``--quick`` (small sizes: a few seconds, at most about 30 s on a 2-core
machine; what the tests run); without it, the real sizes.

Import this module before anything that imports NumPy (``import _common`` sorts first among the
third-party imports). It pins BLAS to one thread per process through ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS``, which a BLAS library reads once, when it loads:
the setting distributed's nanny gives every worker (``distributed.nanny.pre-spawn-environ``).
Without it each of Dask's threads runs a BLAS that starts a thread per core, and on 2 cores
that oversubscription made one on/off comparison read 2.7x where reruns read 1.02x. A variable
already set in the environment is kept. :func:`parse_args` prints which BLAS ran and with how
many threads, so every result says what it measured.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

if "numpy" in sys.modules:
    raise RuntimeError("import _common before NumPy (and Dask): it pins BLAS threads through the "
                       "environment, which BLAS reads once, when NumPy loads it")
for _variable in BLAS_THREAD_VARIABLES:
    os.environ.setdefault(_variable, "1")

import dask  # noqa: E402
import numpy as np  # noqa: E402

import eugo_dask  # noqa: E402
from eugo_dask.devices import cupy_device_count  # noqa: E402

NOT_MEASURED = "not measured"
QUICK_HELP = "small sizes: seconds, at most ~30 s on 2 cores (what the tests run)"


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The benchmarks' common command line: the docstring's first line, and ``--quick``."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line, then print the mode and the BLAS that runs."""
    args = parser.parse_args(argv)
    print(f"mode: {'quick' if args.quick else 'full'}; {describe_blas()}", flush=True)
    return args


def _loaded_libraries(fragment: str) -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux: the environment variables are what we can report
        return []
    return sorted(p for p in paths if fragment in os.path.basename(p).lower())


def _openblas_call(name: str) -> Any:
    """Call an OpenBLAS query (``get_num_threads``, ``get_corename``) in the loaded library,
    whatever prefix and suffix its build gave the symbols (NumPy's wheels: ``scipy_…64_``)."""
    for path in _loaded_libraries("openblas"):
        library = ctypes.CDLL(path)
        for symbol in (f"openblas_{name}", f"scipy_openblas_{name}64_", f"openblas_{name}64_"):
            function = getattr(library, symbol, None)
            if function is not None:
                if name == "get_corename":
                    function.restype = ctypes.c_char_p
                    return function().decode()
                return function()
    return None


def describe_blas() -> str:
    """Which BLAS NumPy runs, with how many threads (asked of OpenBLAS itself where it is the
    one), and Dask's thread count."""
    from dask.system import CPU_COUNT

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except (TypeError, KeyError):
        name = "unknown BLAS"
    threads = _openblas_call("get_num_threads")
    pinned = ", ".join(f"{v}={os.environ[v]}" for v in BLAS_THREAD_VARIABLES)
    text = (f"BLAS: {name}, {threads if threads is not None else '? (not OpenBLAS)'} thread(s) "
            f"({pinned})")
    core = _openblas_call("get_corename")
    if core:
        text += f", kernel {core}"
    if os.environ.get("OPENBLAS_CORETYPE"):
        text += (f" forced by OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} (this machine's "
                 "setting; unset it and OPENBLAS_L2_SIZE in the command for NumPy's own choice)")
    return f"{text}; Dask threads: {CPU_COUNT}"


def best_of(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` calls (after none: the first call counts, as users pay it)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def side_by_side(runs: dict[str, Callable[[], Any]], *, repeat: int = 3,
                 summary: Callable[[list[float]], float] = min) -> dict[str, float]:
    """Wall times of the ``runs`` measured side by side: ``repeat`` rounds, each timing every run
    once, the order rotated from round to round so that all see the same machine noise and none
    always goes first; ``summary`` (best by default, or ``statistics.median``) of each's times."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            gc.collect()
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: summary(samples) for name, samples in times.items()}


def has_gpu() -> bool:
    return bool(cupy_device_count())


def eugo_settings(profile: Any) -> dict[str, Any]:
    """eugo on, for the device this machine has: CuPy with a GPU, else the emulated device."""
    return {"optimizations": [eugo_dask.eugo], "eugo.device": "cupy" if has_gpu() else "emulated",
            "eugo.profile": profile}


def emulated_cluster(extra: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The workers of the benchmarks on a cluster of separate processes (a GPU worker: ``GPU=1``,
    the emulated device, 2 threads and the arguments ``extra``; two one-thread CPU workers), and
    the settings eugo runs there with: the emulated device, every task that can run there does
    (min-speedup 0), the H200 profile."""
    from eugo_dask.testing import H200_SERVER

    workers = {"gpu": {"gpu": True, "nthreads": 2, "extra": extra}, "cpu-0": {}, "cpu-1": {}}
    return workers, {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
                     "eugo.min-speedup": 0, "eugo.profile": H200_SERVER}


def compute_plain(build: Callable[[], Any]) -> Any:
    with dask.config.set(optimizations=[]):
        return build().compute(scheduler="threads")


def compute_eugo(build: Callable[[], Any], profile: Any) -> Any:
    with dask.config.set(eugo_settings(profile)):
        return build().compute(scheduler="threads")


def naive_all_gpu(build_on: Callable[[Callable[[Any], Any]], Any]) -> Any:
    """What users write by hand today: every chunk ``map_blocks(cupy.asarray)``, the pipeline on
    CuPy, and ``cupy.asnumpy`` at the end. Needs CuPy and a GPU."""
    import cupy

    with dask.config.set(optimizations=[]):
        x = build_on(lambda a: a.map_blocks(cupy.asarray))
        return x.map_blocks(cupy.asnumpy).compute(scheduler="threads")


def check_same_result(result: Any, expected: Any) -> None:
    """eugo's result against plain Dask's: same type, shape and dtype, non-finite values in the
    same places, and the finite values equal up to the rounding that a different device's
    kernels may do. Device kernels sum, contract and transform in another order than NumPy's
    (cuFFT, cuBLAS, CUB's tree reductions), so elementwise tolerances fail on single-precision
    FFTs whose large components swamp small ones; the check is normwise, computed in double
    precision: ``|result - expected| <= tol |expected|``, ``tol = min(1000 eps, 1e-2)`` in the
    result's precision (about 1.2e-4 for float32, 2.2e-13 for float64, 1e-2 for float16)."""
    assert type(result) is type(expected), (type(result), type(expected))
    result, expected = np.asarray(result), np.asarray(expected)
    assert result.shape == expected.shape and result.dtype == expected.dtype, (
        result.shape, result.dtype, expected.shape, expected.dtype)
    if expected.dtype.kind not in "fc":
        np.testing.assert_array_equal(result, expected)
        return
    finite = np.isfinite(expected)
    # NaN and infinities where the other path has them (assert_array_equal: NaN equals NaN)
    np.testing.assert_array_equal(np.isfinite(result), finite)
    np.testing.assert_array_equal(result[~finite], expected[~finite])
    wide = np.complex128 if expected.dtype.kind == "c" else np.float64
    got, want = result[finite].astype(wide), expected[finite].astype(wide)
    tol = min(1000 * float(np.finfo(expected.dtype).eps), 1e-2)
    error, scale = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    assert error <= tol * scale, f"normwise relative error {error / (scale or 1):.3g} over {tol:.3g}"


def fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


__all__ = ["NOT_MEASURED", "benchmark_parser", "best_of", "check_same_result", "compute_eugo", "compute_plain",
           "describe_blas", "eugo_settings", "fmt", "has_gpu", "naive_all_gpu", "np", "parse_args",
           "side_by_side"]
