"""shapes: what an operation returns (shape, dtype, and FLOPs for contractions and FFTs), worked
out from its operands' specs on stand-ins; None wherever a rule cannot say."""

from __future__ import annotations

import functools
import operator

import numpy as np
import pytest
from dask.array.core import concatenate3

from eugo_dask.graph import ArraySpec
from eugo_dask.ops import CREATION, ELEMENTWISE, MATMUL, REDUCTION, classify_func
from eugo_dask.shapes import UNKNOWN_ARRAY, infer_step


def S(*shape, dtype="f8"):
    return ArraySpec(tuple(shape), np.dtype(dtype))


def step(func, *args, **kwargs):
    """infer_step as the describer calls it: the function's own family and name."""
    family, name = classify_func(func)
    return infer_step(family, name, func, list(args), kwargs)


def test_elementwise_broadcasts_and_takes_numpys_dtype():
    assert step(np.add, S(3, 1, dtype="f4"), S(1, 4)).out == S(3, 4)
    assert step(np.add, S(3, dtype="f4"), 2).out == S(3, dtype="f4")  # a Python scalar: NumPy's rule
    assert step(np.less, S(5), S(5)).out == S(5, dtype="?")
    assert step(np.sin, S(2, 2, dtype="i2")).out == S(2, 2, dtype="f4")
    assert step(np.add, S(3), S(4)).out is None  # shapes that do not broadcast
    assert step(np.add, S(3), UNKNOWN_ARRAY).out is None  # an operand not known


def test_views_come_from_stand_ins_with_nothing_allocated():
    """A petabyte of chunk: its transpose, slice and reshape are worked out (views of one
    zero, or arithmetic), never allocated."""
    huge = S(10**8, 10**7)
    assert step(np.transpose, huge).out == S(10**7, 10**8)
    assert step(operator.getitem, huge, (slice(None, 10), 0)).out == S(10)
    assert step(np.reshape, huge, (-1, 10)).out == S(10**14, 10)
    assert step(np.ravel, huge).out == S(10**15)


def test_movement_rules():
    x = S(6, 4, dtype="i4")
    assert step(np.reshape, x, (3, -1)).out == S(3, 8, dtype="i4")
    assert step(np.reshape, x, (5, 5)).out is None  # another size: not a reshape of this chunk
    assert step(np.diag, S(3), 2).out == S(5, 5)
    assert step(np.diag, S(3, 4)).out == S(3)  # a 2-D input: its diagonal
    assert step(np.concatenate, [S(2, 3), S(4, 3, dtype="f4")], 0).out == S(6, 3)
    assert step(np.concatenate, [S(2, 3), S(2, 5)], -1).out == S(2, 8)
    assert step(np.stack, [S(2, 3), S(2, 3)], 1).out == S(2, 2, 3)
    assert step(concatenate3, [[S(2, 3), S(2, 1)], [S(5, 3), S(5, 1)]]).out == S(7, 4)
    assert step(np.concatenate, [S(2, 3), UNKNOWN_ARRAY]).out is None
    assert step(np.swapaxes, S(2, 3, 4), 0, 2).out == S(4, 3, 2)


def test_one_result_of_a_decomposition_is_picked_by_index():
    q, r = step(np.linalg.qr, S(10, 4)).out
    assert (q, r) == (S(10, 4), S(4, 4))
    assert step(operator.getitem, (q, r), 1).out == S(4, 4)
    u, s, vh = step(np.linalg.svd, S(6, 3, dtype="c8"), full_matrices=False).out
    assert (u, s, vh) == (S(6, 3, dtype="c8"), S(3, dtype="f4"), S(3, 3, dtype="c8"))
    assert step(np.linalg.svd, S(6, 3)).out[0] == S(6, 6)  # full matrices by default
    assert step(np.vstack, [S(3), S(2, 3)]).out == S(3, 3)
    assert step(np.linalg.qr, "not an array").out is None  # a rule that cannot read: unknown


def test_contractions_count_their_flops():
    mm = step(np.matmul, S(4, 5, dtype="f4"), S(5, 6, dtype="f4"))
    assert mm == (S(4, 6, dtype="f4"), 2.0 * 4 * 6 * 5)
    assert step(np.matmul, S(5), S(5, 6)) == (S(6), 2.0 * 6 * 5)
    assert step(np.matmul, S(2, 4, 5), S(5, 3)).out == S(2, 4, 3)
    assert step(np.matmul, S(4, 5), S(4, 5)).out is None  # operands that do not align
    assert step(np.dot, S(3, 4), S(4)) == (S(3), 2.0 * 3 * 4)
    td = step(np.tensordot, S(2, 3, 4), S(3, 4, 5), ((1, 2), (0, 1)))
    assert td == (S(2, 5), 2.0 * 2 * 5 * 12)
    assert step(np.tensordot, S(2, 3), S(3, 4), 1).out == S(2, 4)
    es = step(np.einsum, "ij,jk->ik", S(3, 4), S(4, 5))
    assert es == (S(3, 5), 3 * 4 * 5 * 2.0)
    assert step(np.einsum, "...j,jk->...k", S(3, 4), S(4, 5)).out is None  # ellipsis: unknown
    assert step(np.einsum, "ij->ji", S(3, 4), S(4, 5)).out is None  # operand count
    assert step(np.outer, S(3), S(2, 2)) == (S(3, 4), 12.0)


def test_dasks_chunk_contractions_keep_their_contracted_axes():
    """Dask's chunk-level ``_matmul`` and ``_tensordot`` put the contraction axes back as
    length 1 (the reduction sums over them)."""
    assert infer_step(MATMUL, "_matmul", None, [S(4, 5), S(5, 6)], {}).out == S(4, 1, 6)
    td = infer_step(MATMUL, "_tensordot", None, [S(2, 3), S(3, 4)], {"axes": ((1,), (0,))})
    assert td == (S(2, 1, 4), 2.0 * 2 * 4 * 3)


def test_reductions():
    x = S(4, 6, dtype="i4")
    assert step(np.sum, x, 1).out == S(4, dtype="i4")
    assert step(np.sum, x, 0, keepdims=True).out == S(1, 6, dtype="i4")
    assert step(np.sum, x).out == S(dtype="i4")  # every axis
    assert step(np.sum, x, -1, dtype="f4").out == S(4, dtype="f4")
    assert step(np.any, x, 0).out == S(6, dtype="?")
    assert step(np.cumsum, x, 1).out == x
    assert infer_step(REDUCTION, "_chunk_sum", None, [[S(4, 1, 6), S(4, 1, 6)]],
                      {"axis": (1,)}).out == S(4, 6)
    assert step(np.sum, UNKNOWN_ARRAY, 0).out is None


def test_ffts_give_their_shape_dtype_and_flops():
    fft = step(np.fft.fft, S(8, 1024, dtype="f4"))
    assert fft.out == S(8, 1024, dtype="c8")
    assert fft.flops == pytest.approx(5 * 8 * 1024 * 10)
    assert step(np.fft.fft, S(100), 128).out == S(128, dtype="c16")  # n pads
    rfft = step(np.fft.rfft, S(1024))
    assert rfft.out == S(513, dtype="c16") and rfft.flops == pytest.approx(5 * 1024 * 10 / 2)
    assert step(np.fft.irfft, S(513, dtype="c8")).out == S(1024, dtype="f4")
    fft2 = step(np.fft.fft2, S(3, 16, 32))
    assert fft2.out == S(3, 16, 32, dtype="c16")
    assert fft2.flops == pytest.approx(5 * 3 * 16 * 32 * 9)  # over the two last axes' 512 points
    assert step(np.fft.fft, S()).out is None  # a 0-d array has no axis to transform


def test_creation_reads_the_shape_it_is_asked_for():
    from dask.array.chunk import arange

    assert step(np.ones, (3, 4), dtype="i2").out == S(3, 4, dtype="i2")
    assert step(np.full, 5, 1.5j).out == S(5, dtype="c16")  # the fill value's dtype
    assert step(np.linspace, 0, 1, 7).out == S(7)
    assert step(arange, 0, 10, 2, 5, "i8").out == S(5, dtype="i8")
    assert infer_step(CREATION, "_broadcast_trick_inner", None, [None, (2, 3)],
                      {"dtype": "f4"}).out == S(2, 3, dtype="f4")
    assert infer_step(CREATION, "no such creator", None, [(2, 3)], {}).out is None


def test_wrappers_are_looked_through():
    """``functools.partial`` and ``toolz.curry``: the bound arguments come first, the task's
    keywords win over the bound ones."""
    from toolz import curry

    summed = functools.partial(np.sum, axis=0, keepdims=True)
    assert infer_step(REDUCTION, "sum", summed, [S(4, 6)], {}).out == S(1, 6)
    assert infer_step(REDUCTION, "sum", summed, [S(4, 6)], {"axis": 1}).out == S(4, 1)
    assert infer_step(ELEMENTWISE, "add", curry(np.add)(S(3, 1)), [S(1, 4)], {}).out == S(3, 4)


def test_planning_raises_no_floating_point_warning():
    """The rules call NumPy on 0-d probes of the operands' dtypes, with the task's literal
    arguments (a division by a literal zero): what NumPy would warn is planning's, not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step(np.divide, S(3), 0).out == S(3)
