"""The "Eugo" page of the scheduler's dashboard, at ``/eugo``, linked from the top bar.

Installed by ``dask scheduler --preload eugo_dask.plugin`` (preloads are imported before the
dashboard is built, so the page and the link exist from the start). Registering the plugin from a
client later adds the counters but cannot add a page to a dashboard already serving.

Live, every half second, from the scheduler plugin's summary (``scheduler.plugins["eugo"]``),
which also hands on the plans the eugo pass made in this process (:mod:`eugo_dask.pass_log`):

- tasks that ran on a GPU and on the CPU per task prefix, as workers report them;
- bytes copied host->device and device->host;
- predicted vs measured seconds per prefix;
- what-if task-seconds (all-CPU, all-GPU, as chosen) of the current and past computations;
- machine use of the recent computations: makespan against their plan's work bound on the
  machine they ran on, and how busy the CPU threads, GPUs and copies were;
- fallbacks and their reasons, and warnings (a GPU worker that cannot use a device, a worker
  with invalid settings).
"""

from __future__ import annotations

import logging
from html import escape
from typing import Any

logger = logging.getLogger(__name__)

ROUTE = "/eugo"


class Component:
    """One figure or table of the page: made once, then updated from the plugin's summary and
    the recent plans (as distributed's dashboard has one component per figure)."""

    root: Any

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        raise NotImplementedError


def _hbar_figure(title: str, name: str, y_range: Any) -> Any:
    from bokeh.plotting import figure

    return figure(title=title, y_range=y_range, height=320, sizing_mode="stretch_width",
                  toolbar_location=None, name=name)


class TasksByDevice(Component):
    """Tasks that ran on a GPU and on the CPU, per task prefix, as workers report them."""

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool

        self.source = ColumnDataSource({"prefix": [], "gpu": [], "cpu": []})
        self.prefixes = FactorRange()
        self.root = _hbar_figure("Tasks by device, per prefix", "eugo-tasks", self.prefixes)
        self.root.hbar_stack(["gpu", "cpu"], y="prefix", height=0.7, source=self.source,
                             color=["#76b900", "#5f7f9f"], legend_label=["GPU", "CPU"])
        self.root.add_tools(HoverTool(tooltips=[("prefix", "@prefix"), ("GPU", "@gpu"),
                                                ("CPU", "@cpu")]))

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        gpu, cpu = summary["tasks"].get("gpu", {}), summary["tasks"].get("cpu", {})
        planned = sorted(set(gpu) | set(cpu), key=lambda p: gpu.get(p, 0) + cpu.get(p, 0))
        self.source.data = {"prefix": planned, "gpu": [gpu.get(p, 0) for p in planned],
                            "cpu": [cpu.get(p, 0) for p in planned]}
        self.prefixes.factors = planned


class BytesCopied(Component):
    """Bytes copied host->device and device->host."""

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource, FactorRange

        self.source = ColumnDataSource({"prefix": [], "mb": [], "direction": [], "color": []})
        self.directions = FactorRange()
        self.root = _hbar_figure("MB copied, per transfer prefix", "eugo-transfers",
                                 self.directions)
        self.root.hbar(y="prefix", right="mb", height=0.7, color="color",
                       legend_field="direction", source=self.source)

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        moved = [(direction, summary[key] / 1e6, color) for direction, key, color in
                 (("host to device", "bytes_h2d", "#f28e2b"),
                  ("device to host", "bytes_d2h", "#4e79a7")) if summary[key]]
        self.source.data = {"prefix": [m[0] for m in moved], "mb": [m[1] for m in moved],
                            "direction": [m[0] for m in moved], "color": [m[2] for m in moved]}
        self.directions.factors = [m[0] for m in moved]


class PredictedSeconds(Component):
    """Predicted vs measured seconds per prefix."""

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource, FactorRange
        from bokeh.plotting import figure

        self.source = ColumnDataSource({"prefix": [], "predicted": [], "actual": []})
        self.prefixes = FactorRange()
        self.root = figure(title="Predicted vs measured seconds, per prefix",
                           x_range=self.prefixes, height=320, sizing_mode="stretch_width",
                           toolbar_location=None, name="eugo-seconds")
        self.root.scatter(x="prefix", y="predicted", size=11, color="#f28e2b",
                          legend_label="predicted", source=self.source)
        self.root.scatter(x="prefix", y="actual", size=11, marker="triangle", color="#4e79a7",
                          legend_label="measured", source=self.source)
        self.root.xaxis.major_label_orientation = 0.6

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        prefixes = summary["prefixes"]
        timed = [p for p in prefixes if prefixes[p]["predicted_s"] or prefixes[p]["actual_s"]]
        self.source.data = {"prefix": timed,
                            "predicted": [prefixes[p]["predicted_s"] for p in timed],
                            "actual": [prefixes[p]["actual_s"] for p in timed]}
        self.prefixes.factors = timed


class WhatIf(Component):
    """What-if task-seconds (all-CPU, all-GPU, as chosen) of the current and past plans."""

    FIELDS = (("all_cpu", "#5f7f9f"), ("all_gpu", "#e15759"), ("as_chosen", "#76b900"))

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.source = ColumnDataSource({"run": [], "all_cpu": [], "all_gpu": [], "as_chosen": []})
        self.root = figure(title="What-if task-seconds per computation", height=320,
                           sizing_mode="stretch_width", toolbar_location=None, name="eugo-whatif")
        for field, color in self.FIELDS:
            self.root.line(x="run", y=field, color=color, line_width=2,
                           legend_label=field.replace("_", "-"), source=self.source)
            self.root.scatter(x="run", y=field, color=color, size=7, source=self.source)
        self.root.xaxis.axis_label = "computation"

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        self.source.data = {"run": list(range(1, len(runs) + 1)),
                            **{k: [r[k] for r in runs] for k, _ in self.FIELDS}}


class Fallbacks(Component):
    """Fallback reasons and the task prefixes they struck."""

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.models.widgets import DataTable, TableColumn

        self.source = ColumnDataSource({"reason": [], "count": []})
        self.root = DataTable(source=self.source, height=140, sizing_mode="stretch_width",
                              columns=[TableColumn(field="reason", title="Fallback reason"),
                                       TableColumn(field="count", title="Task prefixes")])

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        reasons = summary["fallback_reasons"]
        self.source.data = {"reason": list(reasons),
                            "count": [", ".join(p) for p in reasons.values()]}


class MachineUse(Component):
    """The recent computations as they ran: makespan against the work bound of their plan on
    the machine they had, and how busy the CPU threads, the GPUs and the copies kept them."""

    COLUMNS = (("plan", "Plan"), ("tasks", "Tasks done / placed"), ("makespan", "Makespan"),
               ("bound", "Work bound"), ("ratio", "Makespan / bound"),
               ("cpu", "CPU busy"), ("gpu", "GPU busy"), ("copies", "Copies busy"))

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.models.widgets import DataTable, TableColumn

        self.source = ColumnDataSource({name: [] for name, _ in self.COLUMNS})
        self.root = DataTable(source=self.source, height=180, sizing_mode="stretch_width",
                              name="eugo-machine-use",
                              columns=[TableColumn(field=name, title=title)
                                       for name, title in self.COLUMNS])

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        rows = summary.get("usage", [])[::-1]  # newest first
        bounds = [r["bound_s"] for r in rows]
        self.source.data = {
            "plan": [str(r["plan"]) for r in rows],
            "tasks": [f"{r['done']} / {r['tasks']}" for r in rows],
            "makespan": [f"{r['makespan_s']:.3g} s" for r in rows],
            "bound": [f"{b:.3g} s" if b is not None else "unknown" for b in bounds],
            "ratio": [f"{r['makespan_s'] / b:.2f}x" if b else "" for r, b in zip(rows, bounds)],
            **{kind: [f"{r['busy'][kind]:.0%} of {r['gpu_slots' if kind != 'cpu' else 'cpu_threads']}"
                      for r in rows] for kind in ("cpu", "gpu", "copies")},
        }


class Summary(Component):
    """The headline: tasks, bytes, fallbacks, time saved, and the latest warnings (escaped:
    they hold text of clients and workers)."""

    def __init__(self) -> None:
        from bokeh.models.widgets import Div

        self.root = Div(text="", name="eugo-summary")

    def update(self, summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        gpu, cpu = summary["tasks"].get("gpu", {}), summary["tasks"].get("cpu", {})
        warnings = "".join(f"<li>{escape(w)}</li>" for w in summary["warnings"][-5:])
        self.root.text = (
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


class EugoDashboard:
    """The page: its components, each updated on its own every tick, so a figure whose update
    fails (logged and counted in ``errors``) leaves the others live."""

    def __init__(self, scheduler: Any) -> None:
        from bokeh.layouts import column, row

        self.scheduler = scheduler
        self.errors = 0
        self.summary = Summary()
        tasks, copied = TasksByDevice(), BytesCopied()
        seconds, whatif, fallbacks = PredictedSeconds(), WhatIf(), Fallbacks()
        use = MachineUse()
        self.components: list[Component] = [self.summary, tasks, copied, seconds, whatif,
                                            use, fallbacks]
        self.root = column(
            self.summary.root,
            row(tasks.root, copied.root, sizing_mode="stretch_width"),
            row(seconds.root, whatif.root, sizing_mode="stretch_width"),
            use.root,
            fallbacks.root,
            sizing_mode="stretch_width",
        )

    def update(self) -> None:
        plugin = self.scheduler.plugins.get("eugo")
        try:
            summary = plugin.summary() if plugin is not None else _EMPTY
        except Exception:  # the plugin's own failure: say so on the page, keep it serving
            self.errors += 1
            logger.exception("eugo dashboard: reading the plugin's summary failed")
            self.summary.root.text = ("<h3>eugo</h3><p>The eugo scheduler plugin's summary "
                                      "could not be read (see the scheduler's log); the figures "
                                      "below are from the last tick that could.</p>")
            return
        runs = summary.get("plans", [])  # the plans the pass made here, as the plugin hands them
        for component in self.components:
            try:
                component.update(summary, runs)
            except Exception:
                self.errors += 1
                logger.exception("eugo dashboard: updating %s failed", type(component).__name__)


_EMPTY: dict[str, Any] = {"tasks": {}, "bytes_h2d": 0, "bytes_d2h": 0, "prefixes": {},
                          "fallbacks": {}, "fallback_reasons": {}, "warnings": [],
                          "estimated_saved_s": 0.0, "plans": [], "usage": []}


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
