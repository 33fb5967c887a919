"""A pipeline computed and persisted on a cluster with an emulated GPU worker, in this process's
array mode, and what ran where, as JSON on stdout: ``python -m tests.expression_cluster local``
(a LocalCluster: the scheduler shares this process's config) or ``python -m
tests.expression_cluster process LOG_DIR`` (scheduler and workers in processes of their own,
started without this process's ``DASK_*`` settings: eugo's settings travel from the client).

The pipeline is :func:`tests.pipelines.pipeline` without its matmul (array expressions lack
``@`` in Dask 2026.8): a stored array read, elementwise work, a reduction.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import dask
import dask.array as da
import numpy as np

from .cluster import SETTINGS, placements, process_cluster, worker_stats
from .pipelines import PIPELINE_A, LazyArray

EXPECTED = (np.tanh(PIPELINE_A) * 2).sum(axis=0)


def read_tanh_sum() -> Any:
    a = da.from_array(LazyArray(PIPELINE_A), chunks=(80, 80))
    return (np.tanh(a) * 2).sum(axis=0)


def _run(client: Any, separate_workers: bool) -> dict[str, Any]:
    with dask.config.set(SETTINGS):
        computed = read_tanh_sum().compute()
        persisted = client.persist(read_tanh_sum())
        kept = persisted.compute()
    roles: dict[str, int] = {}
    for _key, role, *_ in placements(client):
        roles[role] = roles.get(role, 0) + 1
    stats = worker_stats(client)
    gpu_name = next(name for name in stats if "gpu" in str(name))
    return {
        "expressions": da.array_expr_enabled(),
        "same result": bool(np.allclose(computed, EXPECTED) and np.allclose(kept, EXPECTED)),
        "result type": type(computed).__name__,
        "roles planned": roles,
        "device tasks on the GPU worker": stats[gpu_name]["tasks"],
        # (workers in one process share its counters)
        "device tasks elsewhere": (sum(s["tasks"] for n, s in stats.items() if n != gpu_name)
                                   if separate_workers else None),
        "fallbacks": sum(s["fallbacks"] for s in stats.values()),
    }


def main(kind: str, log_dir: str | None = None) -> None:
    if kind == "local":
        from eugo_dask.testing import emulated_gpu_cluster

        with emulated_gpu_cluster() as client:
            out = _run(client, separate_workers=False)
    else:
        workers = {"gpu": {"gpu": True}, "cpu": {}}
        with process_cluster(log_dir, workers=workers) as (_cluster, client):
            out = _run(client, separate_workers=True)
    json.dump(out, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
