"""Op families: functions known by identity, never by name."""

from __future__ import annotations

import functools
import operator

import dask.array as da
import numpy as np
import pytest
from dask.array.optimization import optimize
from dask.utils import methodcaller as dask_methodcaller

from eugo_dask.ops import classify_func, classify_node, device_dtype_ok
from eugo_dask.unfuse import task_families


def clip(x, lo, hi):  # a user's function, named like NumPy's
    return x


def sum(x):  # shadows the builtin on purpose: a user's own "sum"
    return x


@pytest.mark.parametrize("func, expected", [
    (np.sin, ("elementwise", "sin")),
    (np.clip, ("elementwise", "clip")),
    (operator.add, ("elementwise", "add")),
    (np.matmul, ("matmul", "matmul")),
    (np.fft.fft2, ("fft", "fft2")),
    (np.sum, ("reduction", "sum")),
    (np.diagonal, ("movement", "diagonal")),
    (functools.partial(np.sum, axis=0), ("reduction", "sum")),
    (operator.methodcaller("reshape", (4, 4)), ("movement", "reshape")),
    (operator.methodcaller("astype", dtype="f4"), ("elementwise", "astype")),
    (dask_methodcaller("reshape"), ("movement", "reshape")),
    (operator.methodcaller("tolist"), ("unknown", "tolist")),
    (clip, ("unknown", "clip")),
    (sum, ("unknown", "sum")),
    (__builtins__["sum"] if isinstance(__builtins__, dict) else __builtins__.sum, ("unknown", "sum")),
    (np.divmod, ("unknown", "divmod")),  # two results: not followed
    (np.multiply.outer, ("unknown", "outer")),
    (lambda x: x, ("unknown", "<lambda>")),
])
def test_functions_are_known_by_identity(func, expected):
    assert classify_func(func) == expected


def test_dask_wrappers_are_seen_through():
    import dask.array.reductions as dred

    # da.std's square root, through map_blocks' dtype-enforcing wrapper
    assert classify_func(dred._sqrt) == ("elementwise", "sqrt")
    x = da.ones((4, 4), chunks=2)
    graph = dict(optimize(x.__dask_graph__(), x.__dask_keys__()))
    # ones is a toolz.curry of a creation function
    assert {classify_node(v)[0] for v in graph.values()} == {"creation"}
    y = x.map_blocks(np.tanh, dtype="f4")  # map_blocks with a dtype: _enforce_dtype(tanh)
    graph = dict(optimize(y.__dask_graph__(), y.__dask_keys__()))
    assert {"creation", "elementwise"} == set().union(*map(task_families, graph.values()))


@pytest.mark.parametrize("dtype, ok", [
    ("f4", True), ("c16", True), ("i8", True), ("?", True), (">f8", False), ("O", False),
    ("U3", False), ("M8[s]", False), ([("a", "f4")], False), (np.longdouble, False),
])
def test_device_dtypes(dtype, ok):
    assert device_dtype_ok(np.dtype(dtype)) is ok
