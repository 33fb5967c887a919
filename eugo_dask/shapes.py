"""What each operation in a task returns: chunk shapes and dtypes through a task, and the work of
contractions and FFTs read from the operation itself.

A fused task applies several functions in a row; its input chunks' shapes say little about what
its inner operations see (a transpose before a matmul changes which axis is contracted). For the
functions eugo knows (by identity, :mod:`eugo_dask.ops`), :func:`infer_step` works out the output
shape and dtype from the operands' and the literal arguments (``axes``, ``axis``, ``keepdims``,
einsum subscripts, an index, a ``size``), and for contractions and FFTs the FLOPs:

- matmul/dot: ``2 * |out| * k`` with ``k`` the contracted length of the operands as they are;
- tensordot: ``2 * |free a| * |free b| * |contracted|`` from its ``axes``;
- einsum: ``2 * prod(size of every index)`` from its subscripts;
- FFT: ``5 * |x| * log2(L)`` over the transformed lengths ``L`` (half for real input).

Shapes come from arithmetic or from NumPy applied to zero-stride stand-ins of the operands (views
only: nothing of a chunk's size is allocated or computed). Anything not understood gives None, and
the caller falls back on the collection's chunk annotations.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from dask.array.chunk import astype as chunk_astype

from eugo_dask.graph import ArraySpec
from eugo_dask.ops import (
    CREATION,
    ELEMENTWISE,
    FFT,
    MATMUL,
    MOVEMENT,
    REDUCTION,
    Family,
)


class UnknownArray:
    """An array operand whose shape is not known."""

    def __repr__(self) -> str:
        return "UnknownArray"


UNKNOWN_ARRAY = UnknownArray()
#: What an operand resolves to: a known chunk, an unknown array, or a literal value.
Operand = Any


class StepShape(NamedTuple):
    """What one operation produces (a chunk's spec, a tuple of them for a decomposition, None
    where unknown) and, for contractions and FFTs, its FLOPs."""

    out: ArraySpec | tuple[ArraySpec, ...] | None
    flops: float | None = None


def _arrays(args: Sequence[Operand]) -> list[ArraySpec | UnknownArray]:
    out: list[ArraySpec | UnknownArray] = []
    for a in args:
        if isinstance(a, (ArraySpec, UnknownArray)):
            out.append(a)
        elif isinstance(a, list):
            out.extend(_arrays(a))
    return out


def _standin(spec: ArraySpec) -> np.ndarray:
    """A view with the chunk's shape and dtype and no memory behind it: zeros (an index array
    on a stand-in selects element 0, whatever memory the process had)."""
    return np.broadcast_to(np.zeros((), dtype=spec.dtype), spec.shape)


def _one(spec: ArraySpec) -> np.ndarray:
    return np.ones((), dtype=spec.dtype)


def _unwrapped(func: Any, args: Sequence[Operand], kwargs: dict[str, Any]
               ) -> tuple[Any, list[Operand], dict[str, Any]]:
    """The function under ``functools.partial`` and ``toolz.curry`` wrappers, with their bound
    arguments put in front of the task's and their keywords under the task's own."""
    args, merged = list(args), dict(kwargs)
    while hasattr(func, "func") and hasattr(func, "keywords") and hasattr(func, "args"):
        args = [*func.args, *args]
        merged = {**(func.keywords or {}), **merged}
        func = func.func
    return func, args, merged


def infer_step(family: Family, name: str, func: Any, args: Sequence[Operand],
               kwargs: dict[str, Any]) -> StepShape:
    """The output spec (and FLOPs, for contractions and FFTs) of ``func(*args, **kwargs)``
    where array operands are :class:`ArraySpec` (or :data:`UNKNOWN_ARRAY`)."""
    base, args, kwargs = _unwrapped(func, args, kwargs)
    decomposition = _DECOMPOSITIONS.get(base)
    if decomposition is not None:  # linear algebra on the host: what it hands on is known
        try:
            return StepShape(decomposition(args, kwargs))
        except (TypeError, ValueError, IndexError, KeyError, AttributeError):
            return StepShape(None)
    arrays = _arrays(args)
    if any(isinstance(a, UnknownArray) for a in arrays) and family != CREATION:
        return StepShape(None)
    known = [a for a in arrays if isinstance(a, ArraySpec)]
    try:
        # The rules call NumPy on stand-ins: what they would warn is planning's, not the
        # user's computation's. Floating-point errors are silenced per thread; a cast's dtype is
        # read rather than tried (NumPy warns of a complex-to-real cast whatever the values).
        # Not warnings.catch_warnings: it swaps the filters of every thread (other threads'
        # warnings were lost while a graph was planned) and makes a warning already shown show
        # again.
        with np.errstate(all="ignore"):
            if family == ELEMENTWISE:
                return StepShape(_elementwise(name, base, args, kwargs, known))
            if family == MOVEMENT:
                return StepShape(_movement(name, base, args, kwargs, known))
            if family == MATMUL:
                return _contraction(name, args, kwargs, known)
            if family == REDUCTION:
                return StepShape(_reduction(name, args, kwargs, known))
            if family == FFT:
                return _fft(name, args, kwargs, known)
            if family == CREATION:
                return StepShape(_creation(name, args, kwargs))
    except (TypeError, ValueError, IndexError, KeyError, AttributeError, OverflowError):
        pass  # an argument this rule cannot read: unknown
    return StepShape(None)


# ---------------------------------------------------------------------------------------------
# Elementwise and movement
# ---------------------------------------------------------------------------------------------
def _elementwise(name: str, func: Any, args: Sequence[Operand], kwargs: dict[str, Any],
                 known: list[ArraySpec]) -> ArraySpec | None:
    if not known:
        return None
    shape = np.broadcast_shapes(*(a.shape for a in known))
    dtype = _cast_dtype(func, kwargs) if name == "astype" else None
    if dtype is None:
        # the dtype NumPy gives: the function on 0-d ones of the operands' dtypes
        probe_args = [_one(a) if isinstance(a, ArraySpec) else a for a in args]
        result = func(*probe_args, **kwargs)
        dtype = getattr(result, "dtype", None)
    if dtype is None:
        dtype = np.result_type(*(a.dtype for a in known))
    return ArraySpec(tuple(int(s) for s in shape), np.dtype(dtype))


def _cast_dtype(func: Any, kwargs: dict[str, Any]) -> np.dtype[Any] | None:
    """The dtype a cast asks for: Dask's ``astype`` chunk function (``astype_dtype=``) or
    ``methodcaller("astype", dtype)``; None for another form of cast."""
    if func is chunk_astype:
        target = kwargs.get("astype_dtype")
    elif isinstance(func, operator.methodcaller):
        # (methodcaller, ("astype", dtype, ...)), or with keywords
        # (partial(methodcaller, "astype", **keywords), (dtype, ...))
        reduced: Any = func.__reduce__()
        maker, positional = reduced[0], reduced[1]
        if isinstance(maker, functools.partial):
            target = positional[0] if positional else maker.keywords.get("dtype")
        else:
            target = positional[1] if len(positional) > 1 else None
    else:
        return None
    if target is None:
        return None
    dtype = np.dtype(target)
    return dtype if dtype.itemsize else None  # ("U", "S": NumPy sizes them from the values)


#: Movement functions whose result is a view: NumPy on a stand-in gives the shape for free.
_VIEWS = frozenset("transpose swapaxes moveaxis squeeze expand_dims broadcast_to diagonal "
                   "atleast_1d atleast_2d atleast_3d fftshift ifftshift getitem "
                   "_identity_cast identity".split())


def _movement(name: str, func: Any, args: Sequence[Operand], kwargs: dict[str, Any],
              known: list[ArraySpec]) -> ArraySpec | None:
    if name == "getitem" and isinstance(args[0], tuple) and not isinstance(args[0], ArraySpec):
        item = args[0][args[1]]  # one result of a decomposition (q of qr, u of svd)
        return item if isinstance(item, ArraySpec) else None
    if name in _CONCATENATIONS and isinstance(args[0], list):
        return _concatenated(name, args, kwargs)
    if not known or not isinstance(args[0], ArraySpec):
        return None
    x = args[0]
    if name in ("identity", "_identity_cast", "copy"):
        return x
    if name == "reshape":
        shape = args[1] if len(args) > 1 else kwargs.get("shape", kwargs.get("newshape"))
        return ArraySpec(_reshaped(x, shape), x.dtype)
    if name in ("ravel", "flatten"):
        return ArraySpec((x.size,), x.dtype)
    if name == "diag":
        if len(x.shape) == 1:
            k = abs(int(args[1] if len(args) > 1 else kwargs.get("k", 0)))
            return ArraySpec((x.shape[0] + k,) * 2, x.dtype)
        name = "diagonal"
    if name == "getitem" and any(isinstance(a, ArraySpec) and a.dtype == np.bool_
                                 for a in args[1:]):
        return None  # a boolean mask selects as many elements as it holds True: the data's to say
    if name in _VIEWS:
        standin_args = [_standin(a) if isinstance(a, ArraySpec) else a for a in args]
        view = func(*standin_args, **kwargs)
        return ArraySpec(tuple(view.shape), view.dtype)
    return None  # concatenation and the like: the chunk annotations know


_CONCATENATIONS = frozenset({"concatenate3", "concatenate_shaped", "concatenate", "stack"})


def _concatenated(name: str, args: Sequence[Operand], kwargs: dict[str, Any]) -> ArraySpec | None:
    """Blocks joined into one: Dask's nested-list concatenation (``concatenate3``, and
    ``concatenate_shaped`` of a flat list laid out in a grid) or NumPy's along an axis."""
    blocks = args[0]
    operands = _arrays(blocks)
    specs = [b for b in operands if isinstance(b, ArraySpec)]
    if not specs or len(specs) < len(operands):
        return None
    dtype = np.result_type(*(b.dtype for b in specs))
    if name in ("concatenate", "stack"):
        axis = int(args[1] if len(args) > 1 else kwargs.get("axis", 0))
        shapes = [b.shape for b in blocks]
        if name == "stack":
            axis %= len(shapes[0]) + 1
            return ArraySpec((*shapes[0][:axis], len(shapes), *shapes[0][axis:]), dtype)
        axis %= len(shapes[0])
        total = sum(sh[axis] for sh in shapes)
        return ArraySpec((*shapes[0][:axis], total, *shapes[0][axis + 1:]), dtype)
    if name == "concatenate_shaped":
        grid = tuple(args[1] if len(args) > 1 else kwargs["shape"])
        blocks = np.array(blocks, dtype=object).reshape(grid).tolist()
    return ArraySpec(_joined_shape(blocks, 0), dtype)


def _joined_shape(nested: Any, axis: int) -> tuple[int, ...]:
    if isinstance(nested, ArraySpec):
        return nested.shape
    shapes = [_joined_shape(part, axis + 1) for part in nested]
    joined = list(shapes[0])
    joined[axis] = sum(sh[axis] for sh in shapes)
    return tuple(joined)


def _reshaped(x: ArraySpec, shape: Any) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        shape = tuple(x.size // max(rest, 1) if s == -1 else s for s in shape)
    if math.prod(shape) != x.size:
        raise ValueError("reshape to a different size")
    return shape


# ---------------------------------------------------------------------------------------------
# Linear algebra on the host (never offloaded; their results feed tasks that may be)
# ---------------------------------------------------------------------------------------------
def _qr(args: Sequence[Operand], kwargs: dict[str, Any]) -> tuple[ArraySpec, ArraySpec]:
    a = args[0]
    m, n = a.shape[-2:]
    k = min(m, n)
    return ArraySpec((*a.shape[:-2], m, k), a.dtype), ArraySpec((*a.shape[:-2], k, n), a.dtype)


def _svd(args: Sequence[Operand], kwargs: dict[str, Any]) -> tuple[ArraySpec, ...]:
    a = args[0]
    m, n = a.shape[-2:]
    full = kwargs.get("full_matrices", args[1] if len(args) > 1 else True)
    k = min(m, n)
    u = (m, m) if full else (m, k)
    vh = (n, n) if full else (k, n)
    real = np.dtype(np.float32 if a.dtype in (np.float32, np.complex64) else np.float64)
    return (ArraySpec((*a.shape[:-2], *u), a.dtype), ArraySpec((*a.shape[:-2], k), real),
            ArraySpec((*a.shape[:-2], *vh), a.dtype))


def _vstack(args: Sequence[Operand], kwargs: dict[str, Any]) -> ArraySpec:
    blocks = [np.atleast_2d(_standin(a)) for a in args[0]]
    rows = sum(b.shape[0] for b in blocks)
    return ArraySpec((rows, *blocks[0].shape[1:]), np.result_type(*(b.dtype for b in blocks)))


def _decompositions() -> dict[Any, Any]:
    import dask.array.linalg as dlinalg

    return {np.linalg.qr: _qr, getattr(dlinalg, "_wrapped_qr", None): _qr,
            np.linalg.svd: _svd, np.vstack: _vstack}


_DECOMPOSITIONS = _decompositions()


# ---------------------------------------------------------------------------------------------
# Contractions
# ---------------------------------------------------------------------------------------------
def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """NumPy's matmul result shape and the contracted length."""
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError("matmul operands do not align")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    out = (*batch, a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return tuple(int(s) for s in out), int(a2[-1])


def _result_dtype(known: list[ArraySpec]) -> np.dtype[Any]:
    return np.result_type(*(a.dtype for a in known))


def _contraction(name: str, args: Sequence[Operand], kwargs: dict[str, Any],
                 known: list[ArraySpec]) -> StepShape:
    if name in ("_matmul", "matmul") and len(known) == 2:
        out, k = _matmul_shape(known[0].shape, known[1].shape)
        flops = 2.0 * math.prod(out) * k
        if name == "_matmul":  # dask puts the contraction axis back, at -2
            out = (*out[:-1], 1, out[-1])
        return StepShape(ArraySpec(out, _result_dtype(known)), flops)
    if name == "dot" and len(known) == 2:
        a, b = known[0].shape, known[1].shape
        if len(a) <= 2 and len(b) <= 2:
            out, k = _matmul_shape(a, b)
        else:
            k = a[-1]
            out = (*a[:-1], *b[:-2], b[-1])
        return StepShape(ArraySpec(out, _result_dtype(known)), 2.0 * math.prod(out) * k)
    if name in ("_tensordot", "tensordot") and len(known) == 2:
        a, b = known[0].shape, known[1].shape
        axes = args[2] if len(args) > 2 else kwargs.get("axes", 2)
        axes_a, axes_b = _tensordot_axes(axes, len(a), len(b))
        contracted = math.prod(a[i] for i in axes_a)
        free_a = [s for i, s in enumerate(a) if i not in axes_a]
        free_b = [s for i, s in enumerate(b) if i not in axes_b]
        flops = 2.0 * math.prod(free_a) * math.prod(free_b) * contracted
        dims = [*free_a, *free_b]
        if name == "_tensordot":  # dask re-inserts the contracted axes as length 1
            for i in sorted(axes_a):
                dims.insert(i, 1)
        return StepShape(ArraySpec(tuple(dims), _result_dtype(known)), flops)
    if name in ("chunk_einsum", "einsum"):
        if name == "einsum":
            subscripts, operands = args[0], known
        else:
            subscripts, operands = kwargs["subscripts"], known
        out, flops = _einsum(subscripts, operands)
        if name == "chunk_einsum":
            out = (*out, *(1,) * int(kwargs.get("ncontract_inds", 0)))
        dtype = kwargs.get("kernel_dtype") or _result_dtype(known)
        return StepShape(ArraySpec(out, np.dtype(dtype)), flops)
    if name == "outer" and len(known) == 2:
        out = (known[0].size, known[1].size)
        return StepShape(ArraySpec(out, _result_dtype(known)), float(math.prod(out)))
    return StepShape(None)


def _tensordot_axes(axes: Any, ndim_a: int, ndim_b: int) -> tuple[list[int], list[int]]:
    if isinstance(axes, int):
        return list(range(ndim_a - axes, ndim_a)), list(range(axes))
    axes_a, axes_b = axes
    axes_a = [axes_a] if isinstance(axes_a, int) else list(axes_a)
    axes_b = [axes_b] if isinstance(axes_b, int) else list(axes_b)
    return [a % ndim_a for a in axes_a], [b % ndim_b for b in axes_b]


def _einsum(subscripts: str, operands: list[ArraySpec]) -> tuple[tuple[int, ...], float]:
    if "..." in subscripts or "->" not in subscripts:
        raise ValueError("implicit or ellipsis subscripts")
    inputs, output = subscripts.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        raise ValueError("operand count")
    sizes: dict[str, int] = {}
    for term, spec in zip(terms, operands):
        if len(term) != len(spec.shape):
            raise ValueError("subscripts do not match the operand")
        for letter, size in zip(term, spec.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    out = tuple(sizes[letter] for letter in output)
    # one multiply per extra operand and one add, at every point of the index space
    return out, float(math.prod(sizes.values())) * max(1, len(operands))


# ---------------------------------------------------------------------------------------------
# Reductions, FFTs, creation
# ---------------------------------------------------------------------------------------------
def _axes(axis: Any, ndim: int) -> set[int]:
    if axis is None:
        return set(range(ndim))
    if isinstance(axis, int):
        return {axis % ndim} if ndim else set()
    return {int(a) % ndim for a in axis} if ndim else set()


def _reduction(name: str, args: Sequence[Operand], kwargs: dict[str, Any],
               known: list[ArraySpec]) -> ArraySpec | None:
    source = args[0]
    if isinstance(source, list):  # _chunk_sum of a list of partial products
        source = next((a for a in source if isinstance(a, ArraySpec)), None)
    if not isinstance(source, ArraySpec):
        return None
    if name in ("cumsum", "cumprod", "nancumsum", "nancumprod"):
        return ArraySpec(source.shape, np.dtype(kwargs.get("dtype") or source.dtype))
    # NumPy's reductions take the axis second; Dask's chunk functions by keyword only
    numpy_style = name not in _DASK_REDUCTIONS
    axis = args[1] if numpy_style and len(args) > 1 else kwargs.get("axis")
    keepdims = bool(kwargs.get("keepdims", False))
    if name == "_chunk_sum":
        if keepdims or axis is None:
            return ArraySpec(source.shape, np.dtype(kwargs.get("dtype") or source.dtype))
        dropped = axis[0] % len(source.shape)
        shape = tuple(s for i, s in enumerate(source.shape) if i != dropped)
        return ArraySpec(shape, np.dtype(kwargs.get("dtype") or source.dtype))
    reduced = _axes(axis, len(source.shape))
    shape = tuple(1 if i in reduced else s for i, s in enumerate(source.shape)
                  if keepdims or i not in reduced)
    dtype = kwargs.get("dtype")
    if name in ("any", "all"):
        dtype = np.bool_
    return ArraySpec(shape, np.dtype(dtype or source.dtype))


_DASK_REDUCTIONS = frozenset({"_chunk_sum", "chunk_min", "chunk_max", "mean_chunk",
                              "moment_chunk"})
_REAL_IN = frozenset({"rfft", "rfft2", "rfftn", "ihfft"})
_REAL_OUT = frozenset({"irfft", "irfft2", "irfftn", "hfft"})


def _fft(name: str, args: Sequence[Operand], kwargs: dict[str, Any],
         known: list[ArraySpec]) -> StepShape:
    x = args[0]
    if not isinstance(x, ArraySpec) or not x.shape:
        return StepShape(None)
    ndim = len(x.shape)
    if name.endswith("n") or name.endswith("2"):
        lengths = args[1] if len(args) > 1 else kwargs.get("s")
        axes = args[2] if len(args) > 2 else kwargs.get("axes")
        if axes is None:
            axes = (-2, -1) if name.endswith("2") else tuple(range(ndim))
            if lengths is not None:
                axes = tuple(range(ndim - len(lengths), ndim))
    else:
        n = args[1] if len(args) > 1 else kwargs.get("n")
        axes = (args[2] if len(args) > 2 else kwargs.get("axis", -1),)
        lengths = None if n is None else (n,)
    axes = tuple(int(a) % ndim for a in (axes or ()))
    shape = list(x.shape)
    if lengths is not None:
        for a, n in zip(axes, lengths):
            shape[a] = int(n)
    transformed = [shape[a] for a in axes]  # lengths the transforms run over
    last = axes[-1]
    if name in _REAL_IN:
        shape[last] = shape[last] // 2 + 1
    elif name in _REAL_OUT and lengths is None:
        shape[last] = 2 * (x.shape[last] - 1)
        transformed[-1] = shape[last]
    single = x.dtype in (np.float32, np.complex64, np.float16)
    if name in _REAL_OUT:
        dtype: np.dtype[Any] = np.dtype(np.float32 if single else np.float64)
    else:
        dtype = np.dtype(np.complex64 if single else np.complex128)
    size = math.prod(max(s, 1) for s in (shape if name in _REAL_OUT else x.shape))
    points = math.prod(max(t, 1) for t in transformed)
    flops = 5.0 * size * math.log2(max(points, 2))
    if name in _REAL_IN or name in _REAL_OUT:
        flops /= 2
    return StepShape(ArraySpec(tuple(shape), dtype), flops)


def _shape_arg(value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(s) for s in value)


def _creation(name: str, args: Sequence[Operand], kwargs: dict[str, Any]) -> ArraySpec | None:
    if name in ("_apply_random_func", "_apply_random"):
        size, extra = args[3], args[5] if len(args) > 5 else {}
        dtype = (extra or {}).get("dtype", np.float64) if isinstance(extra, dict) else np.float64
        return ArraySpec(_shape_arg(size), np.dtype(dtype))
    if name == "_broadcast_trick_inner":  # ones, zeros, full, empty (meta, shape)
        return ArraySpec(_shape_arg(args[1]), np.dtype(kwargs.get("dtype", np.float64)))
    if name in ("ones", "zeros", "empty", "full"):
        shape = args[0] if args else kwargs["shape"]
        dtype = kwargs.get("dtype")
        if dtype is None and name == "full":
            fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
            dtype = np.asarray(fill).dtype
        return ArraySpec(_shape_arg(shape), np.dtype(dtype or np.float64))
    if name == "arange":  # dask.array.chunk.arange(start, stop, step, length, dtype)
        length = args[3] if len(args) > 3 else kwargs.get("length")
        if length is not None:
            return ArraySpec((int(length),), np.dtype(args[4] if len(args) > 4 else kwargs.get("dtype")))
    if name == "linspace":
        num = args[2] if len(args) > 2 else kwargs.get("num", 50)
        return ArraySpec((int(num),), np.dtype(kwargs.get("dtype") or np.float64))
    return None


__all__ = ["UNKNOWN_ARRAY", "StepShape", "UnknownArray", "infer_step"]
