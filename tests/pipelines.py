"""Computations and data several test modules share (so that no test module imports another):
the equivalence cases, a stored array read through a getter, the rewrite's matmul, and the
pipelines the cluster tests run."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np

rng = np.random.default_rng(42)  # (the equivalence cases')
X = rng.random((60, 40))
Y = rng.random((40, 30))
V = rng.random(60)


def _x():
    return da.from_array(X, chunks=(20, 20))


def _y():
    return da.from_array(Y, chunks=(20, 15))


CASES = {
    # elementwise chains and broadcasting
    "chain": lambda: np.exp(np.sin(_x()) + 1) * 2,
    "broadcast-row": lambda: _x() + da.from_array(X[0], chunks=20),
    "broadcast-col": lambda: _x() * da.from_array(V, chunks=20)[:, None],
    "scalar-ops": lambda: (_x() ** 2 - 3) / 7,
    "comparison": lambda: (_x() > 0.5).astype("i4"),
    "where": lambda: da.where(_x() > 0.5, _x(), -_x()),
    "clip": lambda: da.clip(_x(), 0.2, 0.8),
    "float32": lambda: np.sqrt(_x().astype("f4")) * np.float32(3),
    "complex": lambda: _x() * 1j + np.cos(_x()),
    "complex-to-real": lambda: (_x() * (1 + 1j)).astype("f4"),  # (NumPy warns per chunk)
    "int": lambda: (_x() * 100).astype("i8") // 3,
    # contractions
    "matmul": lambda: _x() @ _y(),
    "matmul-chain": lambda: (_x() @ _y()) + 1,
    "dot": lambda: da.dot(_x(), _y()),
    "tensordot": lambda: da.tensordot(_x(), _y(), axes=(1, 0)),
    "einsum": lambda: da.einsum("ij,jk->ik", _x(), _y()),
    "outer-matmul": lambda: _x() @ _x().T,
    # fft
    "fft": lambda: da.fft.fft(_x().rechunk((20, 40)), axis=1),
    "fft2": lambda: da.fft.fft2(_x().rechunk((60, 40))),
    "rfft": lambda: da.fft.rfft(_x().rechunk((20, 40))),
    # reductions
    "sum": lambda: _x().sum(),
    "sum-axis": lambda: _x().sum(axis=0),
    "mean": lambda: _x().mean(axis=1),
    "std": lambda: _x().std(),
    "var-axis": lambda: _x().var(axis=0),
    "min": lambda: _x().min(),
    "max-axis": lambda: _x().max(axis=1),
    "argmax": lambda: _x().argmax(axis=0),
    "argmin": lambda: _x().argmin(),
    "nansum": lambda: da.nansum(da.where(_x() > 0.9, np.nan, _x())),
    "nanmean": lambda: da.nanmean(da.where(_x() > 0.9, np.nan, _x()), axis=0),
    "nanmax": lambda: da.nanmax(da.where(_x() > 0.9, np.nan, _x())),
    "prod": lambda: (_x() + 0.5).prod(axis=0),
    "any": lambda: (_x() > 0.99).any(),
    "split-every": lambda: _x().sum(split_every=2),
    "cumsum": lambda: _x().cumsum(axis=0),
    "cumprod": lambda: (_x() + 0.5).cumprod(axis=1),
    # data movement
    "rechunk": lambda: (_x() + 1).rechunk((30, 10)),
    "slicing": lambda: (_x() * 2)[5:47:3, ::-2],
    "fancy-index": lambda: (_x() * 2)[[0, 5, 33, 59]],
    "bool-index": lambda: (_x() * 2)[V > 0.5],
    "transpose": lambda: (_x() + 1).T,
    "reshape": lambda: (_x() + 1).rechunk((20, 40)).reshape(2400),
    "concatenate": lambda: da.concatenate([_x() + 1, _x() * 2], axis=0),
    "stack": lambda: da.stack([_x() + 1, _x() * 2]),
    # user functions
    "map_blocks-ufunc": lambda: _x().map_blocks(np.tanh),
    "map_blocks-python": lambda: _x().map_blocks(lambda b: b * 2 + 1),
    "map_overlap": lambda: (_x() + 1).map_overlap(lambda b: b + np.roll(b, 1, 0), depth=1,
                                                  boundary="reflect"),
    # creation
    "random": lambda: da.random.default_rng(7).random((60, 40), chunks=20) * 2,
    "random-legacy": lambda: da.random.RandomState(7).normal(size=(60, 40), chunks=20) + 1,
    "ones": lambda: da.ones((60, 40), chunks=20) + _x(),
    "arange": lambda: da.arange(120, chunks=40) ** 2,
    "linspace": lambda: np.sin(da.linspace(0, 1, 90, chunks=30)),
    # from_array of a lazy (getter) source
    "from_array-lazy": lambda: da.from_array(LazyArray(X), chunks=20) * 3,
}


class LazyArray:
    """An array-like read through ``getter`` (what zarr/h5py arrays look like to dask)."""

    def __init__(self, data):
        self._data = data
        self.shape, self.dtype, self.ndim = data.shape, data.dtype, data.ndim

    def __getitem__(self, index):
        return self._data[index]


# --- the rewrite's matmul: 3x2 chunks @ 2x2 chunks, + 1, summed
MATMUL_A = np.random.default_rng(0).random((300, 200))
MATMUL_B = np.random.default_rng(1).random((200, 240))


def matmul_add_sum():
    a = da.from_array(MATMUL_A, chunks=(100, 100))  # 3x2 chunks
    b = da.from_array(MATMUL_B, chunks=(100, 120))  # 2x2 chunks
    return ((a @ b) + 1).sum()


# --- the cluster tests' pipeline: a stored array read, matmul, elementwise, reduction
_pipeline_rng = np.random.default_rng(11)
PIPELINE_A = _pipeline_rng.random((240, 160))
PIPELINE_B = _pipeline_rng.random((160, 200))
EXPECTED = (np.tanh(PIPELINE_A @ PIPELINE_B) * 2).sum(axis=0)


def pipeline():
    """Read (I/O) -> matmul -> elementwise -> reduction."""
    a = da.from_array(LazyArray(PIPELINE_A), chunks=(80, 80))
    b = da.from_array(PIPELINE_B, chunks=(80, 100))
    return (np.tanh(a @ b) * 2).sum(axis=0)


def row_sums():
    """A computation long enough to kill a worker during it, and its result."""
    a = da.random.default_rng(5).random((2000, 2000), chunks=(100, 2000))
    x = np.exp(np.sin(a) ** 2).sum(axis=1)
    with dask.config.set(optimizations=[]):
        return x, x.compute(scheduler="sync")
