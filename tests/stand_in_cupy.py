"""Worker preload for tests: this worker's CuPy is the stand-in (tests/fake_cupy.py), one CUDA
device on host memory, so that its runtime builds and copies through a real ``CupyDevice``
(copy paths, staging, page-locking, pinned results) without a GPU. The repository must be on the
worker's path (``PYTHONPATH``)."""

import sys

import numpy as np
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from eugo_dask import runtime
from eugo_dask.devices import CupyDevice
from tests import fake_cupy


def _serialize(array):
    """As distributed's serializers for CuPy arrays do: the device memory as a host frame."""
    fake_cupy.synchronize_device()
    return {"shape": array.shape, "dtype": array.dtype.str}, [np.ascontiguousarray(array.peek()).data]


def _deserialize(header, frames):
    array = fake_cupy.empty(tuple(header["shape"]), header["dtype"])
    array.peek()[...] = np.frombuffer(frames[0], header["dtype"]).reshape(header["shape"])
    return array


def dask_setup(worker):
    module = fake_cupy.module(device_count=1)
    for name, value in (("cupy", module), ("cupy.fft", module.fft), ("cupy.fft.config", module.fft.config)):
        sys.modules[name] = value
    dask_serialize.register(fake_cupy.ndarray)(_serialize)
    dask_deserialize.register(fake_cupy.ndarray)(_deserialize)
    runtime.cupy_device_count = lambda: 1
    runtime.import_cupy = lambda: module
    CupyDevice.probe = lambda self: None
