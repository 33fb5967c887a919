"""Device bytes kept apart from host memory.

A worker's spill buffer weighs values by their host bytes only (:func:`install_device_accounting`),
so device results are not spilled to disk for the host's sake; :func:`device_nbytes` tells the
device bytes a value holds.
"""

from __future__ import annotations

import contextlib
from typing import Any

from eugo_dask.devices.base import _walk

#: Types whose instances hold device memory without ``__cuda_array_interface__`` (the
#: emulated device registers its array type).
DEVICE_ARRAY_TYPES: set[type] = set()


def device_nbytes(value: Any) -> int:
    """Bytes of device memory held by the arrays in ``value`` (nested lists, tuples, dicts):
    anything with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch CUDA tensors) and the
    emulated device's arrays."""
    total = 0

    def visit(v: Any) -> None:
        nonlocal total
        cls = type(v)
        if cls in DEVICE_ARRAY_TYPES or hasattr(cls, "__cuda_array_interface__"):
            total += int(getattr(v, "nbytes", 0))

    _walk(value, visit)
    return total


def install_device_accounting(worker: Any) -> bool:
    """Make ``worker``'s spill buffer weigh values by their host bytes only.

    distributed weighs every stored value with ``sizeof``, which counts a CuPy array's device
    bytes; past the worker's memory target (60% of its memory limit) device results would be
    copied to the host and pickled to disk for the host's sake. Afterwards device bytes are
    left out of that weight (they are bounded by the device's pool limit instead) while
    ``sizeof``, which the scheduler also uses to price moving a key between workers, is
    unchanged. Idempotent; returns False where the worker's store is no zict buffer (dask-cuda
    brings its own device-aware store)."""
    data: Any = getattr(worker, "data", None)
    fast: Any = getattr(data, "fast", None)
    if data is None or fast is None or not hasattr(fast, "weights") or not callable(getattr(fast, "weight", None)):
        return False
    if getattr(data, "_eugo_device_accounting", False):
        return True
    original = fast.weight

    def host_weight(key: Any, value: Any) -> float:
        return max(original(key, value) - device_nbytes(value), 0)

    lock = getattr(fast, "lock", None) or contextlib.nullcontext()
    with lock:
        fast.weight = host_weight
        if hasattr(data, "weight"):
            data.weight = host_weight
        for key in list(fast.weights):
            new = host_weight(key, fast.d[key])
            fast.total_weight += new - fast.weights[key]
            fast.weights[key] = new
        data._eugo_device_accounting = True
    return True
