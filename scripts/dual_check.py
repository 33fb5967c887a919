"""Run-time dispatch on a device: ``python3 scripts/dual_check.py cupy|emulated`` (writes
$OUT/dual-<device>.json; about a minute; on the device machine install .whl/ first as
scripts/gpu-check.sh does). Not run on a GPU yet: the device tool runs the main tree.

Dual dispatch on a real device: a CPU worker and a GPU worker (GPU=1) in one process, the
seed's elementwise transform with eugo.dispatch dual; results against plain Dask, what the
plugin sent where, what each worker ran, and the ledger's learned scales (measured / estimated)."""
import asyncio
import json
import os
import sys
import time

import dask
import dask.array as da
import numpy as np

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cupy"
OUT = os.environ.get("OUT", "/tmp")

def build(n=8192, chunk=2048):
    x = da.random.default_rng(0).random((n, 2 * n), chunks=chunk, dtype=np.float32)
    return da.exp(-x * x) * da.sin(x)

async def main():
    from distributed import Client, Scheduler, Worker

    import eugo_dask
    from eugo_dask.plugin import EugoSchedulerPlugin
    with dask.config.set(optimizations=[]):
        t = time.perf_counter()
        expected = build().compute(scheduler="threads")
        plain_s = time.perf_counter() - t
    settings = {"optimizations": [eugo_dask.eugo], "eugo.device": DEVICE, "eugo.min-speedup": 2,
                "eugo.profile": {"base": "h200", "cpu": "server-x86"}, "eugo.dispatch": "dual"}
    record = {"device": DEVICE, "plain_threads_s": plain_s}
    with dask.config.set(settings):
        async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s, \
                Worker(s.address, nthreads=8) as cpu, \
                Worker(s.address, nthreads=2, resources={"GPU": 1}) as gpu, \
                Client(s.address, asynchronous=True) as c:
            await c.register_plugin(EugoSchedulerPlugin())
            for run, dispatch in enumerate(["dual", "dual", "dual", "static", "dual"]):
                x = build() if run == 0 else build() * (run + 1)  # (new keys each run)
                t = time.perf_counter()
                with dask.config.set({"eugo.dispatch": dispatch}):
                    future = c.compute(x)
                result = await asyncio.wait_for(future, 120)
                wall = time.perf_counter() - t
                ok = bool(np.allclose(result, expected * (run + 1), rtol=1e-6, atol=1e-6))
                same = bool(np.array_equal(result, expected * (run + 1)))
                p = s.plugins["eugo"]
                record[f"run{run}"] = {"dispatch": dispatch, "wall_s": wall, "allclose": ok, "equal": same,
                                       "sent": dict(p.dual.sent), "errors": p.errors,
                                       "scale": {f"{k[0]}|{k[1]}": v for k, v in p.dual.ledger.scale.items()}}
                print(record[f"run{run}"], flush=True)
            record["gpu_worker_ran"] = dict(getattr(gpu, "eugo_ran", {}))
            record["cpu_worker_ran"] = dict(getattr(cpu, "eugo_ran", {}))
            record["device_stats"] = {k: v for k, v in eugo_dask.device_stats().items() if isinstance(v, (int, float))}
    print(json.dumps(record, indent=1, default=str))
    with open(os.path.join(OUT, f"dual-{DEVICE}.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)

asyncio.run(main())
