"""Plans as people read them: a text table and an HTML table, made from one set of rows.

:func:`plan_rows` groups task records by key prefix (one row per prefix: task count, how many
on the GPU, summed estimates, the first task's reason); :func:`plan_text` and :func:`plan_html`
lay the same rows out, with the copies the plan makes (:func:`copies_text`). Records are anything with the fields of
:class:`~eugo_dask.plan.Decision` (:class:`TaskRecord`), so this module knows nothing of how a
plan is made.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from html import escape
from typing import Literal, Protocol

from eugo_dask.ops import CPU, GPU, DeviceSetting, Family, Placement

#: The what-if totals a plan carries, with the words that name them.
TOTALS = (("all-CPU", "all_cpu"), ("all-GPU", "all_gpu"), ("as chosen", "as_chosen"))


class TaskRecord(Protocol):
    """What a row needs of one task's decision."""

    @property
    def prefix(self) -> str: ...
    @property
    def op(self) -> Family: ...
    @property
    def device(self) -> Placement: ...
    @property
    def cpu_s(self) -> float: ...
    @property
    def gpu_s(self) -> float | None: ...
    @property
    def h2d_s(self) -> float: ...
    @property
    def d2h_s(self) -> float: ...
    @property
    def reason(self) -> str: ...


def format_seconds(seconds: float | None) -> str:
    """``0.0412`` -> ``'41.2 ms'``."""
    if seconds is None or math.isinf(seconds):
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    """``4194304`` -> ``'4.19 MB'``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class PlanRow:
    """One task prefix of a plan."""

    prefix: str
    op: Family
    tasks: int
    on_gpu: int
    cpu_s: float
    gpu_s: float | None  # None where no task of the prefix can run on a device
    h2d_s: float
    d2h_s: float
    reason: str  # the first task's

    @property
    def placement(self) -> Placement | Literal[""]:
        """``gpu``/``cpu`` where every task of the prefix went one way, else empty."""
        return GPU if self.on_gpu == self.tasks else CPU if not self.on_gpu else ""


def plan_rows(records: Iterable[TaskRecord]) -> list[PlanRow]:
    """One row per key prefix, in the order prefixes first appear."""
    groups: dict[str, list[TaskRecord]] = {}
    for record in records:
        groups.setdefault(record.prefix, []).append(record)
    rows = []
    for prefix, group in groups.items():
        gpu = [d.gpu_s for d in group if d.gpu_s is not None]
        rows.append(PlanRow(
            prefix=prefix, op=group[0].op, tasks=len(group),
            on_gpu=sum(d.device == GPU for d in group),
            cpu_s=sum(d.cpu_s for d in group), gpu_s=sum(gpu) if gpu else None,
            h2d_s=sum(d.h2d_s for d in group), d2h_s=sum(d.d2h_s for d in group),
            reason=group[0].reason,
        ))
    return rows


def _totals_text(totals: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {format_seconds(totals.get(key, math.inf))}" for name, key in TOTALS)


def plan_heading(*, tasks: int, profile: str, device: DeviceSetting | None,
                 min_speedup: float) -> str:
    return (f"eugo plan: {tasks} tasks, profile {profile}, device "
            f"{device or 'none (the graph would run unchanged)'}, min-speedup {min_speedup:g}")


def copies_text(to_device: int, to_device_bytes: float, to_host: int, to_host_bytes: float) -> str:
    """``copies: 16 to the device (67.1 MB), 16 back (0.066 MB)``."""
    return (f"copies: {to_device} to the device ({format_bytes(to_device_bytes)}), {to_host} back "
            f"({format_bytes(to_host_bytes)})")


def plan_text(heading: str, rows: list[PlanRow], totals: Mapping[str, float],
              copies: str = "") -> str:
    """A fixed-width table: heading, one line per row, the copies it makes, the what-if
    totals."""
    lines = [
        heading,
        f"{'prefix':<28} {'op':<11} {'tasks':>6} {'gpu':>5} {'cpu s':>9} {'gpu s':>9} "
        f"{'h2d s':>9} {'d2h s':>9}  reason (first task)",
    ]
    for r in rows:
        lines.append(
            f"{r.prefix[:28]:<28} {r.op[:11]:<11} {r.tasks:>6} {r.on_gpu:>5} "
            f"{format_seconds(r.cpu_s):>9} {format_seconds(r.gpu_s):>9} "
            f"{format_seconds(r.h2d_s):>9} {format_seconds(r.d2h_s):>9}  {r.reason}"
        )
    lines += [copies] if copies else []
    lines.append(f"what-if task-seconds: {_totals_text(totals)}")
    return "\n".join(lines)


HTML_STYLE = (
    "table.eugo{border-collapse:collapse;font:13px sans-serif}"
    ".eugo th,.eugo td{border:1px solid #ddd;padding:3px 7px;text-align:right}"
    ".eugo td.l,.eugo th.l{text-align:left}.eugo .gpu{background:#e3f3c4}"
    ".eugo .cpu{background:#e6ecf2}.eugo caption{text-align:left;padding:4px 0}"
)
_HTML_COLUMNS = ("prefix", "op", "tasks", "on GPU", "CPU s", "GPU s", "H2D s", "D2H s",
                 "reason (first task)")
_LEFT = {"prefix", "op", "reason (first task)"}


def plan_html(heading: str, rows: list[PlanRow], totals: Mapping[str, float],
              copies: str = "") -> str:
    """An HTML table of the rows (GPU rows tinted, reasons in full) with its own style."""
    body = []
    for r in rows:
        cells = [
            f"<td class='l'>{escape(r.prefix)}</td>", f"<td class='l'>{escape(r.op)}</td>",
            f"<td>{r.tasks}</td>", f"<td>{r.on_gpu}</td>",
            *(f"<td>{format_seconds(s)}</td>" for s in (r.cpu_s, r.gpu_s, r.h2d_s, r.d2h_s)),
            f"<td class='l'>{escape(r.reason)}</td>",
        ]
        body.append(f"<tr class='{r.placement}'>{''.join(cells)}</tr>")
    header = "".join(f"<th{' class=l' if h in _LEFT else ''}>{h}</th>" for h in _HTML_COLUMNS)
    # (the first letter capitalised: str.capitalize would lower the units, MB to mb)
    said = escape(copies[:1].upper() + copies[1:]) + ". " if copies else ""
    caption = f"{escape(heading)}. {said}" \
              f"What-if task-seconds: {_totals_text(totals)}."
    return (f"<style>{HTML_STYLE}</style><table class='eugo'><caption>{caption}</caption>"
            f"<thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def html_page(table: str) -> str:
    """A standalone HTML page around a table from :func:`plan_html`."""
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>eugo plan</title>"
            f"<style>{HTML_STYLE}</style></head><body>{table}</body></html>")
