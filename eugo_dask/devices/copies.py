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
from typing import Any, Literal, NamedTuple

import numpy as np

from eugo_dask.devices.base import CopyRule, DeferringLock, DeviceSettings

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

    def pieces(self, nbytes: int, threads: int | None = None) -> int:
        """How many threads copy ``nbytes`` (at most ``threads``, and at most this copier's)."""
        most = self.threads if threads is None else min(max(int(threads), 1), self.threads)
        return max(min(most, nbytes // self.min_piece_bytes), 1)

    def copy(self, dst: np.ndarray, src: np.ndarray, threads: int | None = None) -> None:
        """``dst[:] = src`` for flat uint8 arrays of one size, split over at most ``threads``
        threads (None: this copier's)."""
        pieces = self.pieces(src.size, threads)
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


class CopyChoice(NamedTuple):
    """The path a copy takes (``direct``, ``staged``, ``registered`` or ``pinned``) and, for a
    staged one, the threads its host memcpy is split over."""

    path: str
    threads: int

    @property
    def name(self) -> str:
        """``staged-4``, ``registered``, …: how calibration and the GPU check name it."""
        return f"staged-{self.threads}" if self.path == "staged" else self.path


def nearest_rule(rules: tuple[CopyRule, ...], nbytes: int) -> CopyRule | None:
    """The rule measured nearest ``nbytes`` in log size (the larger of two as near), or None."""
    if not rules:
        return None
    at = math.log2(max(nbytes, 1))
    return min(reversed(rules), key=lambda rule: abs(math.log2(rule[0]) - at))


def choose_copy(settings: DeviceSettings, direction: str, nbytes: int) -> CopyChoice:
    """The path a copy of ``nbytes`` takes in ``direction`` (``h2d``/``d2h``) beyond the
    runtime's fixed rules (small copies direct, a pinned result back in one DMA).

    Where ``direction`` is in ``settings.per_size`` and the profile has points that way, the
    path of the point nearest ``nbytes``; else the config's rule: to the device page-locked in
    place from ``register_min_bytes`` (None: never), else staged; back into a pinned block from
    ``pinned_results_min_bytes``, else staged. Never pinned where the pool's cap is 0. A staged
    copy's threads: where ``"threads"`` is in ``per_size``, those of the nearest staged point
    that way, else (and where there is none) ``copy_threads``."""
    rules = settings.h2d_by_size if direction == "h2d" else settings.d2h_by_size
    rule = nearest_rule(rules, nbytes) if direction in settings.per_size else None
    if rule is not None:
        path = rule[1]
    elif direction == "h2d":
        least = settings.register_min_bytes
        path = "registered" if least is not None and nbytes >= least else "staged"
    else:
        path = "pinned" if nbytes >= settings.pinned_results_min_bytes else "staged"
    if path == "pinned" and settings.pinned_results_bytes <= 0:
        path = "staged"
    threads = settings.copy_threads
    if "threads" in settings.per_size:
        staged = nearest_rule(tuple(r for r in rules if r[1] == "staged"), nbytes)
        if staged is not None and staged[2]:
            threads = staged[2]
    return CopyChoice(path, threads)


def copy_candidates(settings: DeviceSettings, direction: str, nbytes: int,
                    cores: int) -> list[CopyChoice]:
    """The copies the runtime could take for ``nbytes`` in ``direction`` with ``settings``
    (no per-size points yet): what calibration measures to choose from. Where the direction is
    per size, every path (direct, staged, and registered to the device or pinned back where the
    pool's cap allows), else the config's path; staged on 1, 2, 4 and 8 threads (at most
    ``cores``) where the threads are per size, else on ``copy_threads``."""
    if direction in settings.per_size:
        extra = "registered" if direction == "h2d" else "pinned"
        paths = ["direct", "staged"] + ([extra] if extra == "registered" or settings.pinned_results_bytes > 0 else [])
    else:
        paths = [choose_copy(settings, direction, nbytes).path]
    if "threads" in settings.per_size:
        threads = sorted({min(n, max(cores, 1)) for n in (1, 2, 4, 8)})
    else:
        threads = [settings.copy_threads]
    return [CopyChoice(path, n) for path in paths for n in (threads if path == "staged" else [1])]


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
        """Drop the free blocks (calibration gives back what its measurements held); the bytes
        dropped."""
        with self._lock:
            dropped = sum(size * len(blocks) for size, blocks in self._free.items())
            self._free.clear()
            self._held -= dropped
        return dropped
