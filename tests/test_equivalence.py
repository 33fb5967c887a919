"""With the emulated device and min-speedup 0, every pipeline gives plain Dask's result.

Each case is computed twice, with and without eugo, and compared with ``assert_eq`` (values,
dtype, shape, chunk types). Every case also proves that the GPU path really ran, or that the
work stayed on the CPU for the reason the planner gives (object/string dtypes, random, I/O).
"""

from __future__ import annotations

import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import eugo_dask

from .pipelines import CASES, LazyArray, V, X, _x, _y


def _computed_with_warnings(collection):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = collection.compute(scheduler="sync")
    return result, [(w.category, str(w.message)) for w in caught]


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_result_as_plain_dask(name, emulated):
    build = CASES[name]
    with dask.config.set(optimizations=[]):
        expected, expected_warnings = _computed_with_warnings(build())
    eugo_dask.reset_device_stats()
    result_collection = build()
    result, result_warnings = _computed_with_warnings(result_collection)
    assert result_warnings == expected_warnings  # (none of planning's own)
    assert type(result) is type(expected)
    assert result.dtype == expected.dtype
    assert_eq(result, expected)
    if isinstance(result, np.ndarray):
        assert type(result) is np.ndarray
    # every chunk comes back as NumPy (arrays or NumPy scalars), as from plain Dask
    blocks = result_collection.map_blocks(
        lambda b: np.full((1,) * b.ndim, type(b).__module__ == "numpy"), dtype=bool
    ).compute(scheduler="sync")
    assert np.all(blocks)
    stats = eugo_dask.device_stats()
    assert stats["fallbacks"] == 0, stats["fallback_reasons"]
    plan = eugo_dask.explain(result_collection)
    assert (stats["tasks"] > 0) == bool(plan.gpu_keys), (stats, str(plan))


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: da.from_array(np.array(["a", "bb", "ccc"] * 10, dtype=object), chunks=10) * 2,
         "dtype object never offloads"),
        (lambda: da.from_array(np.array(["a", "bb", "ccc"] * 10), chunks=10) == "bb",
         "dtype <U3 never offloads"),
        (lambda: da.from_array(np.arange(30).astype("M8[s]"), chunks=10) + np.timedelta64(1, "s"),
         "never offloads"),
        (lambda: np.sin(da.from_array(np.arange(30.0).astype(">f8"), chunks=10)),
         "dtype >f8 never offloads"),
    ],
    ids=["object", "string", "datetime", "big-endian"],
)
def test_non_numeric_dtypes_stay_on_cpu(build, reason, emulated):
    with dask.config.set(optimizations=[]):
        expected = build().compute(scheduler="sync")
    x = build()
    result = x.compute(scheduler="sync")
    np.testing.assert_array_equal(result, expected)
    assert eugo_dask.device_stats()["tasks"] == 0
    plan = eugo_dask.explain(x)
    assert not plan.gpu_keys
    assert any(reason in d.reason for d in plan), str(plan)


def test_scalar_results_are_numpy_scalars(emulated):
    x = da.from_array(X, chunks=20)
    result = (x * 2)[1, 1].compute(scheduler="sync")
    assert type(result) is np.float64 and result == X[1, 1] * 2


def test_learning_with_unknown_chunk_sizes(emulated, tmp_path):
    x = da.from_array(np.arange(16.0).reshape(4, 4), chunks=2)
    mask = da.from_array(np.arange(4.0), chunks=2) > 1
    with dask.config.set({"eugo.learn": True, "eugo.history": str(tmp_path / "h.json")}):
        result = (x[:, mask] * 2).compute(scheduler="sync")
    np.testing.assert_array_equal(result, np.arange(16.0).reshape(4, 4)[:, 2:] * 2)


# ---------------------------------------------------------------------------------------------
# Reproductions: each changed a result, a type, or failed, before the conformance work
# ---------------------------------------------------------------------------------------------
def _x20x10():
    return da.from_array(np.random.default_rng(3).random((20, 10)), chunks=10)


LINALG = {
    "tsqr-svd-dot": lambda: (lambda u, s, vh: da.dot(u.T, u))(*da.linalg.tsqr(_x20x10(), compute_svd=True)),
    "qr": lambda: da.linalg.qr(_x20x10())[0] @ da.ones((10, 3), chunks=3),
    "svd": lambda: da.linalg.svd(_x20x10())[1] * 2,
    "svd_compressed": lambda: da.linalg.svd_compressed(_x20x10(), k=3, seed=0)[1] + 1,
    "lu": lambda: da.linalg.lu(da.from_array(np.random.default_rng(4).random((12, 12)), chunks=6))[2].sum(),
}


@pytest.mark.parametrize("min_speedup", [0, 2])
@pytest.mark.parametrize("name", sorted(LINALG))
def test_linear_algebra_pipelines(name, min_speedup, emulated):
    from eugo_dask.pass_log import pass_stats

    with dask.config.set(optimizations=[]):
        expected = LINALG[name]().compute(scheduler="sync")
    errors = pass_stats()["pass_errors"]
    with dask.config.set({"eugo.min-speedup": min_speedup}):
        result = LINALG[name]().compute(scheduler="sync")
    assert pass_stats()["pass_errors"] == errors  # the pass understood the graph
    assert type(result) is type(expected)
    assert_eq(result, expected)


def clip(block, lo, hi):
    """A user's function that happens to be called clip, and is not NumPy's."""
    if isinstance(block, np.ndarray):
        return np.clip(block, lo, hi)
    return block * 0


@pytest.mark.parametrize("name", ["clip", "sum", "where", "copy", "mean"])
def test_user_functions_named_like_numpy_stay_on_the_cpu(name, emulated):
    func = type(clip)(clip.__code__, clip.__globals__, name)  # the same body, any name
    x = da.from_array(X, chunks=20).map_blocks(func, 0.2, 0.8, dtype=X.dtype)
    result = x.compute(scheduler="sync")
    np.testing.assert_array_equal(result, np.clip(X, 0.2, 0.8))
    assert eugo_dask.device_stats()["tasks"] == 0
    assert any(f"unknown function {name}" in d.reason for d in eugo_dask.explain(x))


@pytest.mark.parametrize("build, kind", [
    (lambda: da.squeeze(da.from_array(np.full((1,), 2), chunks=1)), np.ndarray),
    (lambda: da.from_array(X, chunks=20).sum(0) @ da.from_array(V[:40], chunks=20), np.ndarray),
    (lambda: (da.from_array(X, chunks=20) * 2)[1, 1], np.float64),
], ids=["squeeze", "sum-matmul", "index"])
def test_zero_d_results_keep_their_type(build, kind, emulated):
    with dask.config.set(optimizations=[]):
        expected = build().compute(scheduler="sync")
    result = build().compute(scheduler="sync")
    assert type(expected) is kind and type(result) is kind
    assert np.ndim(result) == np.ndim(expected) == 0 and result == expected


def test_data_producers_keep_their_flag(emulated):
    from dask.base import collections_to_expr

    x = da.from_array(np.arange(64).reshape(8, 8), chunks=4).astype("f8")
    with dask.config.set(optimizations=[]):
        plain = collections_to_expr([x]).__dask_graph__()
    ours = collections_to_expr([x]).__dask_graph__()
    assert sum(v.data_producer for v in plain.values()) == 4
    assert sum(v.data_producer for v in ours.values()) == 4
    assert any(str(k[0]).startswith("eugo-gpu") for k in ours)  # the producers moved there


def test_one_chunk_read_is_split_from_its_compute(emulated):
    data = (np.random.default_rng(5).random((64, 64)) + 1j).astype("c8")
    x = da.fft.fft2(da.from_array(LazyArray(data), chunks=-1))
    with dask.config.set({"eugo.min-speedup": 2, "eugo.profile": "h200"}):
        plan = eugo_dask.explain(x, min_speedup=0)
    by_op = {d.op: d for d in plan}
    assert by_op["io"].device == "cpu" and by_op["fft"].device == "gpu"
    result = x.compute(scheduler="sync")
    np.testing.assert_allclose(result, np.fft.fft2(data), rtol=1e-4, atol=1e-3)
    assert eugo_dask.device_stats()["tasks"] == 1


def _warnings_shown_over_three_computes(settings):
    """Python's default filters: a warning shows once per place in the code."""
    shown = []
    with dask.config.set(settings), warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, category, *args, **kwargs: shown.append(category)
        roots = np.sqrt(da.from_array(-np.ones((40, 30)), chunks=(20, 15)))
        cast = da.from_array(np.ones((40, 30)) * (1 + 1j), chunks=(20, 15)).astype("f8")
        for _ in range(3):
            roots.compute(scheduler="sync")
            cast.compute(scheduler="sync")
    return shown


@pytest.mark.parametrize("min_speedup", [2.0, 0])  # (2.0: the default)
def test_planning_leaves_warnings_already_shown_alone(emulated, min_speedup):
    """Each warning shows on the first compute only, with eugo on as without it: planning
    neither warns of its own nor makes a warning already shown show again (the pass used
    warnings.catch_warnings, which resets every module's record of what it has shown, and
    swaps the filters under other threads)."""
    plain = _warnings_shown_over_three_computes({"optimizations": []})
    assert sorted(map(str, plain)) == sorted(map(str, [RuntimeWarning, np.exceptions.ComplexWarning]))
    eugo_dask.reset_device_stats()
    assert _warnings_shown_over_three_computes({"eugo.min-speedup": min_speedup}) == plain
    assert (eugo_dask.device_stats()["tasks"] > 0) == (min_speedup == 0)  # (the device ran)


# ---------------------------------------------------------------------------------------------
# Creation with array parameters: the creation stays on the host, whatever it is fused with
# ---------------------------------------------------------------------------------------------
def _lam():
    return np.abs(np.sin(_x())) * 5 + 1  # fused with the draws that read it


RANDOM_WITH_ARRAYS = {
    "poisson": lambda: da.random.default_rng(0).poisson(_lam(), chunks=20) + 1,
    "normal-loc": lambda: da.random.default_rng(0).normal(loc=_lam(), chunks=20) * 2,
    "uniform": lambda: da.random.default_rng(0).uniform(_lam(), _lam() + 1, chunks=20) * 2,
    "integers": lambda: da.random.default_rng(0).integers(_lam().astype(int), 100, chunks=20) * 2,
    "binomial": lambda: da.random.default_rng(0).binomial(_lam().astype(int), 0.5, chunks=20) * 2,
    "legacy-poisson": lambda: da.random.RandomState(0).poisson(_lam(), chunks=20) + 1,
    "numpy-loc": lambda: da.random.default_rng(0).normal(V[:40], size=(60, 40), chunks=20) * 2,
    "choice": lambda: da.random.default_rng(0).choice(da.arange(100, chunks=20) * 2, size=60,
                                                      chunks=20) * 2,
}


def _creation_stays_on_the_host(x):
    """Where the plan puts the tasks of ``x`` that draw from arrays: on the CPU, saying why."""
    plan = eugo_dask.explain(x)
    draws = [d for d in plan if "_apply_random" in d.reason or "_choice" in d.reason]
    assert draws and all(d.device == "cpu" for d in draws), str(plan)
    return plan


@pytest.mark.parametrize("name", sorted(RANDOM_WITH_ARRAYS))
def test_random_with_array_parameters_threads(name, emulated):
    """``rng.poisson(lam)`` with ``lam`` a dask array: inside a GPU task ``lam`` would be a
    device array, which NumPy's generator refuses (every chunk fell back)."""
    build = RANDOM_WITH_ARRAYS[name]
    with dask.config.set(optimizations=[]):
        expected = build().compute(scheduler="threads")
    assert eugo_dask.device_stats()["fallbacks"] == 0  # (none without eugo)
    x = build()  # (Dask computes an element of each parameter here, for the dtype)
    eugo_dask.reset_device_stats()
    result = x.compute(scheduler="threads")
    assert type(result) is type(expected) and result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)
    stats = eugo_dask.device_stats()
    assert stats["fallbacks"] == 0, stats["fallback_reasons"]
    plan = _creation_stays_on_the_host(x)
    assert (stats["tasks"] > 0) == bool(plan.gpu_keys), (stats, str(plan))


def test_random_with_array_parameters_on_a_cluster(emulated):
    from distributed.utils_test import gen_cluster

    from eugo_dask.testing import cpu_path_tasks, cpu_worker, device_tasks, emulated_settings, gpu_worker

    builds = {**RANDOM_WITH_ARRAYS, "matmul-poisson": lambda: da.random.default_rng(0).poisson(
        np.abs((_x() @ _y()).rechunk((20, 15))), chunks=(20, 15))}  # (the matmul: on the device)
    with dask.config.set(optimizations=[]):
        expected = {name: build().compute(scheduler="sync") for name, build in builds.items()}
    # made here: Dask computes an element of each parameter as it builds the draws (and a
    # collection draws from its generator once: choice's advances as it runs)
    cases = {name: build() for name, build in builds.items()}

    @gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
    async def run(client, scheduler, gpu, cpu):
        for name, x in cases.items():
            np.testing.assert_array_equal(await client.compute(x), expected[name], err_msg=name)
            assert cpu_path_tasks(gpu) == cpu_path_tasks(cpu) == 0, name
        assert device_tasks(gpu) > 0

    run()
