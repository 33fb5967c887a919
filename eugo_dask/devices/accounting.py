"""Device bytes kept apart from host memory.

A worker's spill buffer weighs values by their host bytes only and never evicts a device value
to disk for the host's sake (:func:`install_device_accounting`); :func:`device_nbytes` tells the
device bytes a value holds. Host memory eugo holds for no value (the free blocks of the pinned
result pool, :data:`HOST_CACHES`) is given back before a value is spilled.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any

from eugo_dask.devices.base import _walk
from eugo_dask.devices.stats import _stats

#: Types whose instances hold device memory without ``__cuda_array_interface__`` (the
#: emulated device registers its array type).
DEVICE_ARRAY_TYPES: set[type] = set()

#: Holders of host memory that no stored value owns, each with ``clear() -> int`` (the bytes it
#: gave back): the CuPy device's pinned result pool adds itself. A value copied back into a
#: pinned block weighs its bytes like any host array (``sizeof``); once it is spilled its
#: block is free but still held, so process memory does not fall until the pool gives it back.
HOST_CACHES: weakref.WeakSet[Any] = weakref.WeakSet()

_NO_KEY = object()


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
    """Make ``worker``'s spill buffer weigh values by their host bytes only, and evict only
    values that hold no device memory.

    distributed weighs every stored value with ``sizeof``, which counts a CuPy array's device
    bytes; past the worker's memory target (60% of its memory limit) device results would be
    copied to the host and pickled to disk for the host's sake. Afterwards device bytes are
    left out of that weight (they are bounded by the device's pool limit instead) while
    ``sizeof``, which the scheduler also uses to price moving a key between workers, is
    unchanged.

    Weight alone does not keep them in memory: when *process* memory passes the spill threshold
    the memory monitor calls ``evict()`` until it falls below target, and ``evict()`` takes the
    least recently used value whatever it weighs. A device value evicted there frees no host
    memory (it is copied back and pickled), so the loop went on until every device value was
    on disk. Eviction now skips values holding device memory (:func:`_host_only_evict`), and
    the buffer's ``evict()`` reports failure (-1, which ends the loop) when only they are left.

    Idempotent; returns False where the worker's store is no zict buffer (dask-cuda brings its
    own device-aware store)."""
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
        fast.evict = _host_only_evict(fast, fast.evict)
        if callable(getattr(data, "evict", None)):
            data.evict = _evict_or_fail(data.evict)
        data._eugo_device_accounting = True
    return True


class _OnlyDeviceValues(KeyError):
    """Every value left in memory holds device memory: nothing to evict for the host's sake."""


def _host_only_evict(fast: Any, evict: Callable[..., Any]) -> Callable[..., Any]:
    """``fast.evict`` (zict's LRU) choosing, where no key is named, the least recently used value
    that holds no device memory (heavy ones first, as zict does); a KeyError where there is
    none, which zict's own eviction loop takes as "done"."""
    lock = getattr(fast, "lock", None) or contextlib.nullcontext()

    def host_only_evict(key: Any = _NO_KEY) -> Any:
        if key is _NO_KEY:
            with lock:
                key = next((k for k in itertools.chain(fast.heavy, fast.order)
                            if k in fast.d and not device_nbytes(fast.d[k])), _NO_KEY)
            if key is _NO_KEY:
                raise _OnlyDeviceValues("evict(): only device values are in memory")
        return evict(key)

    return host_only_evict


def release_host_caches() -> int:
    """Give back the host memory of :data:`HOST_CACHES` (counted in ``pinned_released_bytes``);
    the bytes given back."""
    released = sum(int(cache.clear()) for cache in list(HOST_CACHES))
    if released:
        _stats.add(pinned_released_bytes=released)
    return released


def _evict_or_fail(evict: Callable[[], int]) -> Callable[[], int]:
    """A spill buffer's ``evict()`` (called by distributed's memory monitor while process memory
    is past the spill threshold, once per value, until it falls below target) that first gives
    back host memory no value holds (:func:`release_host_caches`: the free blocks of values
    spilled before), and returns -1 (distributed: "could not evict", which ends the loop) where
    only device values are in memory."""
    def evict_or_fail() -> int:
        released = release_host_caches()
        if released:
            return released
        try:
            return evict()
        except _OnlyDeviceValues:
            return -1

    return evict_or_fail
