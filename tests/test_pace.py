"""Reads paced to the device (eugo_dask/pace.py): which reads wait, for what, and that the graph
still computes plain Dask's values.

The pass paces reads only on a distributed scheduler with GPU workers; here the window it would
work out there is given to it (``_read_window`` patched), and the graph runs on local schedulers.
What a cluster makes of it (reads no longer running ahead of a slow device) is in test_cluster.py.
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from dask.utils import key_split

from eugo_dask import optimization
from eugo_dask.runtime import DeviceCall, after_token, pace_token, to_device, to_host


class Lazy:
    """A zarr/h5py-like array read through ``getter``, its blocks made when read."""

    def __init__(self, shape):
        self.shape, self.dtype, self.ndim = shape, np.dtype("f4"), len(shape)

    def __getitem__(self, index):
        rows, cols = (range(*s.indices(n)) for s, n in zip(index, self.shape))
        return np.full((len(rows), len(cols)), rows.start / 100 + cols.start / 1000, dtype="f4")


@pytest.fixture
def window(monkeypatch):
    """The pass paces reads with a window of 4 (and copies with one of 3 device tasks, which
    only eugo's scheduler plugin acts on), as on a cluster with GPU workers."""
    monkeypatch.setattr(optimization, "_read_window", lambda settings: (4, 3))
    return 4


def rewritten(collection):
    graph = collection.__dask_optimize__(collection.__dask_graph__(), collection.__dask_keys__())
    return graph, dict(graph)


def funcs(dsk, func):
    return {k: v for k, v in dsk.items() if getattr(v, "func", None) is func}


def reads_in_block_order(dsk):
    """Every read (the source of a copy to the device), by block: (read key, whether paced)."""
    sources = {next(iter(v.dependencies)) for v in funcs(dsk, to_device).values()}
    reads = [(k[1:], k, dsk[k].func is after_token) for k in sources]
    return [(k, paced) for _, k, paced in sorted(reads)]


def waited_for(dsk, paced_read):
    """The device task a paced read waits for, through its token and the copy back."""
    (token,) = [d for d in dsk[paced_read].dependencies if getattr(dsk[d], "func", None) is pace_token]
    (back,) = dsk[token].dependencies
    assert dsk[back].func is to_host
    (device_task,) = dsk[back].dependencies
    assert isinstance(dsk[device_task].func, DeviceCall)
    return device_task


def reads_of(dsk, device_task):
    """The reads whose copies a device task reads."""
    return {next(iter(dsk[c].dependencies)) for c in dsk[device_task].dependencies
            if getattr(dsk[c], "func", None) is to_device}


def test_each_read_waits_for_the_device_task_of_the_read_window_places_before(emulated, window):
    x = da.from_array(Lazy((60, 60)), chunks=10)  # 36 reads
    y = np.exp(np.sin(x)).sum()
    graph, dsk = rewritten(y)
    reads = reads_in_block_order(dsk)
    assert len(reads) == 36
    # the first reads of the window start at once; each later one waits for the device task
    # that consumed the read `window` places before it to end (its result copied back)
    assert [paced for _, paced in reads] == [False] * window + [True] * (36 - window)
    for j in range(window, 36):
        assert reads_of(dsk, waited_for(dsk, reads[j][0])) == {reads[j - window][0]}
    # a paced read is the read itself, nested, renamed; its copy reads it by its new name
    for key, _ in reads[window:]:
        token, nested = dsk[key].args
        assert key_split(key) == key_split(nested.key) == "array" and key != nested.key
        assert dsk[key].data_producer and nested.key not in dsk
    assert {key_split(k) for k in funcs(dsk, pace_token)} == {"eugo-paced-eugo-tohost-sum-sum"}
    # the same values as plain Dask, on both local schedulers
    with dask.config.set(optimizations=[]):
        expected = y.compute()
    assert_eq(y.compute(scheduler="sync"), expected)
    assert_eq(y.compute(scheduler="threads"), expected)


def test_tokens_run_on_gpu_workers_without_the_slot(emulated, window):
    x = da.from_array(Lazy((60, 60)), chunks=10)
    graph, dsk = rewritten(np.exp(np.sin(x)).sum())
    (layer,) = graph.layers.values()
    role, resources = layer.annotations["eugo"], layer.annotations["resources"]
    tokens = funcs(dsk, pace_token)
    assert tokens and all(role(k)["role"] == "pace" and resources(k) == {"GPU": 0}
                          for k in tokens)
    reads = reads_in_block_order(dsk)
    assert any(paced for _, paced in reads)
    for key, _ in reads:  # paced or not, a read keeps its role (I/O: CPU workers') and no resources
        assert role(key)["role"] == "host" and resources(key) is None


def test_a_read_whose_device_task_reads_later_blocks_is_not_paced(emulated, window):
    # x + x.T: the device task of block (i, j) reads blocks (i, j) and (j, i); waiting for it,
    # a read before (j, i) would wait for itself: such reads are left unpaced
    x = da.from_array(Lazy((60, 60)), chunks=10)
    y = (x + x.T).sum()
    graph, dsk = rewritten(y)
    reads = reads_in_block_order(dsk)
    index = {key: j for j, (key, _) in enumerate(reads)}
    paced = [j for j, (_, p) in enumerate(reads) if p]
    assert paced and len(paced) < len(reads) - window
    for j in paced:
        waited = reads_of(dsk, waited_for(dsk, reads[j][0]))
        assert max(index[r] for r in waited) < j
    with dask.config.set(optimizations=[]):
        expected = y.compute()
    assert_eq(y.compute(scheduler="threads"), expected)


def test_no_pacing_on_a_local_scheduler(emulated):
    # the local scheduler's pool is the bound: no tokens, the reads as they were
    x = da.from_array(Lazy((60, 60)), chunks=10)
    graph, dsk = rewritten(np.exp(np.sin(x)).sum())
    assert not funcs(dsk, pace_token) and not funcs(dsk, after_token)
    assert len(reads_in_block_order(dsk)) == 36


def test_reads_feeding_the_host_too_are_not_paced(emulated, window):
    # a read that a CPU task reads as well is no read of the device's alone
    x = da.from_array(Lazy((60, 60)), chunks=10)
    y = np.exp(np.sin(x)).sum() + x.astype("object").sum()
    graph, dsk = rewritten(y)
    assert not funcs(dsk, pace_token)
    with dask.config.set(optimizations=[]):
        expected = y.compute()
    assert_eq(y.compute(scheduler="threads"), expected)
