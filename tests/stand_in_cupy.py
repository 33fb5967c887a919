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


def install(set_module=sys.modules.__setitem__, set_attribute=setattr):
    """Make the stand-in this process's CuPy, with one device, for eugo's runtime: the modules
    through ``set_module(name, module)`` and the runtime's probes through ``set_attribute(owner,
    name, value)`` (a test's ``monkeypatch`` undoes them after). Returns the stand-in module."""
    module = fake_cupy.module(device_count=1)
    for name, value in (("cupy", module), ("cupy.fft", module.fft), ("cupy.fft.config", module.fft.config)):
        set_module(name, value)
    set_attribute(runtime, "cupy_device_count", lambda: 1)
    set_attribute(runtime, "import_cupy", lambda: module)
    set_attribute(CupyDevice, "probe", lambda self: None)
    return module


def dask_setup(worker):
    install()
    dask_serialize.register(fake_cupy.ndarray)(_serialize)
    dask_deserialize.register(fake_cupy.ndarray)(_deserialize)
