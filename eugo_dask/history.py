"""Learning from observed runtimes: measured task durations refine the cost model's estimates.

With ``eugo.learn: true`` the pass remembers, for every task it planned, its op family, the
device it chose and the bytes it touches. When the task has run — timed by a Dask callback on the
local schedulers, or from the worker's report in the scheduler plugin — its duration is recorded
per (op family, device, size bucket), in seconds per byte. Estimates use the median of those
records once there are enough of them, and the plan shows predicted next to measured.

Robust by construction (StarPU's history models were poisoned by 100 ms spikes on 190 us tasks
and piled work onto 2 of 8 GPUs, starpu-runtime/starpu#50):

- the first sample of each bucket is discarded (warm-up: imports, plan caches, allocation);
- nothing overrides the profile before ``min_samples`` samples;
- a sample more than ``spike_factor`` times the median absolute deviation above the median is
  rejected (counted, not stored);
- estimates are medians of the most recent ``max_samples`` samples.

The history is saved as JSON (``eugo.history``, default ``~/.cache/eugo-dask/history-<machine>
.json``) and read back by later runs on the same machine.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from dask.typing import Key

from eugo_dask.files import UnsafeLocation, cache_dir, machine_id, read_json, write_json_atomic
from eugo_dask.ops import Family, Placement

logger = logging.getLogger(__name__)

MIN_SAMPLES = 5
SPIKE_FACTOR = 5.0
MAX_SAMPLES = 64
#: The largest size bucket (:func:`size_bucket` of the largest float).
MAX_BUCKET = 1024


def size_bucket(nbytes: float) -> int:
    """Sizes within a factor of two share a bucket."""
    return int(math.log2(max(nbytes, 1)))


class RuntimeHistory:
    """Observed task durations per (op family, device, size bucket)."""

    def __init__(self, path: str | os.PathLike | None = None, *, min_samples: int = MIN_SAMPLES,
                 spike_factor: float = SPIKE_FACTOR, max_samples: int = MAX_SAMPLES) -> None:
        self.path = Path(path) if path is not None else None
        self.min_samples, self.spike_factor, self.max_samples = min_samples, spike_factor, max_samples
        self._samples: dict[tuple[str, str, int], list[float]] = defaultdict(list)
        self._warmed: set[tuple[str, str, int]] = set()
        self.rejected = 0
        self._lock = threading.Lock()
        self._dirty = 0
        if self.path is not None and self.path.exists():
            self.load()

    def record(self, op: Family, placement: Placement, nbytes: float, seconds: float) -> bool:
        """Record one observed duration; False where it was discarded (warm-up) or rejected
        (spikes, and anything that is not a finite, non-negative duration)."""
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(nbytes) and nbytes >= 0):
            with self._lock:
                self.rejected += 1
            return False
        key = (op, placement, size_bucket(nbytes))
        per_byte = seconds / max(nbytes, 1)
        with self._lock:
            if key not in self._warmed:
                self._warmed.add(key)
                return False
            samples = self._samples[key]
            if len(samples) >= self.min_samples:
                median = statistics.median(samples)
                mad = statistics.median(abs(s - median) for s in samples)
                if per_byte > median + self.spike_factor * max(mad, 0.05 * median):
                    self.rejected += 1
                    return False
            samples.append(per_byte)
            del samples[: -self.max_samples]
            self._dirty += 1
        return True

    def estimate(self, op: Family, placement: Placement, nbytes: float) -> float | None:
        """Median observed seconds for a task of this kind and size, or None without enough
        samples."""
        samples = self._samples.get((op, placement, size_bucket(nbytes)))
        if not samples or len(samples) < self.min_samples:
            return None
        return statistics.median(samples) * max(nbytes, 1)

    def digest(self) -> str:
        """A token of what has been learned (plans made from it differ when it does)."""
        from dask.base import tokenize

        with self._lock:
            return tokenize(sorted((k, tuple(v)) for k, v in self._samples.items()))

    def __len__(self) -> int:
        return sum(len(s) for s in self._samples.values())

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "buckets": [{"op": op, "device": dev, "bucket": b, "s_per_byte": list(s)}
                        for (op, dev, b), s in self._samples.items()],
        }

    def save(self) -> None:
        if self.path is None or not self._dirty:
            return
        try:
            write_json_atomic(self.path, self.to_dict())
            self._dirty = 0
        except UnsafeLocation:  # refused, and said once (eugo_dask.files)
            pass
        except OSError as e:  # a read-only home must not break a computation
            logger.warning("eugo: cannot save runtime history to %s: %s", self.path, e)

    def load(self) -> None:
        """Read the saved history. It may have been edited by hand or by someone else, and it
        must never make the pass fail: a file that cannot be read or parsed is ignored, a
        malformed entry is dropped and the rest used, impossible durations are dropped from
        their entry, each said once in a warning naming the file."""
        if self.path is None:
            return
        try:
            entries = read_json(self.path)["buckets"]
            if not isinstance(entries, list):
                raise TypeError(f"'buckets' is a {type(entries).__name__}, not a list")
        except UnsafeLocation:  # refused, and said once (eugo_dask.files)
            return
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            logger.warning("eugo: ignoring unreadable runtime history %s: %s", self.path, e)
            return
        malformed = dropped = 0
        for entry in entries:
            parsed = _parse_entry(entry)
            if parsed is None:
                malformed += 1
                continue
            key, samples = parsed
            kept = [x for x in samples if math.isfinite(x) and x >= 0]
            dropped += len(samples) - len(kept)
            self._samples[key] = kept[-self.max_samples:]
            self._warmed.add(key)
        if malformed:
            logger.warning("eugo: ignoring %d malformed entries of runtime history %s (an entry "
                           "is {\"op\": string, \"device\": string, \"bucket\": integer 0-%d, "
                           "\"s_per_byte\": list of numbers})", malformed, self.path, MAX_BUCKET)
        if dropped:
            logger.warning("eugo: ignoring %d negative or non-finite durations in %s", dropped,
                           self.path)


def _parse_entry(entry: Any) -> tuple[tuple[str, str, int], list[float]] | None:
    """A saved entry as its key and durations, or None where it is malformed."""
    if not isinstance(entry, dict):
        return None
    op, device, bucket, samples = (entry.get(k) for k in ("op", "device", "bucket", "s_per_byte"))
    if not (isinstance(op, str) and isinstance(device, str) and isinstance(samples, list)
            and isinstance(bucket, (int, float)) and not isinstance(bucket, bool)
            and 0 <= bucket <= MAX_BUCKET and bucket == int(bucket)):
        return None
    durations = [_duration(x) for x in samples]
    numbers = [d for d in durations if d is not None]
    if len(numbers) < len(durations):
        return None
    return (op, device, int(bucket)), numbers


def _duration(value: Any) -> float | None:
    """A saved duration as a float (infinite past the floats' range), None where it is no
    number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Process-wide history and the tasks waiting to be timed
# ---------------------------------------------------------------------------------------------
_histories: dict[str, RuntimeHistory] = {}
#: key -> (op, placement, nbytes, history) of planned tasks not yet observed
pending: dict[Key, tuple[Family, Placement, float, RuntimeHistory]] = {}
_PENDING_LIMIT = 2_000_000


def default_history_path() -> Path:
    """``~/.cache/eugo-dask/history-<machine>.json``."""
    return cache_dir() / f"history-{machine_id()}.json"


def get_history(path: str | None = None) -> RuntimeHistory:
    """The process's history for ``path`` (``eugo.history``; None: the per-machine default)."""
    resolved = str(path or default_history_path())
    history = _histories.get(resolved)
    if history is None:
        history = _histories[resolved] = RuntimeHistory(resolved)
    return history


def save_all() -> None:
    """Save every history this process has used."""
    for history in _histories.values():
        history.save()


def expect(tasks: dict[Key, tuple[Family, Placement, float, RuntimeHistory]]) -> None:
    """Remember planned tasks so their observed durations can be attributed."""
    if len(pending) + len(tasks) > _PENDING_LIMIT:
        pending.clear()  # stale entries of graphs that never ran
    pending.update(tasks)


def observe(key: Key, seconds: float) -> None:
    """A planned task ran for ``seconds``: record it in its plan's history."""
    info = pending.pop(key, None)
    if info is not None:
        op, placement, nbytes, history = info
        history.record(op, placement, nbytes, seconds)
        if history._dirty >= 1000:
            history.save()


class LearningCallback:
    """Times tasks on Dask's local schedulers (threads, sync, processes) for the history."""

    def __init__(self, history: RuntimeHistory) -> None:
        from dask.callbacks import Callback

        self.history = history
        self._start: dict[Key, float] = {}
        outer = self

        class _Timer(Callback):
            def _pretask(self, key, dsk, state):
                if key in pending:
                    outer._start[key] = time.perf_counter()

            def _posttask(self, key, result, dsk, state, worker_id):
                start = outer._start.pop(key, None)
                if start is not None:
                    observe(key, time.perf_counter() - start)

            def _finish(self, dsk, state, errored):
                outer.history.save()

        self.callback = _Timer()


_callbacks: dict[str, LearningCallback] = {}


def ensure_local_timing(history: RuntimeHistory) -> None:
    """Register (once per history) the callback that times local-scheduler tasks."""
    key = str(history.path)
    if key not in _callbacks:
        _callbacks[key] = LearningCallback(history)
        _callbacks[key].callback.register()
