"""The "Eugo" page of the scheduler's dashboard, at ``/eugo``, linked from the top bar.

Installed by ``dask scheduler --preload eugo_dask.plugin`` (preloads are imported before the
dashboard is built, so the page and the link exist from the start). Registering the plugin from a
client later adds the counters but cannot add a page to a dashboard already serving.

Live, every half second, from the scheduler plugin and the plans the eugo pass made here:

- tasks that ran on a GPU and on the CPU per task prefix, as workers report them;
- bytes copied host->device and device->host;
- predicted vs measured seconds per prefix;
- what-if task-seconds (all-CPU, all-GPU, as chosen) of the current and past computations;
- fallbacks and their reasons, and warnings (a GPU worker that cannot use a device, a worker
  with invalid settings).
"""

from __future__ import annotations

import logging
from html import escape
from typing import Any

from eugo_dask.optimization import recent_plans

logger = logging.getLogger(__name__)

ROUTE = "/eugo"


class EugoDashboard:
    """The page's Bokeh components and their periodic update."""

    def __init__(self, scheduler: Any) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool
        from bokeh.models.widgets import DataTable, Div, TableColumn
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.tasks = ColumnDataSource({"prefix": [], "gpu": [], "cpu": []})
        self.transfers = ColumnDataSource({"prefix": [], "mb": [], "direction": [], "color": []})
        self.seconds = ColumnDataSource({"prefix": [], "predicted": [], "actual": []})
        self.whatif = ColumnDataSource({"run": [], "all_cpu": [], "all_gpu": [], "as_chosen": []})
        self.fallbacks = ColumnDataSource({"reason": [], "count": []})

        self.task_prefixes = FactorRange()
        self.transfer_prefixes = FactorRange()
        self.timed_prefixes = FactorRange()
        self.tasks_fig = figure(title="Tasks by device, per prefix", y_range=self.task_prefixes,
                                height=320,
                                sizing_mode="stretch_width", toolbar_location=None,
                                name="eugo-tasks")
        self.tasks_fig.hbar_stack(["gpu", "cpu"], y="prefix", height=0.7, source=self.tasks,
                                  color=["#76b900", "#5f7f9f"], legend_label=["GPU", "CPU"])
        self.tasks_fig.add_tools(HoverTool(tooltips=[("prefix", "@prefix"), ("GPU", "@gpu"),
                                                     ("CPU", "@cpu")]))
        self.transfer_fig = figure(title="MB copied, per transfer prefix",
                                   y_range=self.transfer_prefixes,
                                   height=320, sizing_mode="stretch_width",
                                   toolbar_location=None, name="eugo-transfers")
        self.transfer_fig.hbar(y="prefix", right="mb", height=0.7, color="color",
                               legend_field="direction", source=self.transfers)
        self.seconds_fig = figure(title="Predicted vs measured seconds, per prefix",
                                  x_range=self.timed_prefixes,
                                  height=320, sizing_mode="stretch_width",
                                  toolbar_location=None, name="eugo-seconds")
        self.seconds_fig.scatter(x="prefix", y="predicted", size=11, color="#f28e2b",
                                 legend_label="predicted", source=self.seconds)
        self.seconds_fig.scatter(x="prefix", y="actual", size=11, marker="triangle",
                                 color="#4e79a7", legend_label="measured", source=self.seconds)
        self.seconds_fig.xaxis.major_label_orientation = 0.6
        self.whatif_fig = figure(title="What-if task-seconds per computation", height=320,
                                 sizing_mode="stretch_width", toolbar_location=None,
                                 name="eugo-whatif")
        for field, color in (("all_cpu", "#5f7f9f"), ("all_gpu", "#e15759"),
                             ("as_chosen", "#76b900")):
            self.whatif_fig.line(x="run", y=field, color=color, line_width=2,
                                 legend_label=field.replace("_", "-"), source=self.whatif)
            self.whatif_fig.scatter(x="run", y=field, color=color, size=7, source=self.whatif)
        self.whatif_fig.xaxis.axis_label = "computation"
        self.summary = Div(text="", name="eugo-summary")
        table = DataTable(source=self.fallbacks, height=140, sizing_mode="stretch_width",
                          columns=[TableColumn(field="reason", title="Fallback reason"),
                                   TableColumn(field="count", title="Task prefixes")])
        self.root = column(
            self.summary,
            row(self.tasks_fig, self.transfer_fig, sizing_mode="stretch_width"),
            row(self.seconds_fig, self.whatif_fig, sizing_mode="stretch_width"),
            table,
            sizing_mode="stretch_width",
        )

    def update(self) -> None:
        plugin = self.scheduler.plugins.get("eugo")
        summary = plugin.summary() if plugin is not None else _EMPTY
        gpu, cpu = summary["tasks"].get("gpu", {}), summary["tasks"].get("cpu", {})
        planned = sorted(set(gpu) | set(cpu), key=lambda p: gpu.get(p, 0) + cpu.get(p, 0))
        self.tasks.data = {"prefix": planned, "gpu": [gpu.get(p, 0) for p in planned],
                           "cpu": [cpu.get(p, 0) for p in planned]}
        self.task_prefixes.factors = planned
        moved = [(direction, summary[key] / 1e6, color) for direction, key, color in
                 (("host to device", "bytes_h2d", "#f28e2b"),
                  ("device to host", "bytes_d2h", "#4e79a7")) if summary[key]]
        self.transfers.data = {"prefix": [m[0] for m in moved], "mb": [m[1] for m in moved],
                               "direction": [m[0] for m in moved], "color": [m[2] for m in moved]}
        self.transfer_prefixes.factors = [m[0] for m in moved]
        prefixes = summary["prefixes"]
        timed = [p for p in prefixes if prefixes[p]["predicted_s"] or prefixes[p]["actual_s"]]
        self.seconds.data = {"prefix": timed,
                             "predicted": [prefixes[p]["predicted_s"] for p in timed],
                             "actual": [prefixes[p]["actual_s"] for p in timed]}
        self.timed_prefixes.factors = timed
        runs = list(recent_plans)
        self.whatif.data = {"run": list(range(1, len(runs) + 1)),
                            **{k: [r[k] for r in runs] for k in ("all_cpu", "all_gpu", "as_chosen")}}
        reasons = summary["fallback_reasons"]
        self.fallbacks.data = {"reason": list(reasons),
                               "count": [", ".join(p) for p in reasons.values()]}
        warnings = "".join(f"<li>{escape(w)}</li>" for w in summary["warnings"][-5:])
        self.summary.text = (
            f"<h3>eugo</h3><p><b>{sum(gpu.values())}</b> tasks ran on a GPU, "
            f"<b>{sum(cpu.values())}</b> on the CPU; "
            f"<b>{summary['bytes_h2d'] / 1e6:.1f} MB</b> to the device, "
            f"<b>{summary['bytes_d2h'] / 1e6:.1f} MB</b> back; "
            f"<b>{sum(summary['fallbacks'].values())}</b> fallbacks; estimated "
            f"<b>{summary['estimated_saved_s']:.3g} s</b> of task time saved; "
            f"{len(runs)} computations planned"
            + (f"; <b>{summary['dropped_reports']}</b> worker reports dropped (not a finite "
               "non-negative number)" if summary.get("dropped_reports") else "")
            + ".</p>"
            + (f"<ul class='eugo-warnings'>{warnings}</ul>" if warnings else "")
        )


_EMPTY: dict[str, Any] = {"tasks": {}, "bytes_h2d": 0, "bytes_d2h": 0, "prefixes": {},
                          "fallbacks": {}, "fallback_reasons": {}, "warnings": [],
                          "estimated_saved_s": 0.0}


def eugo_doc(scheduler: Any, extra: dict, doc: Any) -> None:
    """Bokeh document of the page."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = EugoDashboard(scheduler)
    page.update()
    add_periodic_callback(doc, page, 500)
    doc.title = "Dask: Eugo"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


_installed = False


def install() -> bool:
    """Add the page and its top-bar link to the scheduler dashboard (before it is built).
    Returns False where Bokeh (the dashboard) is not installed."""
    global _installed
    if _installed:
        return True
    try:
        import distributed.dashboard.scheduler as dashboard
    except ImportError:  # no bokeh: no dashboard at all
        return False
    dashboard.applications[ROUTE] = eugo_doc
    original = dashboard.template_variables

    def template_variables(scheduler):
        variables = original(scheduler)
        if "eugo" not in variables["pages"]:
            variables["pages"].append("eugo")
        return variables

    dashboard.template_variables = template_variables
    _installed = True
    return True
