"""What eugo does with the equivalence cases (:data:`tests.pipelines.CASES`) in this process's
array mode, as JSON on stdout: run as ``python -m tests.placements`` under
``DASK_ARRAY__QUERY_PLANNING=True`` and without it, the two outputs compare legacy mode with
array-expression mode (``array.query-planning`` is read once, when dask.array is imported).

Per case: whether the result equals plain Dask's (value, type, dtype), the devices the plan
puts each op family on, whether the device ran, and its fallbacks; or why the case cannot be
built in this mode (array expressions lack ``@`` in Dask 2026.8).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import dask
import dask.array as da
import numpy as np

import eugo_dask

from .conftest import H200_SERVER
from .pipelines import CASES

SETTINGS = {"optimizations": [eugo_dask.eugo], "eugo.device": "emulated",
            "eugo.min-speedup": 0, "eugo.profile": H200_SERVER}


def _same(result: Any, expected: Any) -> bool:
    return (type(result) is type(expected) and result.dtype == expected.dtype
            and np.shape(result) == np.shape(expected)
            and np.allclose(result, expected, equal_nan=True))


def summary(name: str) -> dict[str, Any]:
    """What eugo did with case ``name``, with and without it (see the module docstring)."""
    try:
        plain = CASES[name]()
    except (NotImplementedError, AttributeError) as exc:  # (what the mode lacks)
        return {"not expressible": f"{type(exc).__name__}: {exc}"}
    with dask.config.set(optimizations=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = plain.compute(scheduler="sync")
    with dask.config.set(SETTINGS):
        eugo_dask.reset_device_stats()
        collection = CASES[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (test_equivalence compares the warnings)
            result = collection.compute(scheduler="sync")
        stats = eugo_dask.device_stats()
        plan = eugo_dask.explain(collection)
    placements: dict[str, set[str]] = {}
    for decision in plan:
        placements.setdefault(decision.op, set()).add(decision.device)
    return {"same result": _same(result, expected),
            "placements": {op: sorted(devices) for op, devices in sorted(placements.items())},
            "device ran": stats["tasks"] > 0, "planned on the device": bool(plan.gpu_keys),
            "fallbacks": stats["fallbacks"]}


def main(names: list[str]) -> None:
    out = {name: summary(name) for name in names or sorted(CASES)}
    json.dump({"expressions": da.array_expr_enabled(),
               "cases": out}, sys.stdout, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
