"""What the eugo pass did in this process: the what-if totals of its recent plans and counts of
its outcomes.

The pass runs where a graph is optimized: on the client for a local scheduler, and on the
scheduler (in the thread it materializes graphs in) for a cluster. The scheduler plugin, the
metrics and the dashboard live in the scheduler's process, and nothing the pass returns reaches
them (it returns a graph): this log, one per process, is the channel. The pass writes it
(:func:`record_plan`, :func:`record_outcome`, :func:`record_failure`); the scheduler plugin
hands the plans on in its summary (which the dashboard reads) and the metrics read
:func:`pass_stats`. Several schedulers in one process (tests) share it, as they share the pass.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from typing import Any

#: What-if totals of the plans made in this process, newest last.
_plans: deque[dict[str, Any]] = deque(maxlen=100)

_count = 0  # plans recorded so far (their ids)

_stats = {"graphs_planned": 0, "graphs_rewritten": 0, "pass_errors": 0, "errors_logged": 0}


def record_plan(totals: Mapping[str, Any]) -> str:
    """Keep one plan's summary (its time, profile, task counts, what-if totals and work) and
    return its id, unique in this process (``plan_work`` finds its work by it)."""
    global _count
    _count += 1
    plan_id = f"{os.getpid()}-{_count}"
    _plans.append({**totals, "id": plan_id})
    return plan_id


def recent_plans() -> list[dict[str, Any]]:
    """Copies of the summaries of the last 100 plans made in this process, oldest first,
    without their work (see :func:`plan_work`)."""
    return [{k: v for k, v in p.items() if k != "work"} for p in _plans]


def plan_work(plan_id: str) -> list[tuple[int, float, float | None]] | None:
    """The work of the recent plan ``plan_id`` (:func:`eugo_dask.schedule.work_groups`), or
    None where it is not known (an older plan, or one made in another process)."""
    for plan in reversed(_plans):
        if plan.get("id") == plan_id:
            work = plan.get("work")
            return list(work) if work is not None else None
    return None


def record_outcome(*, rewritten: bool) -> None:
    """Count a graph the pass planned, and whether it rewrote it."""
    _stats["graphs_planned"] += 1
    if rewritten:
        _stats["graphs_rewritten"] += 1


def record_failure() -> bool:
    """Count a failure of the pass (its graph ran unchanged). Returns whether it is the first
    one here, which the pass logs in full (later ones are counted only)."""
    _stats["pass_errors"] += 1
    first = not _stats["errors_logged"]
    _stats["errors_logged"] += 1
    return first


def pass_stats() -> dict[str, int]:
    """Counters of the pass in this process: graphs planned, graphs rewritten, and failures
    of the pass (each of which ran its graph unchanged)."""
    return {k: v for k, v in _stats.items() if k != "errors_logged"}
