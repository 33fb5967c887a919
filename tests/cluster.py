"""A real cluster of separate processes for the tests (:func:`eugo_dask.testing.process_cluster`,
with this repository first on the processes' path: tests define array-likes they unpickle)."""

from __future__ import annotations

import functools
from pathlib import Path

from eugo_dask.testing import DASK_CLI, free_port
from eugo_dask.testing import process_cluster as _process_cluster

ROOT = str(Path(__file__).resolve().parents[1])
process_cluster = functools.partial(_process_cluster, pythonpath=[ROOT])

__all__ = ["DASK_CLI", "free_port", "process_cluster"]
