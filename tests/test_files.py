"""eugo's files on disk (learned durations, the per-machine CPU cache) cannot be turned against
their owner by another user of a shared directory."""

from __future__ import annotations

import json
import os
import stat

import pytest

from eugo_dask import measure
from eugo_dask.files import read_json, write_json_atomic
from eugo_dask.history import RuntimeHistory, default_history_path


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual umask: files 0644 unless made private on purpose
    yield
    os.umask(old)


def test_links_planted_at_the_temporary_names_are_not_followed(tmp_path, umask_022):
    # issue: the temporary file had a predictable name and was written through a link there,
    # so a link planted in a shared directory made eugo overwrite any file the user can write
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "history.json"
    (tmp_path / f".{target.name}.{os.getpid()}.tmp").symlink_to(victim)
    write_json_atomic(target, {"buckets": []})
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and json.loads(target.read_text()) == {"buckets": []}
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # the user's own, not 0644


def test_a_link_at_the_file_itself_is_not_read(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"buckets": []}')
    link = tmp_path / "history.json"
    link.symlink_to(elsewhere)
    with pytest.raises(OSError):
        read_json(link)


def _only_cpu_measured(monkeypatch):
    calls = []
    monkeypatch.setattr(measure, "measure_local_cpu", lambda: calls.append(1) or {"measured": True})
    return calls


def _learned(path):
    history = RuntimeHistory(path, min_samples=1)
    for _ in range(3):
        history.record("matmul", "gpu", 2**23, 0.01)
    return history


def test_a_cache_directory_every_user_can_write_is_refused_once(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache" / "eugo-dask"
    cache.mkdir(parents=True)
    cache.chmod(0o777)  # world-writable, no sticky bit: anyone may plant links or files here
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent))
    calls = _only_cpu_measured(monkeypatch)
    for _ in range(2):
        assert measure.cached_local_cpu() == {"measured": True}
        _learned(default_history_path()).save()
    assert len(calls) == 2  # eugo works without the cache: it measures again
    assert list(cache.iterdir()) == []  # and writes nothing there
    refusals = [r.getMessage() for r in caplog.records if "not using" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert f"{cache} is unsafe: every user can write to it and it has no sticky bit" in refusals[0]


def test_a_link_planted_at_the_cache_directory_is_not_followed(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (shared / "eugo-dask").symlink_to(elsewhere)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    calls = _only_cpu_measured(monkeypatch)
    measure.cached_local_cpu()
    _learned(default_history_path()).save()
    measure.cached_local_cpu()
    assert len(calls) == 2 and list(elsewhere.iterdir()) == []
    assert f"{shared / 'eugo-dask'} is unsafe: it is a link" in caplog.text


@pytest.mark.parametrize("mode", [0o777, 0o2777], ids=["world-writable", "pod-emptydir"])
def test_a_private_cache_under_a_directory_every_user_can_write(tmp_path, monkeypatch, mode):
    """A pod's /tmp (a Kubernetes emptyDir: 0777, setgid where the pod has an fsGroup, no
    sticky bit) holds the chart's XDG_CACHE_HOME: eugo makes its own directory there, 0700, and
    keeps its files in it, read and written relative to the directory it checked. (Refused
    before, for what was above it: no pod of the chart kept a cache or a history.)"""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    scratch.chmod(mode)
    monkeypatch.setenv("XDG_CACHE_HOME", str(scratch / "cache"))
    calls = _only_cpu_measured(monkeypatch)
    measure.cached_local_cpu()
    measure.cached_local_cpu()
    assert len(calls) == 1  # measured once, then read back
    history_path = default_history_path()
    _learned(history_path).save()
    assert len(RuntimeHistory(history_path, min_samples=1)) > 0
    cache = scratch / "cache" / "eugo-dask"
    assert stat.S_IMODE(cache.stat().st_mode) & 0o777 == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in cache.iterdir()} == {0o600}


def test_a_sticky_shared_directory_is_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: others cannot replace what is ours
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    calls = _only_cpu_measured(monkeypatch)
    measure.cached_local_cpu()
    measure.cached_local_cpu()
    assert len(calls) == 1
    cache = shared / "eugo-dask"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # made private


def _belongs_to_another_user(path, monkeypatch):
    if os.getuid() == 0:
        os.chown(path, 65534, -1)  # nobody
    else:  # a user cannot give a directory away: be another user instead
        another = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: another)


def test_a_history_directory_of_another_user_is_refused(tmp_path, monkeypatch, caplog):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    path = theirs / "history.json"
    _learned(path).save()  # durations they could have chosen
    saved = path.read_text()
    _belongs_to_another_user(theirs, monkeypatch)
    history = RuntimeHistory(path, min_samples=1)
    assert len(history) == 0  # not read
    _learned(path).save()
    assert path.read_text() == saved  # not written
    assert f"{theirs.resolve()} is unsafe: it belongs to another user" in caplog.text


def test_a_fifo_planted_where_a_file_is_read_is_refused_not_waited_on(tmp_path):
    """eugo.history may name a file right in a sticky world-writable directory (/tmp), where
    any user can create a FIFO under the file's name. Opening it to read waits for a writer
    (before any check of its owner or kind): the pass hung for ever. It must fail at once."""
    import concurrent.futures

    from eugo_dask.files import read_json

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    fifo = shared / "history.json"
    os.mkfifo(fifo, 0o666)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    reading = pool.submit(read_json, fifo)
    try:
        concurrent.futures.wait([reading], timeout=10)
        assert reading.done(), "read_json still waits on the FIFO after 10 s"
        assert isinstance(reading.exception(), OSError)
    finally:
        if not reading.done():  # unblock the reader: open the FIFO for writing, then close
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pool.shutdown(wait=True)


def test_a_directory_its_group_can_write_is_refused_unless_the_group_is_ours(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "team"
    shared.mkdir()
    shared.chmod(0o775)  # the users of its group could plant files or links here
    path = shared / "history.json"
    _learned(path).save()  # its group is ours: used
    assert len(RuntimeHistory(path, min_samples=1)) > 0
    another_group = os.getgid() + 1
    monkeypatch.setattr(os, "getgid", lambda: another_group)  # now the group is someone else's
    assert len(RuntimeHistory(path, min_samples=1)) == 0
    assert f"{shared} is unsafe: the other users of its group (gid {shared.stat().st_gid})" in caplog.text
