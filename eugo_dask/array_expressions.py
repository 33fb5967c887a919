"""eugo in Dask's array-expression mode (``array.query-planning: True``).

Dask optimizes an array expression on the client (``expr.optimize()`` in ``dask.compute``,
``dask.persist``, ``Client.compute`` and ``Client.persist``) and materializes it where it runs:
in the client's process for a local scheduler, on the scheduler for distributed. Nothing in
between calls a configurable graph pass (dask#6083; ``docs/upstream/`` holds the change that
would add one), and Dask's ``array_optimize`` hook, which legacy mode goes through
(:mod:`eugo_dask.array_optimize`), is never called for expressions.

So, on the Dask versions it was tested with (:data:`TESTED_DASK`), ``import eugo_dask`` wraps
``Expr.optimize``: where the ``optimizations`` list holds eugo's pass and the optimized
expression holds array expressions, the optimized expression is returned inside a
:class:`PlannedExpr`. Its keys are the child's; its materialization runs the ``optimizations``
list over the child's graph, with the chunk shapes read from the child's nodes. The list and the
settings travel as they do in legacy mode: the wrapper holds the :data:`~eugo_dask.bridge`,
whose pickling (the expression submitted to a distributed scheduler) freezes the client's
``optimizations``, ``eugo.*`` settings and annotations.

Dask's own array optimization is not run over the child's graph: in expression mode Dask runs
no low-level fusion, and eugo changes where work runs, not how Dask shaped the graph. Outside
the tested versions eugo warns and leaves array expressions alone.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from typing import Any

import dask
from dask._expr import Expr
from dask.highlevelgraph import HighLevelGraph
from dask.utils import ensure_dict

from eugo_dask.array_optimize import bridge, configured_passes, is_eugo_pass
from eugo_dask.config import read_settings
from eugo_dask.graph import ChunkInfo, Key, culled

#: The Dask releases (``major.minor``) whose expression machinery the hook was tested with: it
#: relies on ``Expr.optimize`` being what every compute and persist calls last on the client,
#: and on the expression being materialized by its ``__dask_graph__``/``__dask_annotations__``.
#: (2026.7: the images' Dask, pinned by dask-cuda; its dask/_expr.py, dask/base.py,
#: dask/array/_array_expr and distributed/client.py are 2026.8's. 2026.11: dask/base.py and
#: dask/array/_array_expr are 2026.8's, dask/_expr.py differs in ``analyze``'s annotation only,
#: distributed/client.py in ``scheduler_info``'s return value only.)
TESTED_DASK = ("2026.7", "2026.8", "2026.11")


def array_expressions_enabled() -> bool:
    """Whether dask.array runs in array-expression mode (fixed when dask.array is imported)."""
    import dask.array as da

    enabled = getattr(da, "_array_expr_enabled", lambda: False)
    return bool(enabled())


def dask_is_tested() -> bool:
    """Whether the installed Dask is one of :data:`TESTED_DASK`."""
    return ".".join(dask.__version__.split(".")[:2]) in TESTED_DASK


#: Where a :class:`PlannedExpr` keeps its graph.
_PLANNED = "_eugo_planned_graph"


class PlannedExpr(Expr):
    """An optimized expression whose graph is the ``optimizations`` list's output over the
    child's graph (``expr``), run by ``optimizer`` (the bridge, or what it froze on the client)
    when the expression is materialized."""

    _parameters = ["expr", "optimizer"]
    # (what the pass made is not sent along: the scheduler plans for its own cluster)
    _pickle_functools_cache = False

    def __dask_tokenize__(self) -> str:
        # the child's name says what is computed; the optimizer is config, not data
        return f"eugo-planned-{self.operand('expr')._name}"

    @functools.cached_property
    def _name(self) -> str:
        return f"eugo-planned-{self.operand('expr')._name}"

    def __dask_keys__(self) -> Any:
        return self.operand("expr").__dask_keys__()

    def _planned(self) -> Any:
        """The passes' graph, made once (kept in the instance, never pickled with it).

        A method, not a property: an ``AttributeError`` raised while the child's graph is made
        (Dask's own, or a user's) would send Python to ``Expr.__getattr__``, which makes the
        graph again and re-raises the error with a text of its own and the first as context."""
        if _PLANNED not in self.__dict__:
            child = self.operand("expr")
            keys = child.__dask_keys__()
            chunk_info = ChunkInfo.from_expression(child)
            self.__dict__[_PLANNED] = self.operand("optimizer").run_passes(
                culled(child.__dask_graph__(), keys), keys, chunk_info)
        return self.__dict__[_PLANNED]

    def __dask_graph__(self) -> dict[Key, Any]:
        return ensure_dict(self._planned())

    _layer = __dask_graph__

    def __dask_annotations__(self) -> dict[str, dict[Key, Any]]:
        """The child's annotations, then those on the layers the passes returned (eugo's
        ``resources`` on its GPU and copy tasks), key by key."""
        by_type: defaultdict[str, dict[Key, Any]] = defaultdict(dict)
        for kind, values in self.operand("expr").__dask_annotations__().items():
            by_type[kind].update(values)
        planned = self._planned()
        if isinstance(planned, HighLevelGraph):
            for layer in planned.layers.values():
                for kind, value in (layer.annotations or {}).items():
                    by_type[kind].update(
                        {k: value(k) if callable(value) else value for k in layer})
        return dict(by_type)


def _holds_arrays(expr: Expr) -> bool:
    from dask.array._array_expr._expr import ArrayExpr

    return any(isinstance(node, ArrayExpr) for node in expr.walk())


def planned(expr: Expr) -> Expr:
    """``expr`` (optimized) in a :class:`PlannedExpr` where eugo's pass is configured and
    ``expr`` holds array expressions; ``expr`` itself otherwise (as for a composite collection,
    whose parts ``dask.persist`` reads from the optimized expression's operands)."""
    from dask._expr import CompositeExpr

    if isinstance(expr, PlannedExpr) or not any(map(is_eugo_pass, configured_passes())):
        return expr
    nodes = list(expr.walk())
    if any(isinstance(node, (PlannedExpr, CompositeExpr)) for node in nodes):
        return expr
    if not _holds_arrays(expr):
        return expr
    # a bad setting is reported now, on the client, as itself (the bridge validates it again
    # when the expression is pickled, where distributed would hide it inside "Could not
    # serialize object of type PlannedExpr")
    read_settings()
    return PlannedExpr(expr, bridge)


def _optimize_then_plan(original: Any) -> Any:
    @functools.wraps(original)
    def optimize(self: Expr, *args: Any, **kwargs: Any) -> Expr:
        return planned(original(self, *args, **kwargs))

    optimize._eugo_original = original  # type: ignore[attr-defined]
    return optimize


#: The config key of the expression passes ``docs/upstream/`` proposes to Dask.
EXPRESSION_PASSES = "optimization.expression-passes"


def _upstream_hook() -> bool:
    """Whether this Dask runs the passes listed under :data:`EXPRESSION_PASSES`."""
    return dask.config.get(EXPRESSION_PASSES, None) is not None


def install_expression_hook() -> bool:
    """Where dask.array runs in expression mode: list :func:`planned` among Dask's expression
    passes where Dask has them (``docs/upstream/``), else wrap ``Expr.optimize`` (once) on a
    tested Dask; on another, warn (once per process). Returns whether the hook is in place."""
    if not array_expressions_enabled():
        return False
    if _upstream_hook():
        passes = list(dask.config.get(EXPRESSION_PASSES) or [])
        if planned not in passes:
            dask.config.set({EXPRESSION_PASSES: [*passes, planned]})  # (for the process)
        return True
    if not dask_is_tested():
        warnings.warn(_UNTESTED_DASK.format(version=dask.__version__,
                                            tested=", ".join(TESTED_DASK)),
                      RuntimeWarning, stacklevel=3)
        return False
    if not hasattr(Expr.optimize, "_eugo_original"):
        Expr.optimize = _optimize_then_plan(Expr.optimize)  # type: ignore[method-assign]
    return True


def hook_installed() -> bool:
    """Whether :func:`install_expression_hook` put eugo's hook in place in this process."""
    if _upstream_hook():
        return planned in (dask.config.get(EXPRESSION_PASSES) or [])
    return hasattr(Expr.optimize, "_eugo_original")


_UNTESTED_DASK = (
    "eugo-dask: dask.array runs in array-expression mode (array.query-planning: True) on Dask "
    "{version}; eugo's hook into array expressions was tested with Dask {tested} only, so it is "
    "not installed: with optimizations=[eugo] these graphs run unchanged on the CPU. "
    "eugo_dask.explain() still shows what eugo would do; set array.query-planning: False "
    "before importing dask.array to use it.")


def expression_graph(collections: tuple[Any, ...]) -> tuple[dict[Key, Any], Any, ChunkInfo]:
    """The graph, output keys and chunk shapes that eugo's pass sees for array-expression
    ``collections`` computed together (``dask.compute(*collections)``'s optimized expression,
    without what eugo would make of it). It includes the computation's end: Dask's expressions
    concatenate a result of several chunks with a rechunk of their own tasks."""
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    expr = FinalizeCompute(collections_to_expr(list(collections))).optimize()
    if isinstance(expr, PlannedExpr):
        expr = expr.operand("expr")
    keys = expr.__dask_keys__()
    return culled(expr.__dask_graph__(), keys), keys, ChunkInfo.from_expression(expr)
