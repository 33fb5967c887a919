"""The real CuPy device. Skipped where CuPy or a CUDA device is missing (never required)."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import eugo_dask
from eugo_dask.devices import cupy_device_count

pytestmark = pytest.mark.gpu


@pytest.fixture
def cupy_device():
    if not cupy_device_count():
        pytest.skip("needs CuPy and a CUDA device")
    with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": "cupy",
                          "eugo.min-speedup": 0}):
        eugo_dask.reset_device_stats()
        yield


def test_auto_resolves_to_cupy(cupy_device):
    with dask.config.set({"eugo.device": "auto"}):
        assert eugo_dask.read_settings().resolved().device == "cupy"


@pytest.mark.parametrize("name", ["chain", "matmul-chain", "fft2", "std", "cumsum", "rechunk",
                                  "fancy-index", "concatenate", "where", "einsum"])
def test_same_result_on_cupy(name, cupy_device):
    from .test_equivalence import CASES

    with dask.config.set(optimizations=[]):
        expected = CASES[name]().compute(scheduler="sync")
    result = CASES[name]().compute(scheduler="threads")
    assert type(result) is type(expected)
    assert_eq(result, expected)  # allclose: cuBLAS/cuFFT round differently from NumPy
    stats = eugo_dask.device_stats()
    assert stats["tasks"] > 0 and stats["fallbacks"] == 0, stats


def test_matmul_add_sum_counters_on_cupy(cupy_device):
    from .test_rewrite import A, B, matmul_add_sum

    assert_eq(matmul_add_sum().compute(scheduler="sync"), ((A @ B) + 1).sum())
    stats = eugo_dask.device_stats()
    assert stats["h2d_count"] == 10 and stats["d2h_count"] == 6


def test_out_of_memory_falls_back(cupy_device):
    import cupy

    pool = cupy.get_default_memory_pool()
    x = np.exp(da.ones((2000, 2000), chunks=1000)) * 2
    (planned,) = dask.optimize(x)
    pool.set_limit(size=1024)
    try:
        result = planned.compute(scheduler="sync")
    finally:
        pool.set_limit(size=0)
    np.testing.assert_allclose(result, np.exp(np.ones((2000, 2000))) * 2)
    assert eugo_dask.device_stats()["fallbacks"] > 0
