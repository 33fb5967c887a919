"""Location-aware placement of every chunk task of a graph: :func:`plan_graph` -> :class:`Plan`.

Data starts on the host. Tasks are visited in dependency order and each is placed where it is
cheaper by the required margin, counting where its inputs already live:

- on the GPU it pays its compute, a host->device copy of each input not already on the device
  (once per chunk, however many GPU consumers it has), and a device->host copy of its result
  when an output or a CPU-only consumer needs NumPy;
- on the CPU it pays its compute (per-thread work divided by the chunks that run side by side)
  plus a device->host copy of each input that lives only on the device.

So chains of GPU work stay on the device, a reduction over host data stays on the CPU (the copy
costs more than the pass) and a reduction over device data reduces there and ships back only the
small result. Aggregation, ``finalize``, I/O, creation and unknown functions never offload. A GPU
placement must beat the CPU by ``min_speedup`` (``0``: every task that can run on a device does).

The plan is data: records a person can read (:class:`Decision`), totals for what-if comparisons,
and the sets the rewrite needs. Nothing here touches tasks' execution or CuPy.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, Task, _execute_subgraph
from dask.utils import key_split

from eugo_dask.cost_model import (
    CREATION,
    CUMULATIVE,
    DATA,
    MOVEMENT,
    REDUCTION,
    ArraySpec,
    Estimate,
    Op,
    classify_func,
    estimate_d2h_seconds,
    estimate_h2d_seconds,
    estimate_task,
)
from eugo_dask.profile import Profile
from eugo_dask.runtime import is_eugo_callable

CPU, GPU = "cpu", "gpu"


# ---------------------------------------------------------------------------------------------
# Chunk shapes and dtypes
# ---------------------------------------------------------------------------------------------
class ChunkInfo:
    """Chunk shape and dtype per key, read from a HighLevelGraph's array layers before Dask's
    optimization drops them (``layer.collection_annotations``)."""

    def __init__(self, layers: Mapping[str, tuple[tuple[tuple[float, ...], ...], np.dtype]]):
        self._layers = dict(layers)

    @classmethod
    def from_graph(cls, graph: Any) -> ChunkInfo:
        layers = {}
        for name, layer in getattr(graph, "layers", {}).items():
            annotations = getattr(layer, "collection_annotations", None) or {}
            chunks, dtype = annotations.get("chunks"), annotations.get("dtype")
            if chunks is not None and dtype is not None:
                try:
                    layers[name] = (tuple(tuple(c) for c in chunks), np.dtype(dtype))
                except TypeError:
                    continue
        return cls(layers)

    def merge(self, other: ChunkInfo) -> ChunkInfo:
        return ChunkInfo({**self._layers, **other._layers})

    def block_of(self, name: str, index: tuple[slice, ...]) -> tuple[int, ...] | None:
        """Block coordinates of the chunk of layer ``name`` that ``index`` selects exactly."""
        info = self._layers.get(name)
        if info is None or len(index) != len(info[0]):
            return None
        block = []
        for dim, sl in zip(info[0], index):
            start, offset = sl.start or 0, 0
            for i, size in enumerate(dim):
                if offset == start and (sl.stop is None or sl.stop == offset + size) and sl.step in (None, 1):
                    block.append(i)
                    break
                offset += size
            else:
                return None
        return tuple(block)

    def spec(self, key: Any) -> ArraySpec | None:
        if type(key) is tuple and key:
            info = self._layers.get(key[0])
            index = key[1:]
        else:
            info = self._layers.get(key)
            if info is None or any(len(c) != 1 for c in info[0]):
                return None
            index = (0,) * len(info[0])
        if info is None:
            return None
        chunks, dtype = info
        if len(index) != len(chunks):
            return None
        try:
            shape = tuple([dim[i] for dim, i in zip(chunks, index)])
        except (IndexError, TypeError):
            return None
        if any(type(s) is not int for s in shape):
            if any(isinstance(s, float) and math.isnan(s) for s in shape):
                return None  # unknown chunk sizes (boolean indexing): size unknown
            shape = tuple(int(s) for s in shape)
        return ArraySpec(shape, dtype)


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------
class Decision:
    """Where one task runs, with the numbers behind it; ``reason`` says it in words.

    Seconds are estimates: ``cpu_s`` per task as it runs among its siblings (per-thread work
    divided by the chunks that run side by side), ``gpu_s`` device compute (None where the task
    cannot run on a device), ``h2d_s``/``d2h_s`` the copies a GPU placement would pay.
    """

    __slots__ = ("key", "device", "cpu_s", "h2d_s", "d2h_s", "_estimate", "_spec", "_lanes",
                 "_d2h_in_s", "_min_speedup", "_memory_limit")

    def __init__(self, key: Any, device: str, estimate: Estimate, spec: ArraySpec | None,
                 cpu_s: float, h2d_s: float, d2h_s: float, *, lanes: int, d2h_in_s: float,
                 min_speedup: float, memory_limit: float | None) -> None:
        self.key, self.device, self.cpu_s = key, device, cpu_s
        self.h2d_s, self.d2h_s = (h2d_s, d2h_s) if estimate.gpu_capable else (0.0, 0.0)
        self._estimate, self._spec, self._lanes = estimate, spec, lanes
        self._d2h_in_s, self._min_speedup, self._memory_limit = d2h_in_s, min_speedup, memory_limit

    prefix = property(lambda self: key_split(self.key))
    op = property(lambda self: self._estimate.op)
    detail = property(lambda self: self._estimate.detail)
    flops = property(lambda self: self._estimate.flops)
    bytes = property(lambda self: self._estimate.in_bytes + self._estimate.out_bytes)
    shape = property(lambda self: self._spec.shape if self._spec is not None else None)
    dtype = property(lambda self: str(self._spec.dtype) if self._spec is not None else None)

    @property
    def gpu_s(self) -> float | None:
        return self._estimate.gpu_s if self._estimate.gpu_capable else None

    @property
    def measured(self) -> bool:
        """Whether observed durations replaced the profile's estimates for this task."""
        return self._estimate.cpu_model_s is not None or self._estimate.gpu_model_s is not None

    @property
    def gpu_total_s(self) -> float:
        return self._estimate.gpu_s + self.h2d_s + self.d2h_s

    @property
    def reason(self) -> str:
        est, spec = self._estimate, self._spec
        shape = "x".join(map(str, spec.shape)) if spec is not None and spec.shape else "scalar"
        label = f"{est.detail} {shape} {self.dtype or '?'}"
        if not est.gpu_capable:
            return f"{label}: {est.why_cpu}"
        if self._memory_limit is not None:
            return (f"{label}: needs {format_bytes(_working_set(est))} on the device, more than "
                    f"the {format_bytes(self._memory_limit)} allowed")
        parts = [f"GPU {format_seconds(est.gpu_s)}"]
        parts += [f"H2D {format_seconds(self.h2d_s)}"] if self.h2d_s else []
        parts += [f"D2H {format_seconds(self.d2h_s)}"] if self.d2h_s else []
        cpu = f"CPU {format_seconds(est.cpu_s)}" + (f" / {self._lanes} threads" if self._lanes > 1 else "")
        cpu += f" + D2H {format_seconds(self._d2h_in_s)}" if self._d2h_in_s else ""
        total = self.gpu_total_s
        speedup = (self.cpu_s + self._d2h_in_s) / total if total > 0 else math.inf
        cmp = ">=" if self.device == GPU else "<"
        text = f"{label}: {' + '.join(parts)} vs {cpu} ({speedup:.3g}x {cmp} {self._min_speedup:g})"
        if self.measured:
            models = [f"{name} {format_seconds(model)}" for name, model in
                      (("CPU", est.cpu_model_s), ("GPU", est.gpu_model_s)) if model is not None]
            text += f"; measured, the profile predicted {', '.join(models)}"
        return text

    def to_dict(self) -> dict[str, Any]:
        names = ("key", "prefix", "op", "detail", "shape", "dtype", "bytes", "flops", "cpu_s",
                 "gpu_s", "h2d_s", "d2h_s", "device", "reason", "measured")
        out = {name: getattr(self, name) for name in names}
        out["cpu_model_s"], out["gpu_model_s"] = self._estimate.cpu_model_s, self._estimate.gpu_model_s
        out["key"] = str(self.key)
        out["shape"] = list(self.shape) if self.shape is not None else None
        return out

    def __repr__(self) -> str:
        return f"Decision({self.key!r}, {self.device!r}, {self.reason!r})"


def _working_set(est: Estimate) -> int:
    """Device memory a task needs: its inputs, its result and about as much in temporaries."""
    return est.in_bytes + 2 * est.out_bytes


def format_seconds(seconds: float) -> str:
    """``0.0412`` -> ``'41 ms'``."""
    if seconds is None or math.isinf(seconds):
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass
class Plan:
    """The placement of every task of a graph. Iterating yields :class:`Decision` records."""

    decisions: dict[Any, Decision]
    profile_name: str
    device: str | None
    min_speedup: float
    output_keys: frozenset
    totals: dict[str, float] = field(default_factory=dict)
    _host_needed: frozenset = frozenset()

    def __iter__(self) -> Iterator[Decision]:
        return iter(self.decisions.values())

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, key: Any) -> Decision:
        return self.decisions[key]

    @property
    def gpu_keys(self) -> list[Any]:
        return [k for k, d in self.decisions.items() if d.device == GPU]

    def needs_host(self, key: Any) -> bool:
        """Whether the GPU task ``key`` must copy its result back (an output or a CPU consumer
        needs NumPy)."""
        return key in self._host_needed

    def by_prefix(self) -> dict[str, list[Decision]]:
        groups: dict[str, list[Decision]] = defaultdict(list)
        for d in self:
            groups[d.prefix].append(d)
        return dict(groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile_name,
            "device": self.device,
            "min_speedup": self.min_speedup,
            "totals_s": self.totals,
            "tasks": [d.to_dict() for d in self],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The plan as JSON (one object per task plus the what-if totals)."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"eugo plan: {len(self)} tasks, profile {self.profile_name}, device "
            f"{self.device or 'none (the graph would run unchanged)'}, "
            f"min-speedup {self.min_speedup:g}",
            f"{'prefix':<28} {'op':<11} {'tasks':>6} {'gpu':>5} {'cpu s':>9} {'gpu s':>9} "
            f"{'h2d s':>9} {'d2h s':>9}  reason (first task)",
        ]
        for prefix, group in self.by_prefix().items():
            on_gpu = sum(d.device == GPU for d in group)
            gpu = [d.gpu_s for d in group if d.gpu_s is not None]
            lines.append(
                f"{prefix[:28]:<28} {group[0].op[:11]:<11} {len(group):>6} {on_gpu:>5} "
                f"{format_seconds(sum(d.cpu_s for d in group)):>9} "
                f"{format_seconds(sum(gpu)) if gpu else 'n/a':>9} "
                f"{format_seconds(sum(d.h2d_s for d in group)):>9} "
                f"{format_seconds(sum(d.d2h_s for d in group)):>9}  {group[0].reason}"
            )
        t = self.totals
        lines.append(
            "what-if task-seconds: all-CPU {}, all-GPU {}, as chosen {}".format(
                *(format_seconds(t.get(k, math.inf)) for k in ("all_cpu", "all_gpu", "as_chosen"))
            )
        )
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """The plan as an HTML table by task prefix (Jupyter shows this)."""
        return plan_html(self)

    def to_html(self) -> str:
        """A standalone HTML page of the plan (``eugo-dask explain --html``)."""
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>eugo plan</title>"
            f"<style>{_HTML_STYLE}</style></head><body>{plan_html(self)}</body></html>"
        )


_HTML_STYLE = (
    "table.eugo{border-collapse:collapse;font:13px sans-serif}"
    ".eugo th,.eugo td{border:1px solid #ddd;padding:3px 7px;text-align:right}"
    ".eugo td.l,.eugo th.l{text-align:left}.eugo .gpu{background:#e3f3c4}"
    ".eugo .cpu{background:#e6ecf2}.eugo caption{text-align:left;padding:4px 0}"
)


def plan_html(plan: Plan) -> str:
    """HTML table of ``plan``: one row per task prefix, GPU rows tinted, reasons in full."""
    from html import escape

    rows = []
    for prefix, group in plan.by_prefix().items():
        on_gpu = sum(d.device == GPU for d in group)
        gpu = [d.gpu_s for d in group if d.gpu_s is not None]
        cls = "gpu" if on_gpu == len(group) else "cpu" if not on_gpu else ""
        cells = [
            f"<td class='l'>{escape(prefix)}</td>", f"<td class='l'>{escape(group[0].op)}</td>",
            f"<td>{len(group)}</td>", f"<td>{on_gpu}</td>",
            f"<td>{format_seconds(sum(d.cpu_s for d in group))}</td>",
            f"<td>{format_seconds(sum(gpu)) if gpu else 'n/a'}</td>",
            f"<td>{format_seconds(sum(d.h2d_s for d in group))}</td>",
            f"<td>{format_seconds(sum(d.d2h_s for d in group))}</td>",
            f"<td class='l'>{escape(group[0].reason)}</td>",
        ]
        rows.append(f"<tr class='{cls}'>{''.join(cells)}</tr>")
    t = plan.totals
    totals = ", ".join(f"{name} {format_seconds(t.get(key, math.inf))}" for name, key in
                       (("all-CPU", "all_cpu"), ("all-GPU", "all_gpu"), ("as chosen", "as_chosen")))
    header = "".join(f"<th{' class=l' if h in ('prefix', 'op', 'reason (first task)') else ''}>{h}</th>"
                     for h in ("prefix", "op", "tasks", "on GPU", "CPU s", "GPU s", "H2D s",
                               "D2H s", "reason (first task)"))
    caption = (f"eugo plan: {len(plan)} tasks, profile {escape(plan.profile_name)}, device "
               f"{escape(plan.device or 'none')}, min-speedup {plan.min_speedup:g}. "
               f"What-if task-seconds: {totals}.")
    return (f"<style>{_HTML_STYLE}</style><table class='eugo'><caption>{caption}</caption>"
            f"<thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------
def _flatten_keys(keys: Any) -> set:
    out: set = set()
    stack = [keys]
    while stack:
        k = stack.pop()
        if isinstance(k, list):
            stack.extend(k)
        else:
            out.add(k)
    return out


def _execution_order(inner: Mapping[Any, GraphNode]) -> list[GraphNode]:
    """The nodes of a fused task's inner graph, each after its inner dependencies."""
    order: list[GraphNode] = []
    done: set = set()
    for root in inner:
        stack = [(root, False)]
        while stack:
            key, expanded = stack.pop()
            if key in done:
                continue
            if expanded:
                done.add(key)
                order.append(inner[key])
                continue
            stack.append((key, True))
            stack.extend((d, False) for d in inner[key].dependencies if d in inner and d not in done)
    return order


def _inner_ops(inner: Mapping[Any, GraphNode], embedded: list[ArraySpec]) -> list[Op]:
    ops: list[Op] = []
    for node in _execution_order(inner):
        if isinstance(node, DataNode):
            if isinstance(node.value, np.ndarray):
                ops.append(Op(DATA, "array"))
                embedded.append(ArraySpec(node.value.shape, node.value.dtype))
        elif type(node) is Task and node.func is _execute_subgraph:
            ops.extend(_inner_ops(node.args[0], embedded))
        elif type(node) is Task:
            family, name = classify_func(node.func)
            ops.append(Op(family, name, max(1, len(node.dependencies))))
    return ops


def _getitem_shape(node: Task, source: ArraySpec | None) -> ArraySpec | None:
    if source is None or len(node.args) != 2 or isinstance(node.args[1], GraphNode):
        return None
    try:
        view = np.broadcast_to(np.empty((), dtype=bool), source.shape)[node.args[1]]
    except Exception:
        return None
    return ArraySpec(view.shape, source.dtype)


def _reduction_axes(node: Task) -> tuple[int, ...] | None:
    for container in (node.kwargs, *(a for a in node.args if isinstance(a, Mapping))):
        axis = container.get("axis") if isinstance(container, Mapping) else None
        if isinstance(axis, int):
            return (axis,)
        if isinstance(axis, tuple) and all(isinstance(a, int) for a in axis):
            return axis
    return None


def _reduced_spec(node: Task, source: ArraySpec | None, out: ArraySpec | None) -> ArraySpec | None:
    """The result of a reduction step over ``source``: one element along each reduced axis (all
    of them where the axes cannot be read), dropped unless ``keepdims``."""
    if source is None:
        return out
    axes = _reduction_axes(node)
    ndim = len(source.shape)
    reduced = set(range(ndim)) if axes is None else {a % ndim for a in axes if ndim}
    keepdims = node.kwargs.get("keepdims", True) is not False
    shape = tuple(1 if d in reduced else n for d, n in enumerate(source.shape)
                  if keepdims or d not in reduced)
    return ArraySpec(shape, out.dtype if out is not None else source.dtype)


def _is_combine_step(key: Any) -> bool:
    """Whether ``key`` belongs to the combine/aggregate layers of a Dask reduction, whose chunk
    annotations are right (unlike the chunk step's, which repeat the input's chunks)."""
    name = key[0] if type(key) is tuple else key
    return isinstance(name, str) and ("-aggregate-" in name or "-partial-" in name)


class _Structure:
    """What a task's function(s) are, independent of its chunk: shared by every chunk of a
    blockwise-fused layer (they share one inner graph)."""

    __slots__ = ("ops", "embedded", "out_node", "reduction")

    def __init__(self, node: Task, n_inputs: int) -> None:
        embedded: list[ArraySpec] = []
        if node.func is _execute_subgraph:
            ops = _inner_ops(node.args[0], embedded)
            out_node = node.args[0].get(node.args[1])
        else:
            family, name = classify_func(node.func)
            ops = [Op(family, name, max(1, n_inputs))]
            out_node = node
        self.ops = tuple(ops) or (Op(MOVEMENT, "identity"),)
        self.embedded = tuple(embedded)
        while type(out_node) is Task and out_node.func is _execute_subgraph:
            out_node = out_node.args[0].get(out_node.args[1])
        self.out_node = out_node if type(out_node) is Task else None
        self.reduction = False
        if self.out_node is not None:
            family, name = classify_func(self.out_node.func)
            self.reduction = family == REDUCTION and name not in CUMULATIVE


def _learned(estimate: Estimate, history: Any) -> Estimate:
    """``estimate`` with observed medians in place of the profile's numbers, where known."""
    nbytes = estimate.in_bytes + estimate.out_bytes
    cpu = history.estimate(estimate.op, CPU, nbytes)
    gpu = history.estimate(estimate.op, GPU, nbytes) if estimate.gpu_capable else None
    if cpu is None and gpu is None:
        return estimate
    return replace(
        estimate,
        cpu_s=cpu if cpu is not None else estimate.cpu_s,
        gpu_s=gpu if gpu is not None else estimate.gpu_s,
        cpu_model_s=estimate.cpu_s if cpu is not None else None,
        gpu_model_s=estimate.gpu_s if gpu is not None else None,
    )


class TaskDescriber:
    """Estimates tasks and infers their output chunks, reusing work across the chunks of a
    layer (same functions, same shapes: same estimate)."""

    def __init__(self, chunks: ChunkInfo, profile: Profile, history: Any = None) -> None:
        self.chunks, self.profile, self.history = chunks, profile, history
        self._structures: dict[tuple, _Structure] = {}
        self._estimates: dict[tuple, Estimate] = {}
        self._reduced: dict[tuple, ArraySpec | None] = {}

    def _structure(self, node: Task, n_inputs: int) -> _Structure:
        # Chunks of one layer share their function (or fused inner graph): describe it once.
        # The graph keeps these objects alive while we plan, so ids are not reused.
        if node.func is _execute_subgraph:
            cache_key: tuple = (id(node.args[0]),)
        else:
            cache_key = (id(node.func), n_inputs)
        cached = self._structures.get(cache_key)
        if cached is None:
            cached = self._structures[cache_key] = _Structure(node, n_inputs)
        return cached

    def describe(
        self, key: Any, node: Task, input_specs: list[ArraySpec | None]
    ) -> tuple[Estimate, ArraySpec | None]:
        """Estimate one task and infer its output chunk's spec."""
        chunks = self.chunks
        structure = self._structure(node, len(input_specs))
        ops = structure.ops
        embedded = list(structure.embedded)
        known = [s for s in input_specs if s is not None]
        if node.func is _execute_subgraph:
            # blockwise fusion keeps the output layer's name in the key; linear fusion renames
            # the key and keeps the original as the inner output key
            out = chunks.spec(node.args[1]) if type(node.args[1]) is tuple else None
            out = out or chunks.spec(key)
            if out is not None:
                # a chunk created inside a GPU task (ones, arange, random) is made on the host
                # and copied: price it like an embedded chunk of the result's size
                embedded += [out for op in ops if op.family == CREATION]
        else:
            out = chunks.spec(key)
            if out is None and ops[0].name == "getitem" and ops[0].family == MOVEMENT:
                out = _getitem_shape(node, known[0] if len(input_specs) == 1 and known else None)
        if structure.reduction and not _is_combine_step(node.args[1] if node.func is _execute_subgraph else key):
            # Dask annotates a reduction's chunk step with its input's chunks
            source = out or max(known + embedded, key=lambda s: s.size, default=None)
            reduced_key = (id(structure.out_node), source, out)
            if reduced_key not in self._reduced:
                self._reduced[reduced_key] = _reduced_spec(structure.out_node, source, out)
            out = self._reduced[reduced_key]
        arrays = tuple(known + embedded)
        cache_key = (ops, arrays, out, len(known) < len(input_specs))
        estimate = self._estimates.get(cache_key)
        if estimate is None:
            estimate = estimate_task(list(ops), list(arrays), out, self.profile)
            if len(known) < len(input_specs) and estimate.gpu_capable:
                estimate = replace(estimate, gpu_capable=False, gpu_s=math.inf,
                                   why_cpu="an input chunk's size is unknown")
            if self.history is not None:
                estimate = _learned(estimate, self.history)
            self._estimates[cache_key] = estimate
        return estimate, out


def alias_targets(dsk: Mapping[Any, GraphNode]) -> dict[Any, Any]:
    """Each alias key of ``dsk`` -> the key it finally stands for (chains followed)."""
    aliases = {k: v.target for k, v in dsk.items() if isinstance(v, Alias)}

    def follow(k: Any) -> Any:
        seen = 0
        while k in aliases and seen < 1000:
            k, seen = aliases[k], seen + 1
        return k

    return {a: follow(a) for a in aliases}


def _toposort(dsk: Mapping[Any, GraphNode]) -> list[Any]:
    """Keys of ``dsk``, each after its dependencies (Kahn's algorithm)."""
    waiting: dict[Any, int] = {}
    dependents: dict[Any, list[Any]] = defaultdict(list)
    ready = []
    for k, node in dsk.items():
        n = 0
        for d in node.dependencies:
            if d in dsk:
                dependents[d].append(k)
                n += 1
        waiting[k] = n
        if not n:
            ready.append(k)
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for dep in dependents.get(k, ()):
            waiting[dep] -= 1
            if not waiting[dep]:
                ready.append(dep)
    if len(order) != len(dsk):
        raise ValueError("eugo: the graph has a cycle; it cannot be planned")
    return order


def plan_graph(
    dsk: Mapping[Any, GraphNode],
    keys: Any,
    *,
    profile: Profile,
    chunks: ChunkInfo,
    min_speedup: float,
    device: str | None,
    device_memory_bytes: float,
    history: Any = None,
) -> Plan:
    """Place every task of ``dsk`` (task-spec nodes, after Dask's own optimization).

    Parameters
    ----------
    keys
        The graph's output keys (nested lists allowed); they are always delivered as NumPy.
    device_memory_bytes
        A task whose inputs, result and temporaries exceed this never offloads.
    history
        A :class:`~eugo_dask.history.RuntimeHistory` whose observed durations replace the
        profile's estimates where it has enough of them.
    """
    outputs = _flatten_keys(keys)
    # an alias's final target, looked up in one dict access on the hot path
    resolve = alias_targets(dsk).get

    order = _toposort(dsk)
    width = Counter(k[0] if isinstance(k, tuple) else k for k, v in dsk.items() if type(v) is Task)
    threads = profile.cpu.threads

    # Pass 1: what each task is and costs, in dependency order (inputs' specs feed outputs').
    describer = TaskDescriber(chunks, profile, history)
    specs: dict[Any, ArraySpec | None] = {}
    estimates: dict[Any, Estimate] = {}
    for k in order:
        node = dsk[k]
        if isinstance(node, DataNode):
            v = node.value
            specs[k] = ArraySpec(v.shape, v.dtype) if isinstance(v, np.ndarray) else None
        elif isinstance(node, Alias):
            specs[k] = specs.get(resolve(k, k))
        elif type(node) is Task and not is_eugo_callable(node.func):
            inputs = [specs.get(resolve(d, d)) for d in node.dependencies]
            estimates[k], specs[k] = describer.describe(k, node, inputs)
        else:
            specs[k] = None

    # Which results must reach the host whatever else happens: outputs, and inputs of
    # consumers that cannot run on a device (aliases pass the need through).
    static_host: set = set()
    for k in order:
        node = dsk[k]
        if k in outputs:
            static_host.add(resolve(k, k))
        est = estimates.get(k)
        if isinstance(node, Alias):
            continue  # an alias passes its consumers' needs through resolve()
        if est is None or not est.gpu_capable:
            static_host.update(resolve(d, d) for d in node.dependencies)

    # Pass 2: greedy placement in dependency order.
    on_gpu: set = set()
    h2d_done: set = set()
    d2h_done: set = set()
    decisions: dict[Any, Decision] = {}
    # all_gpu: every task that can run on a device pays its own estimate there (explain()
    # replaces it with an exact plan at min-speedup 0)
    totals = {"all_cpu": 0.0, "all_gpu": 0.0, "as_chosen": 0.0}

    sizes = {k: s.nbytes for k, s in specs.items() if s is not None}

    h2d_s = functools.lru_cache(maxsize=None)(lambda n: estimate_h2d_seconds(n, profile))
    d2h_s = functools.lru_cache(maxsize=None)(lambda n: estimate_d2h_seconds(n, profile))
    for k in order:
        est = estimates.get(k)
        if est is None:
            continue
        inputs = {resolve(d, d) for d in dsk[k].dependencies}
        lanes = min(width[k[0] if isinstance(k, tuple) else k], threads) if est.cpu_parallel else 1
        cpu_s = est.cpu_s / max(lanes, 1)
        d2h_in = h2d = 0.0
        input_bytes = 0
        for d in inputs:
            n = sizes.get(d, 0)
            input_bytes += n
            if d in on_gpu:
                if d not in d2h_done:
                    d2h_in += d2h_s(n)
            elif d not in h2d_done:
                h2d += h2d_s(n)
        h2d += h2d_s(max(est.in_bytes - input_bytes, 0))  # chunks embedded in the task
        d2h_out = d2h_s(est.out_bytes) if k in static_host else 0.0
        gpu_total = est.gpu_s + h2d + d2h_out
        cpu_total = cpu_s + d2h_in
        too_big = device is not None and _working_set(est) > device_memory_bytes
        if not est.gpu_capable or too_big:
            place = CPU
        elif min_speedup == 0 or cpu_total >= min_speedup * gpu_total:
            place = GPU
        else:
            place = CPU
        if place == GPU:
            h2d_done.update(d for d in inputs if d not in on_gpu)
            on_gpu.add(k)
            if d2h_out:
                d2h_done.add(k)
            chosen = gpu_total
        else:
            d2h_done.update(d for d in inputs if d in on_gpu)
            chosen = cpu_total
        totals["all_cpu"] += cpu_s
        totals["all_gpu"] += gpu_total if est.gpu_capable and not too_big else cpu_total
        totals["as_chosen"] += chosen
        decisions[k] = Decision(
            k, place, est, specs.get(k), cpu_s, h2d, d2h_out, lanes=lanes, d2h_in_s=d2h_in,
            min_speedup=min_speedup,
            memory_limit=device_memory_bytes if est.gpu_capable and too_big else None,
        )

    # Final: a GPU result goes back to the host when an output or a CPU-placed consumer needs it.
    host_needed = {resolve(k, k) for k in outputs}
    for k, node in dsk.items():
        d = decisions.get(k)
        if isinstance(node, Alias):
            continue
        if d is None or d.device == CPU:
            host_needed.update(resolve(x, x) for x in node.dependencies)
    plan = Plan(
        decisions=decisions,
        profile_name=profile.name,
        device=device,
        min_speedup=min_speedup,
        output_keys=frozenset(outputs),
        totals=totals,
        _host_needed=frozenset(host_needed & on_gpu),
    )
    return plan
