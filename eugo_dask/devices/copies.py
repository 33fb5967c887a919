"""The host half of the copy engine: host memcpy split over threads (:class:`HostCopier`) and
host arrays for results from a bounded pool of pinned blocks (:class:`ResultPool`).

A copy between a GPU and Dask's (pageable) chunks goes through pinned staging buffers
(:mod:`eugo_dask.devices.cuda`): the DMA runs at the link's rate (53-55 GB/s measured on an H200
host, PCIe Gen5), the host memcpy into or out of the staging buffer at one core's (about 10 GB/s
there), and a new result array's first touch (a page fault per 4 KiB) on top. That memcpy,
split over a few threads, is no longer one core's; a result copied into a pinned block from a
pool needs no staging at all, and its pages are touched already. Nothing here imports CuPy:
the pool is handed the allocator (pinned memory on CuPy), so both halves are measured and
tested on any machine (``benchmarks/copy_engine.py``, ``tests/test_devices.py``).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from eugo_dask.devices.base import DeferringLock

#: Pieces start on this boundary (a page), so no two threads write one page.
PIECE_ALIGN = 4096


def split_bounds(nbytes: int, pieces: int, align: int = PIECE_ALIGN) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges that cover ``nbytes`` in at most ``pieces`` pieces of about
    equal size, each starting on ``align`` (the last takes the odd rest)."""
    if nbytes <= 0:
        return []
    step = max(math.ceil(nbytes / max(pieces, 1) / align) * align, align)
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


class HostCopier:
    """Copies between flat byte arrays split over ``threads`` threads: the calling thread
    copies the first piece, a pool shared by every caller the others (NumPy's copy releases
    the GIL). A copy is split only into pieces of at least ``min_piece_bytes``: a small copy
    costs less than handing pieces to threads. The pool is made on first use, and made again
    in a forked child (a parent's threads do not exist there)."""

    def __init__(self, threads: int, min_piece_bytes: int) -> None:
        self.threads = max(int(threads), 1)
        self.min_piece_bytes = max(int(min_piece_bytes), PIECE_ALIGN)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def pieces(self, nbytes: int) -> int:
        """How many threads copy ``nbytes``."""
        return max(min(self.threads, nbytes // self.min_piece_bytes), 1)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src`` for flat uint8 arrays of one size, split over threads."""
        pieces = self.pieces(src.size)
        if pieces <= 1:
            np.copyto(dst, src)
            return
        bounds = split_bounds(src.size, pieces)
        pool = self._executor()
        futures = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in bounds[1:]]
        a, b = bounds[0]
        try:
            np.copyto(dst[a:b], src[a:b])
        finally:
            for future in futures:
                future.result()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            with self._lock:
                if self._pool is None or self._pid != pid:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        self.threads - 1, thread_name_prefix="eugo-copy")
                    self._pid = pid
        return self._pool


def _size_class(nbytes: int) -> int:
    """The block size a result of ``nbytes`` takes: the next of 1, 1.25, 1.5, 1.75 times a power
    of two (at most a quarter wasted; chunks of one array share a class and reuse blocks)."""
    top = 1 << max(nbytes - 1, 1).bit_length()
    for quarter in (4, 5, 6, 7):
        size = top // 8 * quarter
        if size >= nbytes:
            return size
    return top


class ResultPool:
    """Host arrays for copies back, in blocks from ``allocate`` (pinned memory on CuPy), at most
    ``limit_bytes`` of them held, given out for results of at least ``min_bytes``. A block
    comes back to the pool when its array (and every view of it) is gone, and serves the next
    result of its size class; where the pool is full, free blocks of other sizes are dropped,
    and where that is not enough :meth:`empty` gives None (the caller stages into a plain
    array)."""

    def __init__(self, allocate: Callable[[int], Any], limit_bytes: int, *, min_bytes: int) -> None:
        self._allocate = allocate
        self.limit_bytes, self.min_bytes = int(limit_bytes), int(min_bytes)
        self._lock = DeferringLock()  # blocks come back from finalizers
        self._free: defaultdict[int, list[Any]] = defaultdict(list)
        self._held = 0
        self._given: set[int] = set()  # addresses of the arrays given out and alive

    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def free_bytes(self) -> int:
        with self._lock:
            return sum(size * len(blocks) for size, blocks in self._free.items())

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` starts where an array this pool gave out starts (it, or a whole
        view of it such as its flat bytes): its memory is a pool block."""
        address = int(array.ctypes.data)
        with self._lock:  # the deferred returns first: a freed block is no longer owned
            return address in self._given

    def empty(self, shape: tuple[int, ...], dtype: Any, order: Literal["C", "F"] = "C") -> np.ndarray | None:
        """A new array in a pool block, or None where the result is too small or too large, or
        the pool has no room."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < max(self.min_bytes, 1) or nbytes > self.limit_bytes:
            return None
        size = _size_class(nbytes)
        block = self._take(size)
        if block is None:
            return None
        array = np.ndarray(shape, dtype=dtype, buffer=memoryview(block)[:nbytes], order=order)
        address = int(array.ctypes.data)
        with self._lock:
            self._given.add(address)
        weakref.finalize(array, self._lock.defer, self._give_back, size, block, address)
        return array

    def _take(self, size: int) -> Any | None:
        with self._lock:
            free = self._free[size]
            if free:
                return free.pop()
            while self._held + size > self.limit_bytes:
                other = next((s for s, blocks in self._free.items() if blocks), None)
                if other is None:
                    return None
                self._free[other].pop()
                self._held -= other
            self._held += size
        try:
            return self._allocate(size)
        except BaseException:
            with self._lock:
                self._held -= size
            raise

    def _give_back(self, size: int, block: Any, given: int) -> None:
        """A result's array is gone: its block serves the next (under the pool's lock)."""
        self._given.discard(given)
        self._free[size].append(block)

    def clear(self) -> int:
        """Drop the free blocks (an idle or out-of-memory release); the bytes dropped."""
        with self._lock:
            dropped = sum(size * len(blocks) for size, blocks in self._free.items())
            self._free.clear()
            self._held -= dropped
        return dropped
