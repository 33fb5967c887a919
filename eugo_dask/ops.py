"""Op families: what a chunk function does, and which dtypes a device can hold.

Every function in a task is put in one family (:data:`Family`): matmul-like contractions,
elementwise ufuncs, FFTs, reductions (their chunk step), data movement (views and copies),
aggregation of partial results, creation (ones, random, arange), I/O getters, embedded data, or
unknown. The cost model prices each family its own way; the planner keeps aggregation, I/O,
creation and unknown functions on the host. Ufuncs carry a weight in flop-equivalents per element
(:data:`UFUNC_WEIGHTS`) and a class that calibration times (:data:`UFUNC_CLASS`).

The aliases every layer shares live here too: where a task runs (:data:`Placement`) and what
``eugo.device`` may say (:data:`DeviceSetting`).

This module imports nothing of eugo's: every other module builds on it.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Final, Literal

import numpy as np
from dask.utils import methodcaller as dask_methodcaller
from toolz import curry as _curry

#: Where a task runs.
Placement = Literal["cpu", "gpu"]
CPU: Final = "cpu"
GPU: Final = "gpu"
#: What ``eugo.device`` may say (``auto``: CuPy where it has a working device, else none).
DeviceSetting = Literal["auto", "cupy", "emulated", "none"]

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

def _known_functions() -> dict[Any, tuple[Family, str]]:
    """Every function eugo knows, by identity (as ``dask.array.optimization`` knows its
    ``GETTERS``): a user's own function that happens to be called ``clip`` or ``sum`` is not
    NumPy's, and stays unknown (on the host)."""
    import dask.array.chunk as dchunk
    import dask.array.core as dcore
    import dask.array.einsumfuncs as deinsum
    import dask.array.random as drandom
    import dask.array.reductions as dred
    import dask.array.routines as droutines
    import dask.array.wrap as dwrap
    import toolz
    from dask import _task_spec

    table: dict[Any, tuple[Family, str]] = {}

    def add(family: Family, *funcs: Any, name: str | None = None) -> None:
        for func in funcs:
            if func is not None:
                func = _unwrap(func)  # a toolz.curry is known by the function it curries
                table[func] = (family, str(name or getattr(func, "__name__", type(func).__name__)))

    def numpy(*names: str) -> list[Any]:
        return [getattr(np, n, None) for n in names]

    add(MATMUL, *numpy("dot", "vdot", "inner", "outer", "tensordot", "einsum"), operator.matmul,
        droutines._matmul, droutines._tensordot, deinsum.chunk_einsum)
    add(ELEMENTWISE, *numpy("where", "clip", "round", "around", "real", "imag", "angle"),
        dchunk.astype)
    add(ELEMENTWISE, dred._sqrt, name="sqrt")
    for func, name in _OPERATORS.items():
        add(MATMUL if name == "matmul" else ELEMENTWISE, func, name=name)
    add(FFT, *(getattr(np.fft, n) for n in _FFT_NAMES))
    add(MOVEMENT, np.fft.fftshift, np.fft.ifftshift)
    add(REDUCTION, *numpy("sum", "prod", "min", "max", "amin", "amax", "nansum", "nanprod",
                          "nanmin", "nanmax", "mean", "nanmean", "var", "std", "nanvar",
                          "nanstd", "any", "all", "count_nonzero", *CUMULATIVE),
        dred.chunk_min, dred.chunk_max, dred.mean_chunk, dred.moment_chunk,
        droutines._chunk_sum)
    add(AGGREGATE, dcore._concatenate2, dcore.finalize, dred.mean_agg, dred.mean_combine,
        dred.moment_agg, dred.moment_combine, dred.arg_agg, dred.arg_combine,
        dred.nanarg_agg, dred._cumsum_merge, dred._cumprod_merge,
        getattr(dred, "partial_reduce", None), getattr(dred, "_tree_reduce", None))
    add(IO, dcore.getter, dcore.getter_nofancy, dcore.getter_inline, dcore.load_store_chunk,
        dcore.load_chunk, getattr(dcore, "store_chunk", None), np.load, np.fromfile)
    add(CREATION, *numpy("ones", "zeros", "empty", "full", "ones_like", "zeros_like",
                         "empty_like", "full_like", "eye", "arange", "linspace", "tri"),
        dchunk.arange, dchunk.linspace, drandom._apply_random_func, drandom._apply_random,
        dwrap._broadcast_trick_inner, getattr(droutines, "_linspace", None))
    add(MOVEMENT, operator.getitem, dchunk.getitem, dcore.concatenate3,
        dcore.concatenate_shaped, toolz.identity, _task_spec._identity_cast,
        *numpy("transpose", "swapaxes", "moveaxis", "squeeze", "expand_dims", "broadcast_to",
               "reshape", "ravel", "copy", "atleast_1d", "atleast_2d", "atleast_3d",
               "concatenate", "stack", "diagonal", "diag"))
    return table


#: Array methods a ``methodcaller`` may name, with the family of the work they do.
def _wrappers() -> dict[Any, str]:
    import dask.array.core as dcore

    return {dcore._enforce_dtype: "enforce_dtype_function", dcore.apply_and_enforce: "_func"}


#: Dask's map_blocks wrappers -> the keyword that holds the wrapped function.
_WRAPPERS = _wrappers()
_METHODS: dict[str, Family] = {
    **dict.fromkeys("transpose swapaxes reshape squeeze ravel flatten copy".split(), MOVEMENT),
    **dict.fromkeys("astype conj conjugate".split(), ELEMENTWISE),
}
_FFT_NAMES = ("fft ifft fft2 ifft2 fftn ifftn rfft irfft rfft2 irfft2 rfftn irfftn hfft "
              "ihfft").split()
_MATMUL_UFUNCS = frozenset({"matmul", "matvec", "vecmat", "vecdot"})
_IO_MODULES = ("zarr", "h5py", "tifffile", "netCDF4", "xarray.backends", "tiledb", "imageio")
_KNOWN: dict[Any, tuple[Family, str]] | None = None


def _classify_cached(func: Any) -> tuple[Family, str]:
    global _KNOWN
    if isinstance(func, np.ufunc):
        name = func.__name__
        if func.nout != 1:  # modf, frexp, divmod: tuples of arrays
            return UNKNOWN, name
        return (MATMUL if name in _MATMUL_UFUNCS else ELEMENTWISE), name
    if _KNOWN is None:
        _KNOWN = _known_functions()
    known = _KNOWN.get(func)
    if known is not None:
        return known
    name = getattr(func, "__name__", None) or type(func).__name__
    if isinstance(func, (operator.methodcaller, dask_methodcaller)):
        method = _method_name(func)
        return _METHODS.get(method, UNKNOWN), method
    module = getattr(func, "__module__", None) or ""
    if isinstance(module, str) and module.startswith(_IO_MODULES):
        return IO, name
    return UNKNOWN, name


def _unwrap(func: Any) -> Any:
    """The function under ``functools.partial`` and ``toolz.curry`` wrappers."""
    while isinstance(func, (functools.partial, _curry)):
        func = func.func
    return func


def _method_name(caller: Any) -> str:
    """The method a ``methodcaller`` calls (operator's keeps it behind ``__reduce__``)."""
    name = getattr(caller, "method", None)  # dask.utils.methodcaller
    if isinstance(name, str):
        return name
    reduced = caller.__reduce__()
    args = reduced[1] if reduced[0] is operator.methodcaller else getattr(reduced[0], "args", ())
    return args[0] if args and isinstance(args[0], str) else ""


_classify_lru = functools.lru_cache(maxsize=4096)(_classify_cached)


def is_wrapper(func: Any) -> bool:
    """Whether ``func`` is one of Dask's ``map_blocks`` wrappers, whose tasks
    :func:`classify_node` classifies by the function they wrap (any other task: by its own
    function alone)."""
    return func in _WRAPPERS


def classify_node(node: Any) -> tuple[Family, str]:
    """Op family and short name of a task's function; Dask's ``map_blocks`` wrappers
    (``_enforce_dtype``, ``apply_and_enforce``) are classified by the function they wrap."""
    func = node.func
    if func in _WRAPPERS:
        wrapped = node.kwargs.get(_WRAPPERS[func])
        if callable(wrapped):
            return classify_func(wrapped)
    return classify_func(func)


def classify_func(func: Any) -> tuple[Family, str]:
    """Op family and short name of a chunk function (``functools.partial`` unwrapped).

    Functions are recognised by identity; anything else is ``unknown`` and stays on the host.

    >>> classify_func(np.sin)
    ('elementwise', 'sin')
    """
    func = _unwrap(func)
    first, funcs = getattr(func, "first", None), getattr(func, "funcs", None)
    if callable(first) and isinstance(funcs, tuple):  # toolz.compose, as dask reductions use
        families = [classify_func(f) for f in (first, *funcs)]
        # combining partials (_concatenate2 + sum) is aggregation, whatever else is composed
        for family in families:
            if family[0] == AGGREGATE:
                return AGGREGATE, families[-1][1]
        return max(families, key=lambda fam: FAMILY_RANK[fam[0]])
    try:
        return _classify_lru(func)
    except TypeError:  # unhashable callable
        return _classify_cached(func)
