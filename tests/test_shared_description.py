"""Golden comparison: describing a layer's chunks once per class of chunk (shared work) gives
exactly what describing every task on its own gives: the same estimates, placements, explain
text and rewritten graphs, on the equivalence cases, the pipelines and graphs of many chunks."""

from __future__ import annotations

import functools
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Task
from dask.array.core import PerformanceWarning
from dask.array.optimization import optimize as dask_optimize
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from eugo_dask import explain
from eugo_dask import optimization as optimization_module
from eugo_dask.describe import describe_graph
from eugo_dask.graph import ChunkInfo
from eugo_dask.optimization import eugo

from .pipelines import CASES, LazyArray, matmul_add_sum, pipeline


def _many_chunks():
    with warnings.catch_warnings():  # small chunks are the point
        warnings.simplefilter("ignore", PerformanceWarning)
        x = da.random.default_rng(0).random((230, 170), chunks=(20, 30))  # edge chunks both ways
        return {
            "random-chain-sum": ((x + 1) * 2).sum(axis=0),
            "random-matmul-sum": (x @ x.T).sum(),
            "ones-chain-sum": ((da.ones((230, 170), chunks=(20, 30)) + 1) * 2).sum(axis=0),
            "legacy-random": da.random.RandomState(2).normal(size=(100, 70), chunks=(30, 20))
            .astype("f4").std(axis=1),
            "map_overlap": x.map_overlap(lambda b: b * 2, depth=1).sum(axis=1),
            "reads": (da.exp(da.from_array(LazyArray(np.arange(230.0 * 170).reshape(230, 170)),
                                           chunks=(20, 30))) * 2).mean(axis=0),
            # two creations of one chunking in one graph (their chains of one class each)
            "two-random-chains": (((da.random.default_rng(1).random(
                (230, 170), chunks=(20, 30), dtype="f4") + 1) * 2).sum(axis=0)
                + (da.random.default_rng(2).normal(size=(230, 170), chunks=(20, 30)) ** 2
                   ).sum(axis=0)),
            # a creation its layer's metadata says makes another dtype than it does
            "misannotated-ones": (_misannotated_ones() + 1) * 2,
        }


def _misannotated_ones():
    """A user's layer of ``np.ones`` chunks (float64) that its array says are float32."""
    name = "user-ones"
    dsk = {(name, i): Task((name, i), np.ones, (10,)) for i in range(7)}
    return da.Array(HighLevelGraph.from_collections(name, dsk, dependencies=()), name,
                    chunks=((10,) * 7,), dtype="f4")


def _builds():
    return {**CASES, "matmul-add-sum": matmul_add_sum, "pipeline": pipeline,
            **{name: functools.partial(lambda n: _many_chunks()[n], name)
               for name in _many_chunks()}}


def _alone(monkeypatch):
    """Every task described on its own from now on (the pass and explain)."""
    monkeypatch.setattr(optimization_module, "describe_graph",
                        functools.partial(describe_graph, share=False))


def _rewritten(collection):
    """The pass's graph for ``collection`` (every device-capable task offloaded): each key's
    node (by token) and its annotations."""
    graph, keys = collection.__dask_graph__(), collection.__dask_keys__()
    out = eugo(dask_optimize(graph, keys), keys, chunk_info=ChunkInfo.from_graph(graph))
    annotations = {}
    for layer in getattr(out, "layers", {}).values():
        for kind, value in (layer.annotations or {}).items():
            for key in layer:
                found = value(key) if callable(value) else value
                if isinstance(found, dict):  # (the plan's id differs from pass to pass)
                    found = {k: v for k, v in found.items() if k != "plan"}
                annotations[(kind, key)] = found
    return {k: tokenize(v) for k, v in dict(out).items()}, annotations


@pytest.mark.parametrize("name", sorted(_builds()))
def test_shared_descriptions_plan_and_rewrite_as_tasks_described_alone(name, monkeypatch):
    collection = _builds()[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (cases whose chunks NumPy warns about)
        with dask.config.set({"eugo.device": "emulated", "eugo.min-speedup": 0,
                              "eugo.profile": {"base": "h200", "cpu": "server-x86"}}):
            shared_plan, shared_graph = explain(collection), _rewritten(collection)
            default_plan = explain(collection, min_speedup=1.5)
            with monkeypatch.context() as alone:
                _alone(alone)
                alone_plan, alone_graph = explain(collection), _rewritten(collection)
                alone_default = explain(collection, min_speedup=1.5)
    for shared, alone in [(shared_plan, alone_plan), (default_plan, alone_default)]:
        assert [d.to_dict() for d in shared] == [d.to_dict() for d in alone]
        assert str(shared) == str(alone)
        assert shared.totals == alone.totals
    assert shared_graph == alone_graph
