"""Small files eugo keeps on disk: the per-machine cache directory, and JSON read and written
where no other user could have put or swapped them.

The measured CPU section (:mod:`eugo_dask.measure`) and learned durations
(:mod:`eugo_dask.history`) are read and written here, and only here. A file's directory is
opened first (no link) and must be the user's (or root's) and writable by no other user
(world-writable only with the sticky bit, as ``/tmp``); everything else happens relative to that
open directory, so whatever happens to the path above it, eugo reads and writes only where it
checked. A write goes to a new temporary file (created exclusively, readable by the user alone,
under a name nobody can guess) renamed over the target, so a reader never sees half a file,
concurrent writers leave one whole file, and a link planted in the directory is never written
through. A file is read only if it is no link and is the user's (or root's).

The directories above may be anyone's: a pod's ``/tmp`` (an ``emptyDir``, world-writable
without the sticky bit) holds ``/tmp/cache/eugo-dask``, made 0700. Another user who can write
there can at most remove eugo's directory (eugo measures again), or plant one of their own or a
link in its place, which is refused. The refusal is said once per directory and raises
:class:`UnsafeLocation`, an ``OSError`` like any other unwritable place: eugo works without the
file (measures the CPU again, learns in memory only).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import secrets
import stat
from collections.abc import Iterator
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
    mode = status.st_mode
    if stat.S_ISDIR(mode) and mode & stat.S_ISVTX:  # (as /tmp: others cannot replace ours)
        return None
    if mode & stat.S_IWOTH:
        return "every user can write to it" + (" and it has no sticky bit" if stat.S_ISDIR(mode) else "")
    if mode & stat.S_IWGRP and status.st_gid != os.getgid():
        return f"the other users of its group (gid {status.st_gid}) can write to it"
    if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        return "it is no regular file"
    return None


def _refuse(place: Path, why: str, target: Path) -> NoReturn:
    if str(place) not in _refused:
        _refused.add(str(place))
        logger.warning("eugo: not using %s: %s is unsafe: %s, so another user could plant files or "
                       "links there. eugo works without it; keep its files in a directory only you "
                       "can write to (XDG_CACHE_HOME, eugo.history).", target, place, why)
    raise UnsafeLocation(f"{place} is unsafe: {why}")


_DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = getattr(os, "O_NOFOLLOW", 0)
#: Whether this system opens files relative to an open directory (POSIX; not Windows, whose
#: files have no POSIX owners and modes to check either).
_RELATIVE = {os.open, os.rename, os.unlink} <= os.supports_dir_fd  # (os.replace as os.rename)


@contextlib.contextmanager
def _directory_of(target: Path, *, create: bool) -> Iterator[int | None]:
    """The open directory of ``target`` (None where files are not opened relative to one),
    checked: no link, the user's, writable by no other user. ``create`` makes it and its
    missing parents first (itself 0700)."""
    directory = target.parent
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _RELATIVE:
        yield None
        return
    try:
        fd = os.open(directory, _DIRECTORY_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and directory.is_symlink():
            _refuse(directory.absolute(), "it is a link", target)
        raise
    try:
        why = _unsafe_because(os.fstat(fd))
        if why is not None:
            _refuse(directory.absolute(), why, target)
        yield fd
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``, read only from a file that is no link and is the user's, in
    a directory no other user can write to.

    Raises ``OSError`` (:class:`UnsafeLocation` where refused), ``ValueError`` (no JSON) or
    ``RecursionError`` (nested past Python's limit); callers decide whether that matters."""
    target = Path(path)
    with _directory_of(target, create=False) as directory:
        # (non-blocking: a FIFO planted there is refused below rather than waited on)
        fd = os.open(target.name if _RELATIVE else target,
                     os.O_RDONLY | _FILE_FLAGS | getattr(os, "O_NONBLOCK", 0), dir_fd=directory)
        with open(fd, encoding="utf-8") as f:
            if _RELATIVE:
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
    text = json.dumps(data, **dumps)
    with _directory_of(target, create=True) as directory:
        tmp_name = f".{target.name}.{secrets.token_hex(8)}.tmp"  # (beside the target)
        name, tmp = ((target.name, tmp_name) if _RELATIVE
                     else (str(target), str(target.parent / tmp_name)))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600,
                     dir_fd=directory)
        try:
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=directory)
            raise
