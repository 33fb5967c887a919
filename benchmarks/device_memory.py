"""Copies to the device paced to the device: the emulated device's high water of bytes in live
arrays, and wall time, with copies gated and ungated, on one cluster of separate processes.

A wide matmul whose inputs are all in memory before it starts, so that every copy to the device
is ready at once: ``a`` (N² float32 in 600² blocks) is computed and persisted on the CPU workers
by plain Dask, then ``exp(a @ a.T).sum()`` is computed with eugo (emulated device, min-speedup 0,
H200 profile): its block products run on the GPU worker, each reading copies of two blocks of
``a``. The cluster is ``dask scheduler --preload eugo_dask.plugin``, a GPU worker (``GPU=1``,
emulated device, 2 threads) and two CPU workers (1 thread each), all separate processes; by
default the GPU worker's device takes 50 ms a kernel (``tests/slow_device.py``), slower than
the copies that feed it, the case the gate is for (``--fast-device``: NumPy's own time).

Copies ask for no GPU slot (they run on any free thread of a GPU worker, beside the kernels):
nothing in distributed then stops a GPU worker copying every block it is sent before the device
has used the first. eugo's scheduler plugin holds each copy back until the device task ``A``
places before its first consumer (in Dask's order) has ended (:mod:`eugo_dask.gates`),
``A = (eugo.read-ahead + 1) x GPU slots``: 3 here. Each round computes the product with
``eugo.read-ahead: null`` (``ungated``: no gate, copies run when their block is there) and as
eugo is (``gated``), in turn; the device's high water is its own gauge (``array_peak_bytes``
of the GPU worker's emulated device, reset before each run), and the blocks of ``a`` are
printed beside it for scale. Prints each run's high water and wall time, the worst high waters'
ratio gated/ungated and the best wall times' ratio, and that the results agree.

    python benchmarks/device_memory.py                  # 7200² in 600² blocks: 144 blocks of a, 1,728 products
    python benchmarks/device_memory.py --quick          # 3600²: 36 blocks, 216 products
    python benchmarks/device_memory.py --fast-device    # the device at NumPy's speed
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import _common
import dask
import dask.array as da
import numpy as np

from eugo_dask.testing import process_cluster

BLOCK = 600
SLOW_DEVICE = str(Path(__file__).resolve().parents[1] / "tests" / "slow_device.py")
MiB = 2**20


def _reset_device_peak() -> int:
    """On the GPU worker: start its emulated device's high-water gauge again; how many devices."""
    from eugo_dask.devices.emulated import EmulatedDevice
    from eugo_dask.devices.stats import _live_devices

    devices = [d for d in list(_live_devices) if isinstance(d, EmulatedDevice)]
    for device in devices:
        device.reset_peak()
    return len(devices)


def _device_peak() -> int:
    """On the GPU worker: the most bytes its emulated devices held in live arrays since reset."""
    from eugo_dask.devices.stats import device_memory_stats

    return sum(o["array_peak_bytes"] for s in device_memory_stats()
               if s["device"] == "emulated" for o in s["ordinals"])


def run_once(client, a, settings: dict) -> dict:
    (gpu,) = [w for w, info in client.scheduler_info()["workers"].items() if info["resources"]]
    client.run(_reset_device_peak, workers=[gpu])
    with dask.config.set(settings):
        start = time.perf_counter()
        result = float(client.compute(da.exp(a @ a.T).sum()).result(timeout=1800))
        wall = time.perf_counter() - start
    peak = client.run(_device_peak, workers=[gpu])[gpu]
    return {"peak": peak, "wall": wall, "result": result}


def main() -> None:
    parser = _common.benchmark_parser(__doc__)
    parser.add_argument("--fast-device", action="store_true",
                        help="the GPU worker's device at NumPy's speed (no 50 ms a kernel)")
    args = _common.parse_args(parser)
    n, rounds = (3600, 3) if args.quick else (7200, 2)
    blocks = (n // BLOCK) ** 2
    workers, eugo = _common.emulated_cluster([] if args.fast_device else ["--preload", SLOW_DEVICE])
    runs = {"ungated": {**eugo, "eugo.read-ahead": None}, "gated": eugo}
    print(f"exp(a @ a.T).sum(), a {n}² float32 in {BLOCK}² blocks: {blocks} blocks of "
          f"{BLOCK * BLOCK * 4 / MiB:.2f} MiB ({n * n * 4 / MiB:.0f} MiB), persisted on the CPU "
          f"workers; workers: gpu (2 threads, emulated device"
          f"{'' if args.fast_device else ', 50 ms a kernel'}), cpu-0, cpu-1")
    with tempfile.TemporaryDirectory() as logs, process_cluster(logs, workers=workers) as (_, client):
        cpu = [w for w, info in client.scheduler_info()["workers"].items() if not info["resources"]]
        with dask.config.set(optimizations=[]):
            a = client.persist(da.random.default_rng(0).random((n, n), chunks=BLOCK,
                                                                 dtype=np.float32), workers=cpu)
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, settings in runs.items():
                results[name].append(run_once(client, a, settings))
        gates = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["eugo"].gates.summary())
    print(f"{'run':<8} {'device high water MiB':>22} {'blocks of a':>12} {'wall s':>7}")
    block_bytes = BLOCK * BLOCK * 4
    for name, rs in results.items():
        for r in rs:
            print(f"{name:<8} {r['peak'] / MiB:>22.0f} {r['peak'] / block_bytes:>12.1f} "
                  f"{r['wall']:>7.2f}")
    peak = {name: max(r["peak"] for r in rs) for name, rs in results.items()}
    wall = {name: min(r["wall"] for r in rs) for name, rs in results.items()}
    print(f"worst device high water gated/ungated: {peak['gated'] / max(peak['ungated'], 1):.2f}; "
          f"best wall gated/ungated: {wall['gated'] / wall['ungated']:.2f}; gates made "
          f"{gates['made']}, released by the watchdog {gates['forced']}")
    values = [r["result"] for rs in results.values() for r in rs]
    agree = all(np.isclose(v, values[0], rtol=1e-4) for v in values)
    print(f"results agree: {agree}")
    if not agree or not all(peak.values()):
        raise SystemExit("the device held nothing, or the results differ")


if __name__ == "__main__":
    main()
