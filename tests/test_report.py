"""report: the rows, text and HTML a plan is read as, from records with Decision's fields."""

from __future__ import annotations

import math
from dataclasses import dataclass

import dask.array as da
import pytest

from eugo_dask.report import (
    PlanRow,
    copies_text,
    format_bytes,
    format_seconds,
    html_page,
    plan_heading,
    plan_html,
    plan_rows,
    plan_text,
)


@dataclass(frozen=True)
class Record:
    """A task's decision as report reads it (the TaskRecord protocol)."""

    prefix: str
    device: str = "cpu"
    cpu_s: float = 1.0
    gpu_s: float | None = 0.5
    h2d_s: float = 0.1
    d2h_s: float = 0.2
    op: str = "elementwise"
    reason: str = "why"


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0412, "41.2 ms"), (2.0, "2 s"), (150.0, "150 s"), (1234.5, "1234 s"), (0.5e-3, "500 µs"),
    (1e-7, "0.1 µs"), (0.0, "0 µs"), (None, "n/a"), (math.inf, "n/a"),
])
def test_seconds_read_in_the_unit_that_suits_them(seconds, text):
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(("n", "text"), [
    (4194304, "4.19 MB"), (999, "999 B"), (1000, "1 kB"), (66_000, "66 kB"), (2.5e9, "2.5 GB"),
    (3e15, "3e+03 TB"),
])
def test_bytes_read_in_the_unit_that_suits_them(n, text):
    assert format_bytes(n) == text


def test_rows_group_records_by_prefix_in_the_order_prefixes_first_appear():
    records = [Record("b", device="gpu", cpu_s=1, gpu_s=0.25, reason="first b"),
               Record("a", gpu_s=None, h2d_s=0.0, d2h_s=0.0, op="io", reason="first a"),
               Record("b", device="cpu", cpu_s=2, gpu_s=None, h2d_s=0.5, reason="second b"),
               Record("a", gpu_s=None, h2d_s=0.0, d2h_s=0.0, op="io", reason="second a"),
               Record("c", device="gpu", gpu_s=0.125)]
    rows = plan_rows(records)
    assert [r.prefix for r in rows] == ["b", "a", "c"]
    b, a, c = rows
    assert (b.tasks, b.on_gpu, b.cpu_s, b.gpu_s) == (2, 1, 3.0, 0.25)  # gpu_s: the tasks that have one
    assert (b.h2d_s, b.d2h_s, b.reason, b.op) == (0.6, 0.4, "first b", "elementwise")
    assert (a.tasks, a.on_gpu, a.gpu_s, a.op, a.reason) == (2, 0, None, "io", "first a")
    assert (b.placement, a.placement, c.placement) == ("", "cpu", "gpu")
    assert plan_rows([]) == []


def test_the_text_table_has_a_line_per_row_the_copies_and_the_totals():
    rows = [PlanRow("matmul-" + "x" * 40, "matmul-like-op", 4, 4, 2.0, 0.0412, 0.003, 0.001, "faster"),
            PlanRow("sum", "reduction", 2, 0, 1e-4, None, 0.0, 0.0, "too small")]
    copies = copies_text(16, 67_108_864, 16, 65_536)
    assert copies == "copies: 16 to the device (67.1 MB), 16 back (65.5 kB)"
    text = plan_text("HEAD", rows, {"all_cpu": 2.0, "as_chosen": 0.05}, copies)
    lines = text.splitlines()
    assert lines[0] == "HEAD"
    assert lines[1].split()[:8] == ["prefix", "op", "tasks", "gpu", "cpu", "s", "gpu", "s"]
    first = lines[2]
    assert first.startswith("matmul-" + "x" * 21 + " matmul-like ")  # prefix and op cut to their columns
    assert first.split()[2:4] == ["4", "4"] and "41.2 ms" in first and first.endswith("  faster")
    assert lines[3].split()[:4] == ["sum", "reduction", "2", "0"] and " n/a " in lines[3]
    assert lines[4] == copies
    # a total the plan does not carry reads n/a
    assert lines[5] == "what-if task-seconds: all-CPU 2 s, all-GPU n/a, as chosen 50 ms"
    assert len(lines) == 6
    without_copies = plan_text("HEAD", rows, {}).splitlines()
    assert len(without_copies) == 5 and not without_copies[4].startswith("copies")


def test_the_html_table_tints_rows_by_placement_and_escapes_what_it_shows():
    rows = [PlanRow("gpu<all>", "matmul", 2, 2, 1.0, 0.1, 0.0, 0.0, "a & b"),
            PlanRow("mixed", "elementwise", 2, 1, 1.0, 0.1, 0.0, 0.0, "half"),
            PlanRow("cpu", "io", 1, 0, 1.0, None, 0.0, 0.0, "<read>")]
    html = plan_html("plan <x>", rows, {"all_cpu": 1.0, "all_gpu": 0.5, "as_chosen": 0.5},
                     "copies: 1 to the device (8 B), 0 back (0 B)")
    assert html.count("<tr class='gpu'>") == 1 and html.count("<tr class='cpu'>") == 1
    assert html.count("<tr class=''>") == 1
    assert "gpu&lt;all&gt;" in html and "a &amp; b" in html and "&lt;read&gt;" in html
    assert "<read>" not in html and "plan <x>" not in html
    assert "<caption>plan &lt;x&gt;. Copies: 1 to the device" in html
    assert "What-if task-seconds: all-CPU 1 s, all-GPU 500 ms, as chosen 500 ms.</caption>" in html
    assert html.count("<tr") == 4  # the header and a row each
    page = html_page(html)
    assert page.startswith("<!DOCTYPE html>") and html in page and page.endswith("</html>")


def test_the_heading_says_when_no_device_would_change_the_graph():
    assert plan_heading(tasks=3, profile="h200", device="emulated", min_speedup=1.5) == \
        "eugo plan: 3 tasks, profile h200, device emulated, min-speedup 1.5"
    assert "device none (the graph would run unchanged)" in plan_heading(
        tasks=0, profile="p", device=None, min_speedup=1.0)


def test_a_real_plan_reads_as_rows_of_its_decisions(emulated):
    """explain's plan is a list of Decisions: its rows count every task once, its GPU tasks
    where it put them, and its text is made of those rows."""
    import eugo_dask

    x = da.ones((2000, 2000), chunks=1000)
    plan = eugo_dask.explain((x @ x.T).sum(axis=0))
    rows = plan_rows(plan)
    assert sum(r.tasks for r in rows) == len(plan)
    assert sum(r.on_gpu for r in rows) == len(plan.gpu_keys) > 0
    assert len({r.prefix for r in rows}) == len(rows)
    text = str(plan)
    for row in rows:
        assert any(line.startswith(row.prefix[:28]) for line in text.splitlines())


def test_the_html_caption_keeps_the_copies_units():
    """The HTML caption says the copies with their units as the text does: "67.1 MB", not
    "67.1 mb" (``str.capitalize`` lowercases all but the first letter: megabits... millibits).
    FAILS on the code as it is: a bug found writing this file, left for report.py's owner."""
    copies = copies_text(16, 67_108_864, 16, 65_536)
    html = plan_html("plan", [], {}, copies)
    assert "Copies: 16 to the device (67.1 MB), 16 back (65.5 kB)." in html
