"""A nanny preload for ``dask cuda worker`` pods: one dashboard port per GPU process.

``dask cuda worker`` starts one nanny and worker per GPU and hands each worker the same
``--dashboard-address``: the first takes the port and the others fall back to random ones, so
the pod's declared port, its probes and a metrics scrape reach one GPU's worker only. Loaded as
the nannies' preload (``DASK_DISTRIBUTED__NANNY__PRELOAD='["eugo_dask.cuda_ports"]'``: ``dask
cuda worker`` has no ``--preload-nanny``), it gives the worker of GPU process ``n``, which
``dask cuda worker`` names ``<--name>-<n>``, the port ``<dashboard port> + n`` before it starts.
A nanny with any other name keeps its address.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def process_index(name: Any, base: str | None) -> int:
    """``n`` of a worker named ``<base>-<n>`` (dask cuda worker's name for GPU process ``n``),
    else 0."""
    text = str(name)
    if base and text.startswith(f"{base}-") and text[len(base) + 1:].isdigit():
        return int(text[len(base) + 1:])
    return 0


def shifted(address: str, offset: int) -> str:
    """A dashboard address (``:8788``, ``0.0.0.0:8788``) with its port moved by ``offset``."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return address  # a random port stays random
    return f"{host}:{int(port) + offset}"


def dask_setup(nanny: Any) -> None:
    """Move the dashboard port of this nanny's worker by its GPU process's index (the pod's
    name is ``$POD_NAME``, as the chart sets it and passes it as ``--name``)."""
    address = nanny.worker_kwargs.get("dashboard_address")
    index = process_index(nanny.name, os.environ.get("POD_NAME"))
    if isinstance(address, str) and index:
        nanny.worker_kwargs["dashboard_address"] = shifted(address, index)
        logger.info("eugo: worker %s serves its dashboard on %s", nanny.name,
                    nanny.worker_kwargs["dashboard_address"])
