"""What ran where: a report of the computations run inside a ``with`` block, from what the tasks
themselves reported, beside what the plan put on the GPU.

>>> import eugo_dask
>>> with eugo_dask.what_ran() as report:     # doctest: +SKIP
...     result = pipeline.compute()
>>> print(report)                            # doctest: +SKIP

Named for the question it answers; ``eugo.profile`` and :func:`eugo_dask.load_profile` already
mean the machine's hardware profile, so this is no "profiler".

Where the numbers come from (the report says which applied, in ``sources``):

- **GPU-planned tasks** (the tasks the plan put on a device, each a
  :class:`~eugo_dask.runtime.DeviceCall`): every one reports once whether it ran on the device
  or its CPU path (a fallback, by category), and eugo times each call, its CPU path included
  (:data:`eugo_dask.runtime.ledger`). On a local scheduler this process's ledger; with a
  distributed client each worker process's, read through ``client.run``.
- **Copies** between host and device: :func:`~eugo_dask.device_stats` (arrays and bytes each
  way, fallback reasons) of this process, or of every worker process.
- **Other tasks** (those the plan kept on the CPU, aggregation, reads): on a local scheduler
  Dask's scheduler callbacks (:class:`dask.callbacks.Callback`, as ``dask.diagnostics.Profiler``
  uses them), seconds from handing a task to the pool to receiving its result; with a
  distributed client the eugo scheduler plugin's counts of CPU-planned tasks and the compute
  seconds workers measured (``summary()["prefixes"]``). Without the plugin they are not counted,
  and the report says so.
- **The plan**: the plans the pass recorded while the block ran (:mod:`eugo_dask.pass_log`: in
  this process for a local scheduler, on the scheduler for a cluster). Per prefix, "planned GPU"
  is the GPU-planned tasks that ran (each reports where it ran), the plan as written into the
  graph.

Everything is a difference of counters between the start and the end of the block: other
computations running in the same processes at the same time are counted too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from html import escape
from types import TracebackType
from typing import Any

from dask.callbacks import Callback
from dask.utils import key_split

from eugo_dask.context import compute_get
from eugo_dask.devices.stats import device_stats
from eugo_dask.graph import EUGO_PREFIXES
from eugo_dask.pass_log import recent_plans
from eugo_dask.report import HTML_STYLE, format_bytes, format_seconds
from eugo_dask.runtime import RAN_ON_CPU, RAN_ON_DEVICE, DeviceCall, ledger, to_device, to_host

_FALLBACK = "eugo-fallback-"


@dataclass
class PrefixRan:
    """One task prefix (the plan's, as :func:`~eugo_dask.explain` names it) as it ran.

    ``gpu_s``/``cpu_s``: measured seconds of its tasks that ran on a device / on the CPU (None:
    not measured)."""

    prefix: str
    planned_gpu: int = 0
    on_gpu: int = 0
    on_cpu: int = 0
    gpu_s: float | None = None
    cpu_s: float | None = None
    fallbacks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _add(a: float | None, b: float) -> float:
    return (a or 0.0) + b


class _TaskTimer(Callback):
    """Dask's local-scheduler callbacks: each task's prefix, kind and seconds (from handing it
    to the pool to receiving its result, in the scheduler's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._started: dict[tuple[int, Any], float] = {}
        self.cpu: Counter[str] = Counter()
        self.cpu_s: dict[str, float] = {}
        self.gpu_planned: Counter[str] = Counter()
        self.copy_tasks: Counter[str] = Counter()

    def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
        with self._lock:
            self._started[(id(state), key)] = time.perf_counter()

    def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        stopped = time.perf_counter()
        func = getattr(dsk.get(key), "func", None)
        with self._lock:
            started = self._started.pop((id(state), key), stopped)
            if isinstance(func, DeviceCall):
                self.gpu_planned[func.prefix] += 1  # (its outcome and seconds: the ledger's)
            elif func is to_device or func is to_host:
                self.copy_tasks["to_device" if func is to_device else "to_host"] += 1
            else:
                prefix = key_split(key)
                self.cpu[prefix] += 1
                self.cpu_s[prefix] = self.cpu_s.get(prefix, 0.0) + stopped - started


def _ledger_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {"tasks": {}, "seconds": {}}
    for part in ("tasks", "seconds"):
        for prefix, activities in after[part].items():
            for activity, value in activities.items():
                change = value - before[part].get(prefix, {}).get(activity, 0)
                if change:
                    out[part].setdefault(prefix, {})[activity] = change
    return out


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before.get(k, 0) for k in
           ("h2d_count", "h2d_bytes", "d2h_count", "d2h_bytes", "tasks", "fallbacks")}
    reasons = Counter(after.get("fallback_reasons", {}))
    reasons.subtract(before.get("fallback_reasons", {}))
    out["fallback_reasons"] = {r: n for r, n in reasons.items() if n > 0}
    return out


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: 0 for k in ("h2d_count", "h2d_bytes", "d2h_count", "d2h_bytes",
                                          "tasks", "fallbacks")}
    reasons: Counter[str] = Counter()
    for part in parts:
        for k in out:
            out[k] += part[k]
        reasons.update(part["fallback_reasons"])
    out["fallback_reasons"] = dict(reasons)
    return out


def _sum_ledgers(parts: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {"tasks": {}, "seconds": {}}
    for part in parts:
        for name in ("tasks", "seconds"):
            for prefix, activities in part[name].items():
                row = out[name].setdefault(prefix, {})
                for activity, value in activities.items():
                    row[activity] = row.get(activity, 0) + value
    return out


def process_snapshot() -> dict[str, Any]:
    """This process's counters the report reads: its id, eugo's ledger of GPU-planned tasks and
    :func:`~eugo_dask.device_stats` (run on every worker through ``client.run``; workers that
    share a process share them, so the report counts each process once)."""
    return {"pid": os.getpid(), "ledger": ledger.snapshot(), "stats": device_stats()}


def _plugin_snapshot(dask_scheduler: Any) -> dict[str, Any] | None:
    """The eugo scheduler plugin's summary, or None where it is not registered (run on the
    scheduler)."""
    plugin = dask_scheduler.plugins.get("eugo")
    summary = getattr(plugin, "summary", None)
    return summary() if callable(summary) else None


async def _heartbeat(dask_worker: Any) -> None:
    """Send this worker's heartbeat now: it carries the task metrics the plugin counts."""
    await dask_worker.heartbeat()


def _plugin_counts(summary: dict[str, Any]) -> dict[str, Any]:
    """The totals of the plugin's summary the report compares (workers' reports, and the
    plugin's own counts of the tasks it saw finish)."""
    tasks = summary.get("tasks", {})
    prefixes = summary.get("prefixes", {})
    return {
        "on_gpu": sum(tasks.get("gpu", {}).values()),
        "cpu_path": sum(n for p, n in tasks.get("cpu", {}).items() if p.startswith("eugo-gpu")),
        "planned_gpu": sum(s["planned_gpu"] for s in prefixes.values()),
        "cpu_tasks": {p: s["cpu_tasks"] for p, s in prefixes.items()},
        "actual_s": {p: s["actual_s"] for p, s in prefixes.items()},
        "bytes_h2d": summary.get("bytes_h2d", 0),
        "bytes_d2h": summary.get("bytes_d2h", 0),
        "fallbacks": dict(summary.get("fallbacks", {})),
    }


def _counts_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in after.items():
        if isinstance(v, dict):
            old = before.get(k, {})
            out[k] = {p: n - old.get(p, 0) for p, n in v.items() if n - old.get(p, 0)}
        else:
            out[k] = v - before.get(k, 0)
    return out


def _default_client() -> Any:
    """The distributed client ``compute`` would use now, or None (a local scheduler)."""
    if "distributed" not in sys.modules:
        return None
    from distributed import Client

    owner = getattr(compute_get(), "__self__", None)
    return owner if isinstance(owner, Client) else None


class RanReport:
    """What ran where for the computations inside ``with what_ran() as report:``; filled when
    the block ends. ``print(report)`` for a table, ``report.to_dict()`` for data; a notebook
    shows it as HTML.

    Attributes (after the block): ``rows`` (prefix -> :class:`PrefixRan`), ``copies`` (arrays
    and bytes each way), ``fallback_reasons`` (reason -> count), ``plans`` (the plans made
    meanwhile), ``scheduler`` (``"local"`` or ``"distributed"``), ``sources`` (where each
    number comes from), ``notes`` (what is not counted, and why), ``plugin`` (with a cluster:
    the eugo scheduler plugin's own totals over the block, or None without it)."""

    def __init__(self, client: Any = None, *, wait: float = 10.0) -> None:
        self._client = client
        self._wait = wait
        self.done = False
        self.scheduler = "local"
        self.rows: dict[str, PrefixRan] = {}
        self.copies: dict[str, dict[str, int]] = {}
        self.fallback_reasons: dict[str, int] = {}
        self.plans: dict[str, Any] = {}
        self.sources: list[str] = []
        self.notes: list[str] = []
        self.plugin: dict[str, Any] | None = None
        self._before: dict[str, Any] = {}
        self._timer: _TaskTimer | None = None

    # -- the block ----------------------------------------------------------------------------
    def __enter__(self) -> RanReport:
        client = self._client if self._client is not None else _default_client()
        self._client = client
        if client is None:
            self._before = {"process": process_snapshot(),
                            "plans": {p["id"] for p in recent_plans()}}
            self._timer = _TaskTimer()
            self._timer.register()
        else:
            self.scheduler = "distributed"
            # (settled: the workers' reports of computations before the block are in)
            summary, settled = self._settled_summary(client, 0)
            if not settled:
                self.notes.append(f"the workers' reports of computations before the block had "
                                  f"not all reached the scheduler after {self._wait:g} s: the "
                                  "plugin's totals may count some of them")
            self._before = {"workers": self._workers(client), "summary": summary,
                            "plans": {p["id"] for p in (summary or {}).get("plans", [])}}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.unregister()
            self._local(self._timer)
        else:
            self._distributed(self._client)
        self.done = True

    # -- collecting ---------------------------------------------------------------------------
    @staticmethod
    def _workers(client: Any) -> dict[int, dict[str, Any]]:
        """Each worker process's counters, once per process."""
        return {s["pid"]: s for s in client.run(process_snapshot).values()}

    def _settled_summary(self, client: Any, ran: int, before: dict[str, Any] | None = None
                         ) -> tuple[dict[str, Any] | None, bool]:
        """The plugin's summary (None without the plugin) once the workers' reports, which come
        with their heartbeats (asked for now), account for every GPU-planned task the plugin saw
        finish, and for ``ran`` more than ``before``; waits ``wait`` seconds at most."""
        with contextlib.suppress(Exception):  # (a worker that cannot be reached: waited for)
            client.run(_heartbeat)
        deadline = time.monotonic() + self._wait
        while True:
            summary = client.run_on_scheduler(_plugin_snapshot)
            if summary is None:
                return None, True
            counts = _plugin_counts(summary)
            reported = counts["on_gpu"] + counts["cpu_path"]
            since = reported - ((before["on_gpu"] + before["cpu_path"]) if before else 0)
            settled = reported >= counts["planned_gpu"] and since >= ran
            if settled or time.monotonic() > deadline:
                return summary, settled
            time.sleep(0.1)

    def _gpu_rows(self, ledger_delta: dict[str, Any]) -> None:
        for prefix, activities in ledger_delta["tasks"].items():
            row = self.rows.setdefault(prefix, PrefixRan(prefix))
            seconds = ledger_delta["seconds"].get(prefix, {})
            row.on_gpu += int(activities.get(RAN_ON_DEVICE, 0))
            row.on_cpu += int(activities.get(RAN_ON_CPU, 0))
            row.planned_gpu += int(activities.get(RAN_ON_DEVICE, 0) + activities.get(RAN_ON_CPU, 0))
            if RAN_ON_DEVICE in activities:
                row.gpu_s = _add(row.gpu_s, seconds.get(RAN_ON_DEVICE, 0.0))
            if RAN_ON_CPU in activities:
                row.cpu_s = _add(row.cpu_s, seconds.get(RAN_ON_CPU, 0.0))
            row.fallbacks.update({a[len(_FALLBACK):]: int(n) for a, n in activities.items()
                                  if a.startswith(_FALLBACK)})

    def _copies_and_reasons(self, stats: dict[str, Any]) -> None:
        self.copies = {"to_device": {"arrays": stats["h2d_count"], "bytes": stats["h2d_bytes"]},
                       "to_host": {"arrays": stats["d2h_count"], "bytes": stats["d2h_bytes"]}}
        self.fallback_reasons = dict(stats["fallback_reasons"])

    def _plans(self, plans: list[dict[str, Any]], where: str) -> None:
        new = [p for p in plans if p["id"] not in self._before["plans"]]
        self.plans = {"graphs": len(new), "tasks": sum(p.get("tasks", 0) for p in new),
                      "gpu_tasks": sum(p.get("gpu_tasks", 0) for p in new),
                      "profiles": sorted({str(p.get("profile")) for p in new}), "where": where}
        if not new:
            self.notes.append("eugo planned no graph inside the block (is "
                              "dask.config.set(optimizations=[eugo_dask.eugo]) in force?)")

    def _local(self, timer: _TaskTimer) -> None:
        after = process_snapshot()
        before = self._before["process"]
        self._gpu_rows(_ledger_delta(before["ledger"], after["ledger"]))
        for prefix, n in timer.cpu.items():
            row = self.rows.setdefault(prefix, PrefixRan(prefix))
            row.on_cpu += n
            row.cpu_s = _add(row.cpu_s, timer.cpu_s[prefix])
        self._copies_and_reasons(_stats_delta(before["stats"], after["stats"]))
        self._plans(recent_plans(), "this process")
        self.sources = [
            "GPU-planned tasks: eugo's record of each one in this process (where it ran, its "
            "fallbacks, its seconds timed around the call)",
            "copies and fallback reasons: device_stats() of this process",
            "other tasks: Dask's local scheduler callbacks (seconds from handing the task to "
            "the pool to receiving its result)",
            "plans: the pass's log in this process",
        ]
        reported = sum(r.planned_gpu for r in self.rows.values())
        scheduled = sum(timer.gpu_planned.values())
        if scheduled > reported:
            self.notes.append(
                f"{scheduled - reported} of {scheduled} GPU-planned tasks ran where this process "
                "cannot read their outcome (a processes scheduler's pool): not in the rows")

    def _distributed(self, client: Any) -> None:
        workers = self._workers(client)
        before = self._before["workers"]
        ledgers, stats = [], []
        for pid, now in workers.items():
            was = before.get(pid)
            if was is None:  # a process that joined meanwhile: all it counted is new
                was = {"ledger": {"tasks": {}, "seconds": {}}, "stats": {}}
            ledgers.append(_ledger_delta(was["ledger"], now["ledger"]))
            stats.append(_stats_delta(was["stats"], now["stats"]))
        ledger_delta = _sum_ledgers(ledgers)
        self._gpu_rows(ledger_delta)
        self._copies_and_reasons(_sum_stats(stats))
        self.sources = [
            "GPU-planned tasks: eugo's record of each one in every worker process, read with "
            "client.run (where it ran, its fallbacks, its seconds timed around the call)",
            "copies and fallback reasons: device_stats() of every worker process",
        ]
        if len(workers) < len(before):
            self.notes.append("worker processes left during the block: what they counted is "
                              "not in the report")
        summary_before = self._before["summary"]
        if summary_before is None:
            self.notes.append(
                "the eugo scheduler plugin is not registered on this cluster "
                "(client.register_plugin(EugoSchedulerPlugin()) or dask scheduler --preload "
                "eugo_dask.plugin): tasks the plan kept on the CPU are not counted, and no plan "
                "is shown")
            return
        ran = sum(r.planned_gpu for r in self.rows.values())
        summary, _ = self._settled_summary(client, ran, _plugin_counts(summary_before))
        if summary is None:
            self.notes.append("the eugo scheduler plugin was removed during the block")
            return
        counts = _counts_delta(_plugin_counts(summary_before), _plugin_counts(summary))
        reported = counts["on_gpu"] + counts["cpu_path"]
        if reported < ran:
            self.notes.append(f"the workers' reports to the scheduler counted {reported} of the "
                              f"{ran} GPU-planned tasks after {self._wait:g} s (they come with "
                              "heartbeats): the plugin's totals lag")
        self.plugin = counts
        for prefix, n in counts["cpu_tasks"].items():
            if prefix.startswith(EUGO_PREFIXES):
                continue
            row = self.rows.setdefault(prefix, PrefixRan(prefix))
            row.on_cpu += n
            row.cpu_s = _add(row.cpu_s, counts["actual_s"].get(prefix, 0.0))
        self._plans(summary.get("plans", []), "the scheduler")
        self.sources += [
            "tasks the plan kept on the CPU: the eugo scheduler plugin's counts as they "
            "finished, seconds the workers' own compute start and stop",
            "plans: the pass's log on the scheduler",
        ]

    # -- reading ------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        rows = self.rows.values()
        return {"planned_gpu": sum(r.planned_gpu for r in rows),
                "on_gpu": sum(r.on_gpu for r in rows), "on_cpu": sum(r.on_cpu for r in rows),
                "gpu_s": sum(r.gpu_s or 0.0 for r in rows),
                "cpu_s": sum(r.cpu_s or 0.0 for r in rows),
                "fallbacks": sum(sum(r.fallbacks.values()) for r in rows)}

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data."""
        return {"scheduler": self.scheduler, "done": self.done,
                "rows": {p: r.to_dict() for p, r in self._sorted()}, "totals": self.totals(),
                "copies": self.copies, "fallback_reasons": self.fallback_reasons,
                "plans": self.plans, "plugin": self.plugin, "sources": list(self.sources),
                "notes": list(self.notes)}

    def _sorted(self) -> list[tuple[str, PrefixRan]]:
        return sorted(self.rows.items(), key=lambda item: (-item[1].planned_gpu, item[0]))

    def _heading(self) -> str:
        if not self.done:
            return "eugo: what ran where (the block has not ended: nothing counted yet)"
        where = ("a local scheduler in this process" if self.scheduler == "local"
                 else "a distributed cluster")
        return f"eugo: what ran where, on {where}"

    def _lines_after(self) -> list[str]:
        to_device, to_host = self.copies.get("to_device", {}), self.copies.get("to_host", {})
        lines = [f"copies: {to_device.get('arrays', 0)} arrays to the device "
                 f"({format_bytes(to_device.get('bytes', 0))}), {to_host.get('arrays', 0)} back "
                 f"({format_bytes(to_host.get('bytes', 0))})"]
        if self.fallback_reasons:
            lines.append("fallbacks: " + "; ".join(f"{n} x {r}" for r, n in
                                                   sorted(self.fallback_reasons.items())))
        if self.plans.get("graphs"):
            lines.append(f"plans made meanwhile ({self.plans['where']}): {self.plans['graphs']}, "
                         f"{self.plans['tasks']} tasks, {self.plans['gpu_tasks']} of them on the "
                         f"GPU (profile {', '.join(self.plans['profiles'])})")
        lines += [f"from: {s}" for s in self.sources]
        lines += [f"note: {n}" for n in self.notes]
        return lines

    _COLUMNS = ("prefix", "planned GPU", "on GPU", "on CPU", "GPU s", "CPU s", "fallbacks")

    @staticmethod
    def _cells(row: PrefixRan) -> list[str]:
        return [row.prefix, str(row.planned_gpu), str(row.on_gpu), str(row.on_cpu),
                format_seconds(row.gpu_s) if row.gpu_s is not None else "-",
                format_seconds(row.cpu_s) if row.cpu_s is not None else "-",
                ", ".join(f"{c} {n}" for c, n in sorted(row.fallbacks.items())) or "-"]

    def __str__(self) -> str:
        lines = [self._heading(),
                 f"{'prefix':<28} {'planned GPU':>11} {'on GPU':>7} {'on CPU':>7} "
                 f"{'GPU s':>9} {'CPU s':>9}  fallbacks"]
        for _, row in self._sorted():
            c = self._cells(row)
            lines.append(f"{c[0][:28]:<28} {c[1]:>11} {c[2]:>7} {c[3]:>7} {c[4]:>9} {c[5]:>9}  "
                         f"{c[6]}")
        t = self.totals()
        lines.append(f"{'total':<28} {t['planned_gpu']:>11} {t['on_gpu']:>7} {t['on_cpu']:>7} "
                     f"{format_seconds(t['gpu_s']):>9} {format_seconds(t['cpu_s']):>9}  "
                     f"{t['fallbacks'] or '-'}")
        return "\n".join(lines + self._lines_after())

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        """The report as an HTML table (Jupyter shows this)."""
        header = "".join(f"<th{' class=l' if h in ('prefix', 'fallbacks') else ''}>{h}</th>"
                         for h in self._COLUMNS)
        body = []
        for _, row in self._sorted():
            cells = self._cells(row)
            tint = "gpu" if row.on_gpu else "cpu"
            body.append(f"<tr class='{tint}'><td class='l'>{escape(cells[0])}</td>"
                        + "".join(f"<td>{escape(c)}</td>" for c in cells[1:6])
                        + f"<td class='l'>{escape(cells[6])}</td></tr>")
        after = "".join(f"<li>{escape(line)}</li>" for line in self._lines_after())
        return (f"<style>{HTML_STYLE}</style><table class='eugo'><caption>"
                f"{escape(self._heading())}</caption><thead><tr>{header}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table><ul>{after}</ul>")


def what_ran(client: Any = None, *, wait: float = 10.0) -> RanReport:
    """Report what ran where for the computations inside a ``with`` block.

    >>> with what_ran() as report:          # doctest: +SKIP
    ...     y.compute()
    >>> print(report)                       # doctest: +SKIP

    Parameters
    ----------
    client
        The distributed client whose cluster runs the computations; default the one
        ``compute`` would use (none: a local scheduler in this process).
    wait
        With a cluster, the most seconds to wait at the end of the block for the workers'
        reports to reach the scheduler plugin (they come with heartbeats; the report asks each
        worker for one at once).

    Returns
    -------
    RanReport
        Filled when the block ends: per task prefix, the tasks the plan put on the GPU, the
        tasks that ran on a device and on the CPU, their measured seconds and fallbacks; the
        copies each way; the plans made meanwhile; where each number comes from.
    """
    return RanReport(client, wait=wait)


__all__ = ["PrefixRan", "RanReport", "process_snapshot", "what_ran"]
