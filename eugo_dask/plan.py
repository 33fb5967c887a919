"""Location-aware placement of every chunk task of a graph: :func:`place` -> :class:`Plan`.

Data starts on the host. Tasks are visited in dependency order and each is placed where it is
cheaper by the required margin, counting where its inputs live:

- on the GPU it pays its compute, a host->device copy of each input that lives on the host, and
  a device->host copy of its result when an output or a CPU-only consumer needs NumPy;
- on the CPU it pays its compute (per-thread work divided by the chunks that run side by side)
  plus a device->host copy of each input that lives only on the device.

A copy is made once per chunk and shared by all the consumers on the other side, but a task
counts it as paid only where a task of its own operation (its layer) paid it: a copy made for
another operation draws no work after it. So a task goes where it would go in its own output's
plan, whichever of its input's consumers the walk meets first, and a graph of several outputs
(``dask.compute(*outputs)``) places their tasks as their own graphs do, the copies they share
made once: it does not move more than they do one by one.

So chains of GPU work stay on the device, a reduction over host data stays on the CPU (the copy
costs more than the pass) and a reduction over device data reduces there and ships back only the
small result. Data movement (slices, transposes, concatenations, a rechunk's pieces) copies its
bytes once where it runs, as a copy between host and device does: it never pays for a copy, and
runs on the device only where its inputs are there and nothing needs its result on the host
(also where its inputs were copied there for later tasks of other operations and all its
consumers run there). Aggregation, ``finalize``, I/O, creation and unknown functions never
offload; a creation fused into a task runs on the host wherever the task does. A GPU placement
must beat the CPU by ``min_speedup`` on the work that moves (``0``: every task that can run on
a device does).

With ``dual_from`` set (``eugo.dispatch: dual``), a task kept on the CPU whose inputs all live
on the host, and whose GPU path with its own copies in and back is predicted at least
``dual_from`` times as fast (neither device dominates), is *dual*: placed on the CPU here (its
result on the host, as its consumers see it), it carries both paths, and eugo's scheduler
plugin sends it to a CPU thread or a GPU slot as it becomes ready (:mod:`eugo_dask.dispatch`).

With ``shares`` (``eugo.dispatch: balanced``), the margin gives way to the machine the graph
runs on: each layer that can run on a device goes where the split of the work that reaches the
makespan's lower bound there puts it (:func:`~eugo_dask.schedule.balanced_shares`, over the
layers' work taken together): its share of its chunks on the device (all of them at a share of
1, none at 0; between, spread over them in the walk's order), the others on the CPU. Data
movement keeps its own rule.

The plan is data: records a person can read (:class:`Decision`), totals for what-if comparisons,
the copies it makes, and the sets the rewrite needs. Nothing here touches tasks' execution or
CuPy.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from dask._task_spec import Alias, Task
from dask.typing import NestedKeys
from dask.utils import key_split

from eugo_dask.cost_model import Estimate, estimate_d2h_seconds, estimate_h2d_seconds
from eugo_dask.describe import GraphDescription
from eugo_dask.graph import ArraySpec, Graph, Key, flatten_keys
from eugo_dask.ops import CPU, GPU, MOVEMENT, DeviceSetting, Family, Placement
from eugo_dask.profile import Profile
from eugo_dask.report import (
    copies_text,
    format_bytes,
    format_seconds,
    html_page,
    plan_heading,
    plan_html,
    plan_rows,
    plan_text,
)

#: Why data movement runs where it does (see :func:`place`): it ``STAYS`` on the CPU, its
#: inputs being on the host; it ``FOLLOWS`` its inputs' copies to the device, its consumers
#: being there.
MoveRule = Literal["stays", "follows"]
STAYS: Final = "stays"
FOLLOWS: Final = "follows"


class Decision:
    """Where one task runs, with the numbers behind it; ``reason`` says it in words.

    Seconds are estimates: ``cpu_s`` per task as it runs among its siblings (per-thread work
    divided by the chunks that run side by side), ``gpu_s`` device compute (None where the task
    cannot run on a device), ``h2d_s``/``d2h_s`` the copies a GPU placement would pay. ``op`` is
    the task's op family (its heaviest kind of work).
    """

    __slots__ = ("key", "device", "cpu_s", "h2d_s", "d2h_s", "_estimate", "_spec", "_lanes",
                 "_d2h_in_s", "_min_speedup", "_memory_limit", "_cold", "_move", "_sharing",
                 "dual", "share")

    def __init__(self, key: Key, device: Placement, estimate: Estimate, spec: ArraySpec | None,
                 cpu_s: float, h2d_s: float, d2h_s: float, lanes: int, d2h_in_s: float,
                 min_speedup: float, memory_limit: float | None,
                 cold: tuple[float, float, float] | None = None,
                 move: MoveRule | None = None, sharing: int = 1,
                 dual: DualCost | None = None, share: float | None = None) -> None:
        # made once per task of graphs a million tasks large, with positional arguments
        self.key, self.device, self.cpu_s = key, device, cpu_s
        self.h2d_s, self.d2h_s = (h2d_s, d2h_s) if estimate.gpu_capable else (0.0, 0.0)
        self._estimate, self._spec, self._lanes = estimate, spec, lanes
        self._d2h_in_s, self._min_speedup, self._memory_limit = d2h_in_s, min_speedup, memory_limit
        self._cold, self._move, self._sharing = cold, move, sharing
        #: a dual task's seconds either way (None: its placement is fixed)
        self.dual = dual
        #: under ``eugo.dispatch: balanced``, the share of the task's layer on the devices in
        #: the split that reaches the makespan bound, which placed it (None: the margin did)
        self.share = share

    @property
    def prefix(self) -> str:
        return key_split(self.key)

    @property
    def op(self) -> Family:
        return self._estimate.family

    @property
    def detail(self) -> str:
        return self._estimate.detail

    @property
    def flops(self) -> float:
        return self._estimate.flops

    @property
    def bytes(self) -> int:
        return self._estimate.in_bytes + self._estimate.out_bytes

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self._spec.shape if self._spec is not None else None

    @property
    def dtype(self) -> str | None:
        return str(self._spec.dtype) if self._spec is not None else None

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
            shared = (f" (the device's {format_bytes(self._memory_limit * self._sharing)} shared "
                      f"by {self._sharing} tasks at once)" if self._sharing > 1 else "")
            return (f"{label}: needs {format_bytes(working_set_bytes(est))} on the device, more "
                    f"than the {format_bytes(self._memory_limit)} allowed{shared}")
        if self._cold is not None:
            startup, on_gpu, on_cpu = self._cold
            with_startup = on_gpu + startup
            ratio = on_cpu / with_startup if with_startup > 0 else math.inf
            return (f"{label}: the device is not started; with its start "
                    f"({format_seconds(startup)}) the graph's GPU work would take "
                    f"{format_seconds(with_startup)} against {format_seconds(on_cpu)} on the CPU "
                    f"({ratio:.3g}x < {self._min_speedup:g})")
        # (the host work of a fused creation, paid either way, is left out of the comparison)
        host = est.host_s
        parts = [f"GPU {format_seconds(est.gpu_s - host)}"]
        parts += [f"H2D {format_seconds(self.h2d_s)}"] if self.h2d_s else []
        parts += [f"D2H {format_seconds(self.d2h_s)}"] if self.d2h_s else []
        cpu = f"CPU {format_seconds(est.cpu_s - host)}"
        cpu += f" / {self._lanes} threads" if self._lanes > 1 else ""
        cpu += f" + D2H {format_seconds(self._d2h_in_s)}" if self._d2h_in_s else ""
        either = f"; creation on the host either way {format_seconds(host)}" if host else ""
        if self._move == STAYS:
            return (f"{label}: moves host data ({' + '.join(parts)} vs {cpu}): a copy to the "
                    "device passes the same bytes through host memory as the move itself, so "
                    "data movement stays where its inputs live")
        if self._move == FOLLOWS:
            return (f"{label}: its inputs are on the device (copied for other tasks) and every "
                    f"consumer runs there: it moves the copies (GPU {format_seconds(est.gpu_s)} "
                    f"vs {cpu}, and its result need not be copied)")
        total = self.gpu_total_s - host
        speedup = ((self.cpu_s - host / self._lanes + self._d2h_in_s) / total if total > 0
                   else math.inf)
        cmp = ">=" if self.device == GPU else "<"
        if self.share is not None:
            text = (f"{label}: {' + '.join(parts)} vs {cpu} ({speedup:.3g}x){either}; the "
                    f"makespan bound's split puts {self.share:.0%} of its layer on the GPU")
        else:
            text = (f"{label}: {' + '.join(parts)} vs {cpu} ({speedup:.3g}x {cmp} "
                    f"{self._min_speedup:g}){either}")
        if self.dual is not None:
            text += (f"; dual: the scheduler picks per task, a CPU thread "
                     f"{format_seconds(self.dual.thread_s)} or a GPU slot "
                     f"{format_seconds(self.dual.slot_s)} with its copies")
        if self.measured:
            models = [f"{name} {format_seconds(model)}" for name, model in
                      (("CPU", est.cpu_model_s), ("GPU", est.gpu_model_s)) if model is not None]
            text += f"; measured, the profile predicted {', '.join(models)}"
        return text

    def to_dict(self) -> dict[str, Any]:
        names = ("key", "prefix", "op", "detail", "shape", "dtype", "bytes", "flops", "cpu_s",
                 "gpu_s", "h2d_s", "d2h_s", "device", "reason", "measured")
        out = {name: getattr(self, name) for name in names}
        out["dual"] = self.dual._asdict() if self.dual is not None else None
        out["share"] = self.share
        out["cpu_model_s"], out["gpu_model_s"] = self._estimate.cpu_model_s, self._estimate.gpu_model_s
        out["key"] = str(self.key)
        out["shape"] = list(self.shape) if self.shape is not None else None
        return out

    def __repr__(self) -> str:
        return f"Decision({self.key!r}, {self.device!r}, {self.reason!r})"


class DualCost(NamedTuple):
    """What a dual task costs either way, as the scheduler plugin weighs it: ``thread_s`` on
    one CPU thread; ``slot_s`` holding a GPU slot, its inputs copied in and its result copied
    back inside the task (:class:`~eugo_dask.runtime.DualCall`)."""

    thread_s: float
    slot_s: float


class ColdStart(NamedTuple):
    """What starting the device costs a graph: ``once_s`` (the process's CUDA context, module
    load and first kernel compile, where the process that plans runs the tasks) and
    ``per_worker_s`` for each of up to ``workers`` threads or processes that would run device
    work (a thread's stream, cuBLAS handle and FFT plans; a process's whole start)."""

    once_s: float
    per_worker_s: float
    workers: int

    def seconds(self, device_tasks: int) -> float:
        return self.once_s + self.per_worker_s * min(device_tasks, self.workers)


class Copies(NamedTuple):
    """The copies a plan makes between host and device: how many chunks each way and their
    bytes (each host chunk a GPU task reads is copied once, whatever number of GPU consumers it
    has; a chunk embedded in a GPU task, with it; each GPU result an output or a CPU task reads,
    back once). ``device_stats()`` counts the same copies as they run."""

    to_device: int = 0
    to_device_bytes: int = 0
    to_host: int = 0
    to_host_bytes: int = 0


def working_set_bytes(est: Estimate) -> int:
    """Device memory a task needs: its inputs, its result and about as much in temporaries."""
    return est.in_bytes + 2 * est.out_bytes


@dataclass
class Plan:
    """The placement of every task of a graph. Iterating yields :class:`Decision` records;
    ``print`` shows a table by task prefix; ``to_json()`` exports it."""

    decisions: dict[Key, Decision]
    profile_name: str
    device: DeviceSetting | None
    min_speedup: float
    #: what-if task-seconds: ``all_cpu``, ``all_gpu`` and ``as_chosen``
    totals: dict[str, float] = field(default_factory=dict)
    #: GPU tasks whose result an output or a CPU consumer needs as NumPy
    host_needed: frozenset[Key] = frozenset()
    #: the copies between host and device the plan makes
    copies: Copies = Copies()
    #: the plan held against the machine (:class:`eugo_dask.schedule.Summary`): its predicted
    #: makespan and the lower bound; set by ``explain()``
    schedule: Any = None

    def __iter__(self) -> Iterator[Decision]:
        return iter(self.decisions.values())

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, key: Key) -> Decision:
        return self.decisions[key]

    @property
    def gpu_keys(self) -> list[Key]:
        return [k for k, d in self.decisions.items() if d.device == GPU]

    @property
    def dual_keys(self) -> list[Key]:
        """The tasks that carry both paths (``eugo.dispatch: dual``), placed at run time."""
        return [k for k, d in self.decisions.items() if d.dual is not None]

    def needs_host(self, key: Key) -> bool:
        """Whether the GPU task ``key`` must copy its result back (an output or a CPU consumer
        needs NumPy)."""
        return key in self.host_needed

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
            "copies": self.copies._asdict(),
            "schedule": self.schedule.to_dict() if self.schedule is not None else None,
            "tasks": [d.to_dict() for d in self],
        }

    def to_json(self, **kwargs: Any) -> str:
        """The plan as JSON (one object per task, the what-if totals and the copies)."""
        return json.dumps(self.to_dict(), **kwargs)

    def _heading(self) -> str:
        return plan_heading(tasks=len(self), profile=self.profile_name, device=self.device,
                            min_speedup=self.min_speedup)

    def _copies(self) -> str:
        text = copies_text(*self.copies)
        dual = Counter(d.prefix for d in self if d.dual is not None)
        if dual:
            text += (f"\ndual: {sum(dual.values())} tasks carry both paths, placed as they "
                     f"become ready by eugo's scheduler plugin (CPU without it): "
                     + ", ".join(f"{prefix} {n}" for prefix, n in dual.items()))
        return text if self.schedule is None else f"{text}\n{self.schedule.text()}"

    def __str__(self) -> str:
        return plan_text(self._heading(), plan_rows(self), self.totals, self._copies())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """The plan as an HTML table by task prefix (Jupyter shows this)."""
        return plan_html(self._heading(), plan_rows(self), self.totals, self._copies())

    def to_html(self) -> str:
        """A standalone HTML page of the plan (``eugo-dask explain --html``)."""
        return html_page(self._repr_html_())


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
#: Flags of a key's code in :func:`place`'s walk: its bytes are ``(code >> 2) & _BYTES``, and
#: ``code >> _PAYER`` the number of the layer whose task last paid its copy (0: none).
_ON_DEVICE, _COPIED = 1, 2
_PAYER = 50
_BYTES = (1 << (_PAYER - 2)) - 1
_UNPAID = (1 << _PAYER) - 1  # a code with its payer cleared


def _needs_host_regardless(description: GraphDescription, outputs: set[Key],
                           read_by_undescribed: set[Key]) -> set[Key]:
    """Results that must reach the host whatever is placed where: outputs, and the inputs of
    consumers that cannot run on a device (aliases pass their consumers' needs through)."""
    needed = {description.resolve(k) for k in outputs} | read_by_undescribed
    for est, inputs in zip(description.task_estimates, description.inputs, strict=True):
        if not est.gpu_capable:
            needed |= inputs
    return needed


def _reads(node: Any, description: GraphDescription) -> set[Key]:
    """The keys an undescribed node reads, aliases resolved (an alias itself reads nothing:
    its consumers' needs pass through to its target)."""
    if isinstance(node, Alias):
        return set()
    return {description.resolve(d) for d in node.dependencies}


def place(
    dsk: Graph,
    keys: Key | NestedKeys,
    description: GraphDescription,
    *,
    profile: Profile,
    min_speedup: float,
    device: DeviceSetting | None,
    device_memory_bytes: float,
    gpu_tasks_per_device: int = 1,
    cold: ColdStart | None = None,
    dual_from: float | None = None,
    shares: Sequence[float | None] | None = None,
    _not_starting: tuple[frozenset[Key], tuple[float, float, float]] | None = None,
) -> Plan:
    """Place every described task of ``dsk`` (see the module docstring).

    Parameters
    ----------
    keys
        The graph's output keys (nested lists allowed); they are always delivered as NumPy.
    description
        What :func:`~eugo_dask.describe.describe_graph` found in ``dsk``.
    device
        The device that will run GPU tasks (None: plan what would go where; nothing runs there).
    device_memory_bytes
        A task whose inputs, result and temporaries exceed this never offloads.
    gpu_tasks_per_device
        GPU tasks that may run on one device at once (a worker's GPU resource units or a local
        scheduler's threads, over the devices a process drives): a task of a layer with several
        chunks gets ``device_memory_bytes`` divided by those of them that run at once.
    cold
        Where the device is not started: what starting it costs. Unless ``min_speedup`` is 0
        (offload whatever can be), the graph's GPU work taken together, the start added, must
        still beat its CPU time by ``min_speedup``; otherwise the graph stays on the CPU, and
        the tasks that would have gone to the GPU say why.
    dual_from
        ``eugo.dispatch: dual``: the lowest predicted speedup of a dual task (see the module
        docstring); None: every placement is fixed here.
    shares
        ``eugo.dispatch: balanced``: for each described task (in ``description.task_keys``'
        order), the share of its layer on the devices in a split that reaches the makespan
        bound on the machine the graph runs on (None: no share, the margin places it). A
        task that can run on a device goes where its layer's share says (see the module
        docstring); data movement keeps its own rule, and ``min_speedup`` 0 offloads every
        task that can be as it does without shares.
    """
    outputs = flatten_keys(keys)
    # the loop below runs once per task: plain dict lookups, and helpers only on its rarer
    # branches (a copy paid, a result's first spec)
    values = description.values
    layer_of = _layers_side_by_side(dsk, profile.cpu.threads)
    # what the keys eugo cannot reason about read (chunks, aliases, tasks eugo wrote) must be
    # on the host whatever is placed where
    read_by_undescribed = set().union(*[_reads(node, description)
                                        for _, node in description.undescribed])
    host_regardless = _needs_host_regardless(description, outputs, read_by_undescribed)
    h2d_s = functools.lru_cache(maxsize=None)(lambda n: estimate_h2d_seconds(n, profile))
    d2h_s = functools.lru_cache(maxsize=None)(lambda n: estimate_d2h_seconds(n, profile))

    # What the walk knows of each key it has seen, in one int (one lookup per input, and no
    # object per key: a layer's chunks share their codes): its bytes << 2, | _ON_DEVICE where
    # it lives on the device, | _COPIED where it was copied once already (to the host for a key
    # on the device, to the device for a host key), and the layer that paid that copy. A key is
    # placed before any of its consumers, so "copied" means a copy they need not make again.
    # A copy is shared by every consumer that reads it, but only the operation it was made for
    # counts it as paid: a task pays, in its comparison, the copy of each input that lives on
    # the other side, unless a task of its own layer (chunks of one operation, which share
    # their inputs' copies in that operation's own plan too) already paid it. Another
    # operation's copy is no reason to follow it: that would make a task's placement depend on
    # which of its input's consumers the walk met first, and a compute of several outputs move
    # the results of work that, computed alone, stays where its data is.
    seen: dict[Key, int] = {}
    on_gpu: list[Key] = []  # (a list: no table of a million keys to grow, for one intersection)
    decisions: dict[Key, Decision] = {}
    # all_gpu: every task that can run on a device pays its own estimate there (explain()
    # replaces it with an exact plan at min-speedup 0); as_chosen counts each copy once
    all_cpu = all_gpu = as_chosen = 0.0
    gpu_cpu_s = 0.0  # the CPU time of the tasks placed on the GPU
    to_device = to_device_bytes = to_host = to_host_bytes = 0  # the copies made so far
    kept: list[_Kept] = []
    dual: DualCost | None = None  # (set for the task at hand where it carries both paths)
    # the described tasks in dependency order, their estimates, what they read and what they
    # give, key for key: walking them side by side skips the others without a lookup each
    codes: dict[int, tuple[int, int, int]] = {}  # id(spec) -> on the host, device, copied back
    by_share = shares is not None and min_speedup != 0
    split_seen: Counter[tuple[Any, int]] = Counter()  # a split layer's chunks placed so far
    task_shares = shares if shares is not None else itertools.repeat(None, len(description.task_keys))
    for k, est, inputs, spec, share in zip(description.task_keys, description.task_estimates,
                                           description.inputs, description.task_specs,
                                           task_shares, strict=True):
        lanes, payer, chunks = layer_of.get(k[0] if type(k) is tuple else k, (1, 0, 1))
        lanes = lanes if est.cpu_parallel else 1
        cpu_s = est.cpu_s / lanes
        d2h_in = h2d = 0.0
        made = 0.0  # the seconds of the copies charged below that were made for another layer
        input_bytes = 0
        # the inputs whose copy this task pays where it is placed: on the host, on the device
        host_paid, device_paid = [], []
        for d in inputs:
            code = seen.get(d)
            if code is None:  # not placed: a chunk, a key from outside, a task eugo wrote
                given = values.get(d)
                code = seen[d] = given.nbytes << 2 if isinstance(given, ArraySpec) else 0
            n = (code >> 2) & _BYTES
            input_bytes += n
            if not code & _COPIED or code >> _PAYER != payer:
                copy = d2h_s(n) if code & _ON_DEVICE else h2d_s(n)
                if code & _COPIED:
                    made += copy
                if code & _ON_DEVICE:
                    d2h_in += copy
                    device_paid.append(d)
                else:
                    h2d += copy
                    host_paid.append(d)
        if est.in_bytes > input_bytes:  # chunks embedded in the task
            h2d += h2d_s(est.in_bytes - input_bytes)
        needs_host = k in host_regardless
        d2h_out = d2h_s(est.out_bytes) if needs_host else 0.0
        gpu_total = est.gpu_s + h2d + d2h_out
        cpu_total = cpu_s + d2h_in
        capable = est.gpu_capable
        # the device's memory is shared by the layer's chunks that run on it at once
        sharing = max(min(chunks, gpu_tasks_per_device), 1)
        task_memory_bytes = device_memory_bytes / sharing
        too_big = (capable and device is not None  # working_set_bytes(est), inline
                   and est.in_bytes + 2 * est.out_bytes > task_memory_bytes)
        # data movement (a slice, a transpose, a concatenation, a rechunk's pieces) copies its
        # bytes once on the CPU; a copy to the device moves the same bytes through host memory
        # (and the link) first, so the move never pays for it: it runs where its inputs live
        host_move = est.family == MOVEMENT and h2d > 0
        spec_codes = codes.get(id(spec))
        if spec_codes is None:
            spec_codes = codes[id(spec)] = _spec_codes(spec)
        # the margin applies to the work that moves: host work inside the task (a creation
        # fused into it) is paid either way, so a source fused into its one consumer and one
        # shared by several consumers (not fused) leave the consumer's placement alike
        if (by_share and share is not None and capable and not too_big
                and _not_starting is None and est.family != MOVEMENT):
            # the layer's share of its chunks on the device, spread over its chunks in the
            # walk's order, the others on the CPU (a share of 1: all; of 0: none)
            group = (k[0] if type(k) is tuple else k, id(est))
            nth = split_seen[group]
            split_seen[group] = nth + 1
            # (a share of j/n puts j of n on the device: floor, less the rounding of j/n)
            on_device = math.floor((nth + 1) * share + 1e-9) > math.floor(nth * share + 1e-9)
        else:
            share = None
            on_device = (capable and not too_big and _not_starting is None
                         and (min_speedup == 0 or (not host_move and cpu_total - est.host_s / lanes
                                                   >= min_speedup * (gpu_total - est.host_s))))
        if on_device:
            placement: Placement = GPU
            chosen = gpu_total - made  # (the totals count each copy once)
            if host_paid:  # copied to the device (once, whoever pays)
                copies, copied_bytes = _mark_copied(seen, host_paid, payer)
                to_device += copies
                to_device_bytes += copied_bytes
            if est.in_bytes > input_bytes:  # (the chunks embedded in the task, with it)
                to_device += 1
                to_device_bytes += est.in_bytes - input_bytes
            on_gpu.append(k)
            gpu_cpu_s += cpu_s
            # (a result copied back for an output or a CPU-only consumer: copied once)
            if needs_host:
                seen[k] = spec_codes[2]
                to_host += 1
                to_host_bytes += spec_codes[0] >> 2
            else:
                seen[k] = spec_codes[1]
        else:
            placement = CPU
            chosen = cpu_total - made
            if (dual_from is not None and capable and not too_big and not host_move
                    and not device_paid and _not_starting is None):
                dual = _dual_cost(est, max(est.in_bytes, input_bytes), cpu_total, lanes,
                                  profile.cpu.threads, dual_from, h2d_s, d2h_s)
            if host_move and est.in_bytes <= input_bytes:  # (see _moves_that_follow)
                kept.append((k, inputs, est, spec, cpu_s, lanes))
            if device_paid:  # copied back to the host (once, whoever pays)
                copies, copied_bytes = _mark_copied(seen, device_paid, payer)
                to_host += copies
                to_host_bytes += copied_bytes
            seen[k] = spec_codes[0]
        all_cpu += cpu_s
        all_gpu += gpu_total if capable and not too_big else cpu_total
        as_chosen += chosen
        decisions[k] = Decision(k, placement, est, spec, cpu_s, h2d, d2h_out,
                                lanes, d2h_in, min_speedup,
                                task_memory_bytes if too_big else None,
                                _not_starting[1] if _not_starting and k in _not_starting[0]
                                else None, STAYS if host_move and placement == CPU else None,
                                sharing, dual, share)
        dual = None
    needed_on_host = _host_consumed(description, decisions, outputs, read_by_undescribed)
    follow = _moves_that_follow(kept, seen, needed_on_host)
    if follow:
        gpu_cpu_s, as_chosen, bytes_not_made = _place_moves_that_follow(
            follow, seen, decisions, on_gpu, min_speedup, h2d_s, gpu_cpu_s, as_chosen)
        to_device -= len(follow)
        to_device_bytes -= bytes_not_made
    totals = {"all_cpu": all_cpu, "all_gpu": all_gpu, "as_chosen": as_chosen}
    if cold is not None and on_gpu and min_speedup != 0:
        not_starting = _not_worth_starting(cold, on_gpu, gpu_cpu_s, all_cpu - as_chosen,
                                           min_speedup)
        if not_starting is not None:
            # the same walk, every task on the CPU; those it would have offloaded say why
            return place(dsk, keys, description, profile=profile, min_speedup=min_speedup,
                         device=device, device_memory_bytes=device_memory_bytes,
                         gpu_tasks_per_device=gpu_tasks_per_device, _not_starting=not_starting)

    return Plan(
        decisions=decisions,
        profile_name=profile.name,
        device=device,
        min_speedup=min_speedup,
        totals=totals,
        # (a move that follows its inputs to the device reads host chunks: nothing it reads
        # is needed on the host any less)
        host_needed=frozenset(needed_on_host.intersection(on_gpu)),
        copies=Copies(to_device, to_device_bytes, to_host, to_host_bytes),
    )


def _dual_cost(est: Estimate, in_bytes: int, cpu_total: float, lanes: int, threads: int,
               dual_from: float, h2d_s: Callable[[int], float], d2h_s: Callable[[int], float]
               ) -> DualCost | None:
    """What a task the walk keeps on the CPU, its inputs on the host, costs either way, where
    it carries both paths: its GPU path, all its ``in_bytes`` copied in and its result back
    (the task makes its own copies), predicted at least ``dual_from`` times as fast as its CPU
    time among its siblings (``cpu_total`` over ``lanes``), the host work fused into it left out
    as the margin leaves it out. None where the CPU dominates."""
    slot_s = est.gpu_s + h2d_s(in_bytes) + d2h_s(est.out_bytes)
    moving_gpu = slot_s - est.host_s
    speedup = (cpu_total - est.host_s / lanes) / moving_gpu if moving_gpu > 0 else math.inf
    if speedup < dual_from:
        return None
    # (a CPU estimate that is not per thread is BLAS on the profile's threads: one thread runs
    # it that many times longer, as the schedule model has it)
    return DualCost(est.cpu_s * (1 if est.cpu_parallel else threads), slot_s)


#: A data movement :func:`place` kept on the CPU, for :func:`_moves_that_follow`: its key,
#: inputs, estimate, result's spec, CPU seconds and the chunks of its layer side by side.
_Kept = tuple[Key, frozenset[Key], Estimate, ArraySpec | None, float, int]


def _layers_side_by_side(dsk: Graph, threads: int) -> dict[Key, tuple[int, int, int]]:
    """For each layer of ``dsk`` (by name), its chunks that run side by side on ``threads``
    threads, its number (from 1, in the order of ``dsk``: see ``_PAYER``), and its chunks."""
    width = Counter([k[0] if type(k) is tuple else k for k, v in dsk.items() if type(v) is Task])
    return {name: (max(min(n, threads), 1), i, n)
            for i, (name, n) in enumerate(width.items(), start=1)}


def _spec_codes(spec: ArraySpec | None) -> tuple[int, int, int]:
    """The codes (see ``seen`` in :func:`place`) of a result of ``spec``: on the host, on the
    device, on the device and copied back."""
    size = spec.nbytes << 2 if spec is not None else 0
    return (size, size | _ON_DEVICE, size | _ON_DEVICE | _COPIED)


def _mark_copied(seen: dict[Key, int], paid: list[Key], payer: int) -> tuple[int, int]:
    """Mark the keys ``paid`` copied to the other side (once, whoever pays), their copy paid by
    layer ``payer``: the copies not made before, and their bytes."""
    copies = copied_bytes = 0
    for d in paid:
        code = seen[d]
        if not code & _COPIED:
            copies += 1
            copied_bytes += (code >> 2) & _BYTES
        seen[d] = (code & _UNPAID) | _COPIED | payer << _PAYER
    return copies, copied_bytes


def _place_moves_that_follow(follow: list[_Kept], seen: dict[Key, int],
                             decisions: dict[Key, Decision], on_gpu: list[Key],
                             min_speedup: float, h2d_s: Callable[[int], float],
                             gpu_cpu_s: float, as_chosen: float) -> tuple[float, float, int]:
    """Put on the device the moves that follow their inputs there (:func:`_moves_that_follow`):
    their decisions, and on ``on_gpu``. Returns ``gpu_cpu_s`` (the CPU time of the tasks on the
    GPU) and ``as_chosen`` (the plan's seconds) with them counted (added up in the walk's
    order), and the bytes of their results' copies to the device that are not made."""
    bytes_not_made = 0
    for k, _, est, spec, cpu_s, lanes in follow:
        decisions[k] = Decision(k, GPU, est, spec, cpu_s, 0.0, 0.0, lanes, 0.0, min_speedup,
                                None, None, FOLLOWS)
        on_gpu.append(k)
        gpu_cpu_s += cpu_s
        copy = (seen[k] >> 2) & _BYTES  # (the copy of its result for its GPU consumers)
        bytes_not_made += copy
        as_chosen += est.gpu_s - cpu_s - h2d_s(copy)
    return gpu_cpu_s, as_chosen, bytes_not_made


def _not_worth_starting(cold: ColdStart, on_gpu: list[Key], gpu_cpu_s: float,
                        saved_s: float, min_speedup: float
                        ) -> tuple[frozenset[Key], tuple[float, float, float]] | None:
    """Where starting the device does not pay for a plan's GPU tasks (``on_gpu``): their CPU
    time (``gpu_cpu_s``) against what placing them costs (their own device time and copies,
    and the copies back their CPU consumers pay: ``gpu_cpu_s`` less ``saved_s``, what the plan
    saves against all on the CPU) with the start added, by ``min_speedup``. Returns those tasks
    and (start, their seconds placed, their CPU seconds), as :func:`place` takes them to say why
    they stay on the CPU; None where the start pays."""
    startup = cold.seconds(len(on_gpu))
    on_gpu_s = gpu_cpu_s - saved_s
    if startup > 0 and gpu_cpu_s < min_speedup * (on_gpu_s + startup):
        return frozenset(on_gpu), (startup, on_gpu_s, gpu_cpu_s)
    return None


def _moves_that_follow(kept: list[_Kept], seen: dict[Key, int],
                       needed_on_host: set[Key]) -> list[_Kept]:
    """The data movement :func:`place` kept on the CPU (its inputs were on the host when the
    walk reached it) that runs on the device after all: every input was then copied there for
    its other consumers, and every consumer of its result runs there (its result was copied to
    the device, and nothing needs it on the host). On the device it moves the copies already
    made, and the copy of its result is not made. (A shared transpose, ``x @ x.T`` computed
    with ``x.T @ z``: its matmuls copy ``x`` anyway.)"""
    return [m for m in kept
            if m[0] not in needed_on_host and seen[m[0]] & _COPIED
            and all(seen[d] & (_ON_DEVICE | _COPIED) == _COPIED for d in m[1])]


def _host_consumed(description: GraphDescription, decisions: dict[Key, Decision],
                   outputs: set[Key], read_by_undescribed: set[Key]) -> set[Key]:
    """Results an output or a CPU-placed (or unplanned) consumer reads as NumPy."""
    needed = {description.resolve(k) for k in outputs} | read_by_undescribed
    # (the decisions follow the described tasks, as their inputs do, key for key)
    for decision, inputs in zip(decisions.values(), description.inputs, strict=True):
        if decision.device == CPU:
            needed |= inputs
    return needed
