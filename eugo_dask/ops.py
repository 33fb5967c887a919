"""Op families: what a chunk function does, and which dtypes a device can hold.

Every function in a task is put in one family (:data:`Family`): matmul-like contractions,
elementwise ufuncs, FFTs, reductions (their chunk step), data movement (views and copies),
aggregation of partial results, creation (ones, random, arange), I/O getters, embedded data, or
unknown. The cost model prices each family its own way; the planner keeps aggregation, I/O,
creation and unknown functions on the host. Ufuncs carry a weight in flop-equivalents per element
(:data:`UFUNC_WEIGHTS`) and a class that calibration times (:data:`UFUNC_CLASS`).

This module imports nothing of eugo's: every other module builds on it.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Final, Literal

import numpy as np

#: Where a task runs.
Placement = Literal["cpu", "gpu"]
CPU: Final = "cpu"
GPU: Final = "gpu"

#: dtype kinds a device can hold: bool, ints, unsigned, floats, complex.
DEVICE_DTYPE_KINDS = frozenset("biufc")


def device_dtype_ok(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can live on a device (no object, string, structured,
    datetime, extended-precision or byte-swapped data)."""
    dtype = np.dtype(dtype)
    # non-native byte order: CuPy would reinterpret the bytes rather than convert them
    return (dtype.kind in DEVICE_DTYPE_KINDS and dtype.isnative and dtype.itemsize <= 16
            and dtype != np.longdouble)


#: Reductions whose result keeps the chunk's shape.
CUMULATIVE = frozenset("cumsum cumprod nancumsum nancumprod".split())

#: Cost of one element of a ufunc, in flop-equivalents (add = 1).
UFUNC_WEIGHTS: dict[str, float] = {
    **dict.fromkeys(
        "add subtract multiply negative positive absolute fabs maximum minimum fmax fmin "
        "equal not_equal less less_equal greater greater_equal logical_and logical_or "
        "logical_xor logical_not bitwise_and bitwise_or bitwise_xor invert left_shift "
        "right_shift sign square conjugate copysign rint floor ceil trunc isnan isinf isfinite "
        "signbit where clip heaviside nextafter spacing astype".split(),
        1.0,
    ),
    **dict.fromkeys(
        "divide true_divide reciprocal floor_divide remainder mod fmod divmod sqrt hypot "
        "deg2rad rad2deg radians degrees ldexp frexp modf".split(),
        4.0,
    ),
    **dict.fromkeys(
        "exp exp2 expm1 log log2 log10 log1p sin cos arcsin arccos arctan sinh cosh tanh "
        "arcsinh arccosh arctanh cbrt".split(),
        20.0,
    ),
    **dict.fromkeys("tan logaddexp logaddexp2 arctan2 power float_power".split(), 40.0),
}
DEFAULT_UFUNC_WEIGHT = 10.0

#: Ufunc -> the representative ufunc calibration times for its class.
UFUNC_CLASS: dict[str, str] = {
    **{name: "add" for name, weight in UFUNC_WEIGHTS.items() if weight == 1.0},
    **dict.fromkeys("divide true_divide reciprocal floor_divide remainder mod fmod divmod hypot "
                    "deg2rad rad2deg radians degrees ldexp frexp modf".split(), "divide"),
    **dict.fromkeys("sqrt cbrt".split(), "sqrt"),
    **dict.fromkeys("exp exp2 expm1 log log2 log10 log1p sinh cosh tanh arcsinh arccosh "
                    "arctanh logaddexp logaddexp2".split(), "exp"),
    **dict.fromkeys("sin cos tan arcsin arccos arctan arctan2".split(), "sin"),
    **dict.fromkeys("power float_power".split(), "power"),
}

_OPERATORS = {
    operator.add: "add",
    operator.sub: "subtract",
    operator.mul: "multiply",
    operator.truediv: "divide",
    operator.floordiv: "floor_divide",
    operator.mod: "remainder",
    operator.pow: "power",
    operator.neg: "negative",
    operator.pos: "positive",
    operator.abs: "absolute",
    operator.invert: "invert",
    operator.inv: "invert",
    operator.eq: "equal",
    operator.ne: "not_equal",
    operator.lt: "less",
    operator.le: "less_equal",
    operator.gt: "greater",
    operator.ge: "greater_equal",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    operator.matmul: "matmul",
}

#: What kind of work a function does; the cost model prices each family its own way.
Family = Literal["matmul", "elementwise", "fft", "reduction", "movement", "aggregate",
                 "creation", "io", "unknown", "data"]
MATMUL: Final = "matmul"
ELEMENTWISE: Final = "elementwise"
FFT: Final = "fft"
REDUCTION: Final = "reduction"
MOVEMENT: Final = "movement"
AGGREGATE: Final = "aggregate"
CREATION: Final = "creation"
IO: Final = "io"
UNKNOWN: Final = "unknown"
DATA: Final = "data"
#: Families that may run on a device; the others always stay on the host.
GPU_FAMILIES: frozenset[Family] = frozenset({MATMUL, ELEMENTWISE, FFT, REDUCTION, MOVEMENT})
#: Families whose result starts on the host (inside a GPU task, copied to the device).
SOURCE_FAMILIES: frozenset[Family] = frozenset({CREATION, DATA})
#: Families that belong on CPU workers in a cluster (aggregation, I/O).
HOST_FAMILIES: frozenset[Family] = frozenset({AGGREGATE, IO})
#: Families that cannot run on a device inside a task.
CPU_ONLY_FAMILIES: frozenset[Family] = frozenset({AGGREGATE, IO, UNKNOWN})
# Which family names a fused task: the heaviest kind of work inside it.
FAMILY_RANK: dict[Family, int] = {MATMUL: 8, FFT: 7, ELEMENTWISE: 6, REDUCTION: 5, MOVEMENT: 4, AGGREGATE: 3,
                CREATION: 2, IO: 1, DATA: 0, UNKNOWN: 9}

_BY_NAME: dict[str, Family] = {
    **dict.fromkeys(
        "_matmul matmul dot vdot inner outer _tensordot tensordot chunk_einsum einsum "
        "matvec vecmat vecdot".split(),
        MATMUL,
    ),
    **dict.fromkeys(
        "fft ifft fft2 ifft2 fftn ifftn rfft irfft rfft2 irfft2 rfftn irfftn hfft ihfft "
        "fftshift ifftshift".split(),
        FFT,
    ),
    **dict.fromkeys(
        "sum prod nansum nanprod min max amin amax nanmin nanmax _chunk_sum mean_chunk "
        "moment_chunk nanmean nanvar nanstd mean var std any all count_nonzero "
        "chunk_min chunk_max cumsum cumprod nancumsum nancumprod".split(),
        REDUCTION,
    ),
    **dict.fromkeys(
        "mean_agg mean_combine moment_agg moment_combine arg_agg arg_combine _concatenate2 "
        "partial_reduce _cumsum_merge _cumprod_merge cumreduction finalize _tree_reduce "
        "_identity_reduce".split(),
        AGGREGATE,
    ),
    **dict.fromkeys(
        "getter getter_nofancy getter_inline load_store_chunk load_chunk store_chunk load "
        "fromfile imread _load_chunk".split(),
        IO,
    ),
    **dict.fromkeys(
        "_apply_random_func _apply_random _broadcast_trick_inner arange linspace eye _eye tri "
        "ones zeros empty full ones_like zeros_like empty_like full_like".split(),
        CREATION,
    ),
    **dict.fromkeys(
        "getitem concatenate3 concatenate_shaped concatenate stack transpose reshape moveaxis "
        "swapaxes _vindex_slice _vindex_merge _vindex_transpose identity _identity_cast "
        "squeeze expand_dims broadcast_to copy ravel flatten atleast_1d atleast_2d "
        "atleast_3d".split(),
        MOVEMENT,
    ),
    **dict.fromkeys("where clip round around isclose astype _astype real imag angle".split(),
                    ELEMENTWISE),
}
_IO_MODULES = ("zarr", "h5py", "tifffile", "netCDF4", "xarray.backends", "tiledb", "imageio")


@functools.lru_cache(maxsize=4096)
def _classify_cached(func: Any) -> tuple[Family, str]:
    if isinstance(func, np.ufunc):
        name = func.__name__
        return (MATMUL if name in ("matmul", "matvec", "vecmat", "vecdot") else ELEMENTWISE), name
    if func in _OPERATORS:
        name = _OPERATORS[func]
        return (MATMUL if name == "matmul" else ELEMENTWISE), name
    name = getattr(func, "__name__", None) or type(func).__name__
    module = getattr(func, "__module__", None) or ""
    if module.startswith(_IO_MODULES):
        return IO, name
    if module.startswith(("numpy.fft", "scipy.fft", "scipy.fftpack")):
        return FFT, name
    return _BY_NAME.get(name, UNKNOWN), name


def classify_func(func: Any) -> tuple[Family, str]:
    """Op family and short name of a chunk function (``functools.partial`` unwrapped).

    >>> classify_func(np.sin)
    ('elementwise', 'sin')
    """
    while isinstance(func, functools.partial):
        func = func.func
    first, funcs = getattr(func, "first", None), getattr(func, "funcs", None)
    if callable(first) and isinstance(funcs, tuple):  # toolz.compose, as dask reductions use
        families = [classify_func(f) for f in (first, *funcs)]
        # combining partials (_concatenate2 + sum) is aggregation, whatever else is composed
        for family in families:
            if family[0] == AGGREGATE:
                return AGGREGATE, families[-1][1]
        return max(families, key=lambda fam: FAMILY_RANK[fam[0]])
    try:
        return _classify_cached(func)
    except TypeError:  # unhashable callable
        return _classify_cached.__wrapped__(func)
