"""Small files eugo keeps on disk: the per-machine cache directory, and JSON read and written
where no other user could have put or swapped them.

The measured CPU section (:mod:`eugo_dask.measure`) and learned durations
(:mod:`eugo_dask.history`) are read and written here, and only here. A write goes to a new
temporary file beside the target (created exclusively, readable by the user alone, under a name
nobody can guess) and is renamed over it, so a reader never sees half a file, concurrent writers
leave one whole file, and a link planted in the directory is never written through. A file is
read only if it is no link and is the user's (or root's).

A directory another user could write to, the file's own or any above it, is refused: one that
every user may write and that has no sticky bit (``/tmp`` has it), or one that belongs to
another user (root's are trusted). There, someone else could plant a link or a file of their
choosing. The refusal is said once per directory and raises :class:`UnsafeLocation`, an
``OSError`` like any other unwritable place: eugo works without the file (measures the CPU
again, learns in memory only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import stat
import tempfile
from pathlib import Path
from typing import Any, NoReturn

logger = logging.getLogger(__name__)


class UnsafeLocation(PermissionError):
    """A file or directory eugo refuses because another user could have put it there (said once
    in a warning)."""


_refused: set[str] = set()


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


def _unsafe_because(status: os.stat_result) -> str | None:
    """Why another user could change what a file or directory of this ``status`` holds, or
    None."""
    if status.st_uid not in (os.getuid(), 0):
        return f"it belongs to another user (uid {status.st_uid})"
    if stat.S_ISDIR(status.st_mode):
        if status.st_mode & stat.S_IWOTH and not status.st_mode & stat.S_ISVTX:
            return "every user can write to it and it has no sticky bit"
    elif status.st_mode & stat.S_IWOTH:
        return "every user can write to it"
    return None


def _refuse(place: Path, why: str, target: Path) -> NoReturn:
    if str(place) not in _refused:
        _refused.add(str(place))
        logger.warning("eugo: not using %s: %s is unsafe: %s, so another user could plant files or "
                       "links there. eugo works without it; keep its files in a directory only you "
                       "can write to (XDG_CACHE_HOME, eugo.history).", target, place, why)
    raise UnsafeLocation(f"{place} is unsafe: {why}")


def _check(target: Path) -> None:
    """Refuse ``target`` where another user could write to a directory above it (those not
    made yet will be the user's own)."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes (Windows)
        return
    directory = target.parent.resolve()
    for place in (directory, *directory.parents):
        try:
            status = os.stat(place)
        except FileNotFoundError:
            continue
        why = _unsafe_because(status)
        if why is not None:
            _refuse(place, why, target)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``, read only from a file that is no link and is the user's, in
    a directory no other user can write to.

    Raises ``OSError`` (:class:`UnsafeLocation` where refused), ``ValueError`` (no JSON) or
    ``RecursionError`` (nested past Python's limit); callers decide whether that matters."""
    target = Path(path)
    _check(target)
    with open(os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), encoding="utf-8") as f:
        if hasattr(os, "getuid"):
            why = _unsafe_because(os.fstat(f.fileno()))
            if why is not None:
                _refuse(target, why, target)
        return json.loads(f.read())


def write_json_atomic(path: str | os.PathLike[str], data: Any, **dumps: Any) -> None:
    """Write ``data`` as JSON to ``path`` all at once (a new temporary file renamed over it),
    readable by the user alone, making missing directories the user's own (0700).

    Raises ``OSError`` where the directory cannot be written (:class:`UnsafeLocation` where it
    is refused); callers decide whether that matters."""
    target = Path(path)
    _check(target)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = json.dumps(data, **dumps)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
