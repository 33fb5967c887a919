"""Testing your own pipelines with eugo on, on a machine without a GPU.

The emulated device (NumPy-backed device arrays that behave like CuPy's where placement depends
on it) runs eugo's GPU tasks anywhere, so a pipeline's placement, copies and results can be
tested in CI. With distributed's ``gen_cluster``::

    from distributed.utils_test import gen_cluster
    from eugo_dask.testing import cpu_worker, device_tasks, emulated_settings, gpu_worker

    @gen_cluster(client=True, nthreads=[gpu_worker(), cpu_worker()], config=emulated_settings())
    async def test_my_pipeline(c, s, gpu, cpu):
        result = await c.compute(my_pipeline())
        assert device_tasks(gpu) > 0 and device_tasks(cpu) == 0

``gen_cluster`` copies Dask's config before each test (``reset_config``); eugo's settings survive
the copy. With a ``LocalCluster``, :func:`emulated_gpu_cluster` starts one GPU worker and CPU
workers with the scheduler plugin. Counts are per worker (:func:`device_tasks`), which tells
workers apart where several share a process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from eugo_dask.optimization import eugo
from eugo_dask.runtime import RAN_ON_CPU, RAN_ON_DEVICE

#: An H200 beside a representative server CPU, both presets: plans that do not depend on the
#: machine the test runs on.
H200_SERVER = {"base": "h200", "cpu": "server-x86"}


def emulated_settings(*, min_speedup: float = 0, profile: Any = None,
                      resource: str = "GPU") -> dict[str, Any]:
    """Dask config that turns eugo on with the emulated device (``min_speedup=0``: every task
    that can run on a device does, so a test exercises the device path)."""
    return {
        "optimizations": [eugo],
        "eugo.device": "emulated",
        "eugo.min-speedup": min_speedup,
        "eugo.profile": H200_SERVER if profile is None else profile,
        "eugo.resource": resource,
    }


def gpu_worker(nthreads: int = 1, *, resource: str = "GPU",
               host: str = "127.0.0.1") -> tuple[str, int, dict[str, Any]]:
    """A worker spec for ``gen_cluster(nthreads=[...])`` that advertises the GPU resource."""
    return (host, nthreads, {"resources": {resource: 1}})


def cpu_worker(nthreads: int = 1, *, host: str = "127.0.0.1") -> tuple[str, int]:
    """A worker spec for ``gen_cluster(nthreads=[...])`` without the GPU resource."""
    return (host, nthreads)


def device_tasks(worker: Any) -> int:
    """GPU tasks ``worker`` ran on its device."""
    return int(getattr(worker, "eugo_ran", {}).get(RAN_ON_DEVICE, 0))


def cpu_path_tasks(worker: Any) -> int:
    """GPU tasks ``worker`` ran on its CPU (fallbacks and re-routed tasks)."""
    return int(getattr(worker, "eugo_ran", {}).get(RAN_ON_CPU, 0))


@contextlib.contextmanager
def emulated_gpu_cluster(*, cpu_workers: int = 1, threads_per_worker: int = 1,
                         resource: str = "GPU", **settings: Any) -> Iterator[Any]:
    """A ``LocalCluster`` (workers in this process) with one GPU worker on the emulated device,
    ``cpu_workers`` CPU workers and the eugo scheduler plugin, with eugo's settings in force
    (``emulated_settings(**settings)``). Yields a connected ``Client``."""
    import dask
    from distributed import Client, LocalCluster, Worker

    from eugo_dask.plugin import EugoSchedulerPlugin

    with dask.config.set(emulated_settings(resource=resource, **settings)):
        with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
            cluster.scheduler.add_plugin(EugoSchedulerPlugin(resource=resource))
            cluster.worker_spec.update({
                "gpu": {"cls": Worker, "options": {"nthreads": threads_per_worker,
                                                    "resources": {resource: 1}}},
                **{f"cpu-{i}": {"cls": Worker, "options": {"nthreads": threads_per_worker}}
                   for i in range(cpu_workers)},
            })
            cluster.scale(1 + cpu_workers)
            with Client(cluster) as client:
                client.wait_for_workers(1 + cpu_workers, timeout=60)
                yield client
