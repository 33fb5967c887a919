"""Device tasks per second: eugo's task scope and staged copies against plain CuPy calls.

A GPU-only diagnostic, not run by the tests. Each task copies a float32 chunk of 1-32 MiB (17 MiB
on average) to the device, doubles it and copies the result back; the same work runs

- ``eugo``: in a task scope (``CupyDevice.task``) with the runtime's copies,
- ``plain``: ``cupy.asarray`` / ``cupy.asnumpy`` on the default stream,
- ``plain_nb``: the same on a non-blocking stream per thread, as eugo's scope uses,

on 1 and 4 threads for 2.5 s each, with staging buffers of 8 MiB (the default), none, and
32 MiB. Then each phase's time on one thread, and a profile of the eugo path. From the repo root,
with Dask importable: ``python3 scripts/device_throughput.py``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import threading
import time
from collections.abc import Callable

import cupy
import numpy as np

from eugo_dask.devices import CupyDevice, DeviceSettings

_rng = np.random.default_rng(0)
HOSTS = [_rng.random(int(n), dtype=np.float32) for n in _rng.integers(1 << 18, 1 << 23, 24)]
_local = threading.local()


def eugo_task(device: CupyDevice, i: int) -> None:
    with device.task():
        device.to_host(device.to_device(HOSTS[i % len(HOSTS)]) * 2)


def plain_task(i: int) -> None:
    cupy.asnumpy(cupy.asarray(HOSTS[i % len(HOSTS)]) * 2)


def plain_non_blocking_task(i: int) -> None:
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plain_task(i)
        stream.synchronize()


def tasks_per_second(task: Callable[[int], None], threads: int, seconds: float = 2.5) -> float:
    stop = time.monotonic() + seconds
    done = [0] * threads

    def work(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            task(i)
            i += threads
            done[k] += 1

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def phases(device: CupyDevice, count: int = 48) -> dict[str, float]:
    """Milliseconds per task in each phase of the eugo path, on this thread."""
    total = dict.fromkeys(("h2d", "op", "d2h", "scope exit"), 0.0)
    for i in range(count):
        t0 = time.perf_counter()
        with device.task():
            x = device.to_device(HOSTS[i % len(HOSTS)])
            t1 = time.perf_counter()
            y = x * 2
            t2 = time.perf_counter()
            device.to_host(y)
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        for name, seconds in zip(total, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            total[name] += seconds
    return {name: round(seconds / count * 1e3, 2) for name, seconds in total.items()}


def main() -> None:
    print(f"mean chunk {np.mean([h.nbytes for h in HOSTS]) / 2**20:.1f} MiB", flush=True)
    for label, staging in (("staging 8 MiB", 8 << 20), ("no staging", 0), ("staging 32 MiB", 32 << 20)):
        device = CupyDevice(cupy, DeviceSettings(staging_bytes=staging))
        runs = {"eugo": lambda i, d=device: eugo_task(d, i), "plain": plain_task,
                "plain_nb": plain_non_blocking_task}
        for task in runs.values():  # first use: kernels, handles, staging buffers
            task(0)
        cupy.cuda.Device().synchronize()
        for threads in (1, 4):
            rates = {name: round(tasks_per_second(task, threads), 1) for name, task in runs.items()}
            print(f"{label}, {threads} thread(s): tasks/s {rates}", flush=True)
        print(f"{label}, eugo phases, ms per task on one thread: {phases(device)}", flush=True)
    device = CupyDevice(cupy, DeviceSettings())
    profile = cProfile.Profile()
    profile.enable()
    for i in range(96):
        eugo_task(device, i)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(text.getvalue())


if __name__ == "__main__":
    main()
