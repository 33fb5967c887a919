"""Small files eugo keeps on disk: the per-machine cache directory and atomic JSON writes.

The measured CPU section (:mod:`eugo_dask.measure`) and learned durations
(:mod:`eugo_dask.history`) are written here. A write goes to a temporary file beside the target
and is renamed over it, so a reader never sees half a file and concurrent writers leave one
whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/eugo-dask`` (``~/.cache/eugo-dask`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "eugo-dask"


def machine_id() -> str:
    """A short digest naming this machine and its NumPy (measurements are per machine)."""
    import numpy as np
    from dask.system import CPU_COUNT

    ident = "|".join([platform.node(), platform.machine(), platform.processor(), str(CPU_COUNT),
                      np.__version__])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def write_json_atomic(path: str | os.PathLike[str], data: Any, **dumps: Any) -> None:
    """Write ``data`` as JSON to ``path`` all at once (a temporary file renamed over it).

    Raises ``OSError`` where the directory cannot be written; callers decide whether that
    matters."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, **dumps))
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
