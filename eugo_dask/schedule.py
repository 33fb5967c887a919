"""How a plan uses the machine as a whole: a lower bound on a graph's makespan and a simulator
of placement policies, both on one model of the machine.

The model (:class:`Machine`): ``cpu_threads`` threads that each run one task at a time, and
``gpus`` devices that each run one kernel at a time and have one link per direction to the host
(copies take ``latency + bytes / bandwidth`` on it). Every task runs its estimate
(:class:`~eugo_dask.cost_model.Estimate`): on a thread, its single-thread time (a matmul's
estimate is BLAS on all of the profile's threads: on one thread it is that many times longer);
on a device, its device time. A value lives where it was made and is copied once to each other
place that reads it; outputs end on the host.

- :func:`lower_bound` is what no schedule on the model can beat: the larger of the work each
  kind of device and link must do and the critical path, with every task free to be split
  between the CPU and the devices (StarPU's "area + critical path" bound, ``bound.c``). With
  SciPy it is the linear program over all of it at once (HiGHS); without it, or past
  ``LP_MAX_TASKS`` tasks, the two parts apart (a smaller, still valid bound).
- :func:`simulate` list-schedules a graph under a policy: each task, when its inputs are
  ready (those ready at once in Dask's own order, :func:`dask.order.order`, as workers take
  them), is queued on the unit where it finishes first. ``static`` keeps the plan's
  placement, ``all-cpu`` and ``all-gpu`` what they say, ``dmda`` chooses per task between
  the CPU threads and the devices by earliest finish, copies included (StarPU's dmda);
  ``spill`` does so for the plan's GPU tasks only (the CPU ones stay); ``dual`` keeps the
  plan's placement except for its dual tasks (``eugo.dispatch: dual``), each sent as it becomes
  ready where the scheduler plugin's rule (:meth:`eugo_dask.dispatch.Ledger.choose`) sends it:
  a CPU thread, or a GPU slot that it holds while it copies its inputs in, runs and copies its
  result back (the copies inside the task, as :class:`~eugo_dask.runtime.DualCall` makes
  them; the links' other copies do not wait for them). Copies run on the
  links (``copies="link"``: eugo's copy tasks ask for none of the GPU slot and overlap the
  kernels) or, as they did when they held the GPU resource, in the device's slot (``"slot"``).
  On the links, the copies to a device of a device task start no sooner than the device task
  ``ahead`` places before it among those that copy a value to a device (in the order they are
  placed, over all devices) has ended, as
  eugo's scheduler plugin holds them (:mod:`eugo_dask.gates`, ``ahead``
  :func:`~eugo_dask.pace.copies_ahead`); ``ahead=None``: as soon as their value and the link are
  free, however far ahead of the device.

Everything here is arithmetic on the plan's numbers: nothing runs a task or imports CuPy.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from dask._task_spec import Alias, GraphNode
from dask.typing import NestedKeys

from eugo_dask.cost_model import Estimate
from eugo_dask.describe import GraphDescription
from eugo_dask.dispatch import GPU_UNIT, Ledger
from eugo_dask.graph import ArraySpec, Key, flatten_keys
from eugo_dask.ops import GPU
from eugo_dask.pace import copies_ahead
from eugo_dask.plan import Plan
from eugo_dask.profile import Profile
from eugo_dask.report import format_seconds

Policy = Literal["static", "all-cpu", "all-gpu", "dmda", "spill", "dual"]
POLICIES: Final[tuple[Policy, ...]] = ("static", "all-cpu", "all-gpu", "dmda", "spill", "dual")
CopyMode = Literal["link", "slot"]
#: Above this many tasks :func:`lower_bound` adds the parts up apart rather than solve the LP.
LP_MAX_TASKS: Final = 20_000


@dataclass(frozen=True)
class Machine:
    """CPU threads, GPUs and the link of each GPU, one per direction."""

    cpu_threads: int
    gpus: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    latency_s: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if self.cpu_threads < 1 or self.gpus < 0:
            raise ValueError(f"a machine has at least one CPU thread and no negative number of "
                             f"GPUs; got {self.cpu_threads} threads, {self.gpus} GPUs")
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"a machine's {name} must be a positive finite number; "
                                 f"got {value!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"a machine's latency_s must be zero or more; got {self.latency_s!r}")

    @classmethod
    def from_profile(cls, profile: Profile, *, cpu_threads: int | None = None, gpus: int = 1,
                     name: str = "") -> Machine:
        """The profile's link and CPU threads (or ``cpu_threads``), with ``gpus`` devices."""
        link = profile.link
        return cls(cpu_threads or profile.cpu.threads, gpus, link.h2d_bytes_per_s,
                   link.d2h_bytes_per_s, link.latency_s, name)

    def h2d_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.h2d_bytes_per_s if nbytes else 0.0

    def d2h_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.d2h_bytes_per_s if nbytes else 0.0


@dataclass
class Costs:
    """A graph as the model sees it, tasks in dependency order: ``cpu_s`` single-thread
    seconds, ``gpu_s`` device seconds (None: cannot run there), ``nbytes`` of each result,
    ``deps`` (indices), ``outputs`` (indices whose value must reach the host) and the plan's
    ``placement`` (True: on the GPU)."""

    keys: list[Key]
    cpu_s: list[float]
    gpu_s: list[float | None]
    nbytes: list[int]
    deps: list[tuple[int, ...]]
    outputs: frozenset[int]
    placement: list[bool]
    #: Dask's order of the tasks (a rank per task): the order workers take ready tasks in
    priority: list[int] = field(default_factory=list)
    #: the plan's dual tasks (placed on the CPU, carrying both paths): indices
    dual: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.keys)

    def add_source(self, key: Key, nbytes: int) -> None:
        """A value on the host from the start: no work, ``nbytes`` to copy where it is read."""
        self.keys.append(key)
        self.deps.append(())
        self.cpu_s.append(0.0)
        self.gpu_s.append(None)
        self.nbytes.append(nbytes)
        self.placement.append(False)

    @classmethod
    def from_plan(cls, graph: dict[Key, GraphNode], keys: Key | NestedKeys, description: GraphDescription,
                  plan: Plan, *, cpu_threads: int) -> Costs:
        """The model of ``graph`` as described and placed; ``cpu_threads``: the threads the
        profile's estimates assumed (a matmul's CPU estimate is BLAS on all of them)."""
        from dask.order import order

        estimates = description.estimates
        resolve = description.resolve
        index: dict[Key, int] = {}
        out = cls([], [], [], [], [], frozenset(), [])
        for key in description.order:
            node = graph.get(key)
            if node is None or isinstance(node, Alias):
                continue
            est: Estimate | None = estimates.get(key)
            deps = tuple(sorted({index[resolve(d)] for d in node.dependencies
                                 if resolve(d) in index}))
            embedded = est.in_bytes - sum(out.nbytes[d] for d in deps) if est is not None else 0
            if embedded > 0 and est is not None and est.gpu_capable:
                # chunks inside the task (a creation fused into it): a value of their own on
                # the host, so that the task pays their copy on a device, as the plan does
                out.add_source(("eugo-embedded", key), embedded)
                deps = (*deps, len(out.keys) - 1)
            index[key] = len(out.keys)
            out.keys.append(key)
            out.deps.append(deps)
            if est is None:  # a chunk, a task eugo wrote: on the host, for free
                spec = description.spec(key)
                out.cpu_s.append(0.0)
                out.gpu_s.append(None)
                out.nbytes.append(spec.nbytes if isinstance(spec, ArraySpec) else 0)
                out.placement.append(False)
                continue
            threads = 1 if est.cpu_parallel else cpu_threads
            out.cpu_s.append(est.cpu_s * threads)
            out.gpu_s.append(est.gpu_s if est.gpu_capable and math.isfinite(est.gpu_s)
                             else None)
            out.nbytes.append(est.out_bytes)
            decision = plan.decisions.get(key)
            out.placement.append(decision is not None and decision.device == GPU)
        out.outputs = frozenset(index[resolve(k)] for k in flatten_keys(keys)
                                if resolve(k) in index)
        out.dual = frozenset(index[k] for k in plan.dual_keys if k in index)
        ranks = order(graph)
        # (an embedded value just before its task)
        out.priority = [ranks.get(k[1] if k[0] == "eugo-embedded" else k, 0)
                        if isinstance(k, tuple) else ranks.get(k, 0) for k in out.keys]
        return out


# ---------------------------------------------------------------------------------------------
# The lower bound
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bound:
    """A lower bound on makespan, ``seconds``, with what binds it: ``parts`` are the busiest
    each resource would be under the bound's own split (``cpu``, ``gpu``, ``h2d``, ``d2h``) and
    the critical path (``path``); ``gpu_share`` the share of the device-capable work the
    bound puts on the devices; ``method`` ``"lp"`` (HiGHS) or ``"parts"``."""

    seconds: float
    parts: dict[str, float]
    gpu_share: float
    method: str

    @property
    def mixed(self) -> bool:
        """Whether the bound uses both kinds of device (each gets at least 5% of the work)."""
        return 0.05 <= self.gpu_share <= 0.95


def lower_bound(costs: Costs, machine: Machine, *, lp_max_tasks: int = LP_MAX_TASKS,
                lp_iterations: int | None = None) -> Bound:
    """No schedule of ``costs`` on ``machine`` finishes sooner (see the module docstring): the
    LP up to ``lp_max_tasks`` tasks (within ``lp_iterations`` of HiGHS's simplex, where given:
    a limit of work, not of time, so that the answer does not depend on how busy the machine
    is), else, or where the LP gives no answer, the parts bound."""
    if machine.gpus == 0 or not any(g is not None for g in costs.gpu_s):
        return _parts_bound(costs, machine)
    if len(costs) <= lp_max_tasks:
        try:
            bound = _lp_bound(costs, machine, lp_iterations)
        except ImportError:
            bound = None
        if bound is not None:
            return bound
    return _parts_bound(costs, machine)


def _critical_path(costs: Costs, machine: Machine) -> float:
    """The longest chain, each task at its faster device, copies left out."""
    finish = [0.0] * len(costs)
    for i, deps in enumerate(costs.deps):
        gpu = costs.gpu_s[i]
        fastest = costs.cpu_s[i] if gpu is None or machine.gpus == 0 else min(costs.cpu_s[i], gpu)
        finish[i] = max((finish[d] for d in deps), default=0.0) + fastest
    return max(finish, default=0.0)


def area_split(work: Iterable[tuple[int, float, float | None]], cpu_threads: int,
               gpus: int) -> tuple[float, float, float]:
    """The work of ``work`` (groups of ``count`` tasks of ``cpu_s`` single-thread seconds and
    ``gpu_s`` device seconds, None where a task cannot run on a device) split between
    ``cpu_threads`` threads and ``gpus`` devices so both finish together, each task divisible:
    ``(seconds on the threads, seconds on the devices, share of the device-capable work on
    the devices)``. The larger of the first two is the area bound on makespan."""
    fixed = 0.0
    movable: list[tuple[float, float]] = []
    for count, c, g in work:
        if g is None or not gpus:
            fixed += count * c
        else:
            movable.append((count * c, count * g))
    movable.sort(key=lambda cg: cg[1] / max(cg[0], 1e-300))
    cpu_load = fixed + sum(c for c, _ in movable)
    gpu_load = 0.0
    p, n = cpu_threads, max(gpus, 1)
    for c, g in movable:  # the tasks the devices speed up most go there first
        if cpu_load / p <= gpu_load / n:
            break
        # the fraction f of this task that evens the two: (cpu - f c)/p = (gpu + f g)/n
        f = min(1.0, (cpu_load / p - gpu_load / n) / (c / p + g / n)) if c / p + g / n else 1.0
        cpu_load -= f * c
        gpu_load += f * g
    total_gpu = sum(g for _, g in movable)
    return cpu_load / p, gpu_load / n, gpu_load / total_gpu if total_gpu else 0.0


#: :func:`work_groups` gives up past this many distinct estimates (None: no bound on record)
MAX_WORK_GROUPS: Final = 10_000


def work_groups(description: GraphDescription, cpu_threads: int
                ) -> list[tuple[int, float, float | None]] | None:
    """The graph's described work for :func:`area_split`, as the pass records it: tasks of one
    estimate (a layer's chunks share theirs) counted together, ``cpu_threads`` the threads the
    profile's estimates assumed (as :meth:`Costs.from_plan`). Cheap: one pass over identities."""
    estimates = description.task_estimates
    counts = Counter(map(id, estimates))
    if len(counts) > MAX_WORK_GROUPS:
        return None
    by_id = dict(zip(map(id, estimates), estimates))
    return [(count, e.cpu_s * (1 if e.cpu_parallel else cpu_threads),
             e.gpu_s if e.gpu_capable and math.isfinite(e.gpu_s) else None)
            for i, count in counts.items() for e in (by_id[i],)]


def _parts_bound(costs: Costs, machine: Machine) -> Bound:
    """The area bound (:func:`area_split`) and the critical path, apart."""
    cpu, gpu, share = area_split(((1, c, g) for c, g in zip(costs.cpu_s, costs.gpu_s)),
                                 machine.cpu_threads, machine.gpus)
    parts = {"cpu": cpu, "gpu": gpu, "h2d": 0.0, "d2h": 0.0,
             "path": _critical_path(costs, machine)}
    return Bound(max(parts.values()), parts, share, "parts")


def _lp_bound(costs: Costs, machine: Machine, iterations: int | None) -> Bound | None:
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_array

    n = len(costs)
    p, g_count = machine.cpu_threads, machine.gpus
    var = 0

    def new(count: int) -> int:
        nonlocal var
        start, var = var, var + count
        return start

    capable = [i for i in range(n) if costs.gpu_s[i] is not None]
    x_of = {i: new(1) for i in capable}           # share of task i on the devices
    c0 = new(n)                                   # C_i: when task i finishes
    t = new(1)                                    # the makespan
    # the edges across which a copy may be needed: one end may run on a device
    edges = [(u, v) for v, deps in enumerate(costs.deps) for u in deps
             if u in x_of or v in x_of]
    h0, d0 = new(len(edges)), new(len(edges))     # per edge: copied to / from the device
    moved = sorted({u for u, _ in edges} | (costs.outputs & x_of.keys()))
    up_of = {u: new(1) for u in moved}             # per value: copied to the device at all
    down_of = {u: new(1) for u in moved}           # per value: copied back at all
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(terms: Iterable[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for col, value in terms:
            rows.append(r)
            cols.append(col)
            vals.append(value)
        rhs.append(bound)

    h2d = [machine.h2d_s(b) for b in costs.nbytes]
    d2h = [machine.d2h_s(b) for b in costs.nbytes]

    def duration(v: int) -> tuple[list[tuple[int, float]], float]:
        """dur_v = cpu_v + (gpu_v - cpu_v) x_v, as (terms, constant)."""
        gpu = costs.gpu_s[v]
        if gpu is None:
            return [], costs.cpu_s[v]
        return [(x_of[v], gpu - costs.cpu_s[v])], costs.cpu_s[v]

    edge_of = {(u, v): e for e, (u, v) in enumerate(edges)}
    for v, deps in enumerate(costs.deps):
        terms, const = duration(v)
        # C_v >= dur_v (a task without inputs) and C_v >= C_u + copy + dur_v for each input
        row([(c0 + v, -1.0), *terms], -const)
        for u in deps:
            e = edge_of.get((u, v))
            copy = [(h0 + e, h2d[u]), (d0 + e, d2h[u])] if e is not None else []
            row([(c0 + u, 1.0), (c0 + v, -1.0), *terms, *copy], -const)
        row([(c0 + v, 1.0), (t, -1.0)], 0.0)
    for e, (u, v) in enumerate(edges):
        xu = [(x_of[u], 1.0)] if u in x_of else []
        xv = [(x_of[v], 1.0)] if v in x_of else []
        # h_e >= x_v - x_u, d_e >= x_u - x_v; each value's copy is made once however many read it
        row([(h0 + e, -1.0), *xv, *[(c, -a) for c, a in xu]], 0.0)
        row([(d0 + e, -1.0), *xu, *[(c, -a) for c, a in xv]], 0.0)
        row([(h0 + e, 1.0), (up_of[u], -1.0)], 0.0)
        row([(d0 + e, 1.0), (down_of[u], -1.0)], 0.0)
    for u in costs.outputs & x_of.keys():
        row([(x_of[u], 1.0), (down_of[u], -1.0)], 0.0)
    # the work of each kind of resource: sum cpu (1 - x) <= p T, sum gpu x <= G T, links
    row([*[(x_of[i], -costs.cpu_s[i]) for i in capable], (t, -float(p))], -sum(costs.cpu_s))
    row([*[(x_of[i], costs.gpu_s[i] or 0.0) for i in capable], (t, -float(g_count))], 0.0)
    row([*[(up_of[u], h2d[u]) for u in moved], (t, -float(g_count))], 0.0)
    row([*[(down_of[u], d2h[u]) for u in moved], (t, -float(g_count))], 0.0)

    objective = np.zeros(var)
    objective[t] = 1.0
    upper = np.full(var, np.inf)
    for i in x_of.values():
        upper[i] = 1.0
    matrix = coo_array((vals, (rows, cols)), shape=(len(rhs), var)).tocsr()
    options = {"maxiter": iterations} if iterations is not None else {}
    # the dual simplex: deterministic, one thread (HiGHS's choice between methods is its own)
    result = linprog(objective, A_ub=matrix, b_ub=np.asarray(rhs),
                     bounds=np.column_stack([np.zeros(var), upper]), method="highs-ds",
                     options=options)
    if result.status != 0:  # out of iterations (the all-CPU schedule is feasible: nothing else)
        return None
    # the LP's optimum, less its solver's tolerance, is the bound; the parts below describe the
    # split it found (splits clipped to [0, 1]: the solver's may stray by its tolerance)
    seconds = max(float(result.fun) * (1 - 1e-6) - 1e-12, 0.0)
    share = {i: min(max(float(result.x[x_of[i]]), 0.0), 1.0) for i in capable}
    gpu_work = sum((costs.gpu_s[i] or 0.0) * share[i] for i in capable)
    # the copies the split itself needs (the LP's own copy variables may sit anywhere below T)
    up = dict.fromkeys(moved, 0.0)
    down = {u: share.get(u, 0.0) if u in costs.outputs else 0.0 for u in moved}
    for u, v in edges:
        up[u] = max(up[u], share.get(v, 0.0) - share.get(u, 0.0))
        down[u] = max(down[u], share.get(u, 0.0) - share.get(v, 0.0))
    parts = {
        "cpu": (sum(costs.cpu_s) - sum(costs.cpu_s[i] * share[i] for i in capable)) / p,
        "gpu": gpu_work / g_count,
        "h2d": sum(h2d[u] * up[u] for u in moved) / g_count,
        "d2h": sum(d2h[u] * down[u] for u in moved) / g_count,
        "path": _critical_path(costs, machine),
    }
    total_gpu = sum(costs.gpu_s[i] or 0.0 for i in capable) or 1.0
    # (the copy-free critical path is a bound of its own; the LP's optimum is at least it, up to
    # the solver's tolerance)
    seconds = max(seconds, parts["path"])
    return Bound(seconds, {k: min(v, seconds) for k, v in parts.items()},
                 gpu_work / total_gpu, "lp")


# ---------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """A simulated run: its ``makespan_s``; ``busy`` seconds of each kind of resource summed
    over its units (``cpu``, ``gpu``, ``h2d``, ``d2h``); ``gpu_tasks`` run on a device;
    ``assignment``: where each task ran (-1: a CPU thread; else the GPU's number)."""

    policy: str
    makespan_s: float
    busy: dict[str, float]
    gpu_tasks: int
    machine: Machine
    assignment: tuple[int, ...] = ()

    def busy_fraction(self, kind: str) -> float:
        """How busy the ``kind`` units were over the makespan, 0 to 1."""
        units = self.machine.cpu_threads if kind == "cpu" else self.machine.gpus
        span = self.makespan_s * units
        return self.busy[kind] / span if span > 0 else 0.0


def dual_slot_seconds(costs: Costs, machine: Machine, i: int) -> float:
    """What dual task ``i`` holds a GPU slot for: its inputs copied in, its work, its result
    copied back (the copies inside it, as :class:`~eugo_dask.runtime.DualCall` makes them)."""
    return (sum(machine.h2d_s(costs.nbytes[d]) for d in costs.deps[i])
            + (costs.gpu_s[i] or 0.0) + machine.d2h_s(costs.nbytes[i]))


class _Run:
    """The state of one simulation: when each unit is next free, where each value is."""

    def __init__(self, costs: Costs, machine: Machine, copies: CopyMode,
                 ahead: int | None = None) -> None:
        self.costs, self.machine, self.copies = costs, machine, copies
        # the copies to the devices run at most `ahead` device tasks ahead (links only)
        self.ahead = ahead if copies == "link" else None
        # when each device task placed that copied a value to its device ends, in order
        self.device_ends: list[float] = []
        self.threads = [0.0] * machine.cpu_threads  # a heap of the threads' free times
        g = machine.gpus
        self.gpu_free, self.up_free, self.down_free = [0.0] * g, [0.0] * g, [0.0] * g
        n = len(costs)
        self.on_host: list[float | None] = [None] * n  # when the value is there
        self.on_gpu: list[dict[int, float]] = [{} for _ in range(n)]
        self.busy = {"cpu": 0.0, "gpu": 0.0, "h2d": 0.0, "d2h": 0.0}
        self.gpu_tasks = 0
        self.assignment = [-1] * n
        # the values a task that only the CPU runs reads: made on a device, they come back
        self.host_read = [False] * n
        for i, deps in enumerate(costs.deps):
            if costs.gpu_s[i] is None or not machine.gpus:
                for d in deps:
                    self.host_read[d] = True

    def _down(self, u: int, commit: bool, slots: list[float], down: list[float]) -> float:
        """When value ``u`` is on the host, copying it back from its device if need be."""
        ready = self.on_host[u]
        if ready is not None:
            return ready
        g, made = min(self.on_gpu[u].items(), key=lambda item: item[1])
        lane = slots if self.copies == "slot" else down
        seconds = self.machine.d2h_s(self.costs.nbytes[u])
        start = max(made, lane[g])
        lane[g] = start + seconds
        if commit:
            self.on_host[u] = start + seconds
            self.busy["d2h"] += seconds
        return start + seconds

    def cpu_finish(self, i: int, commit: bool, now: float = 0.0) -> float:
        slots, down = list(self.gpu_free), list(self.down_free)
        ready = max((self._down(d, commit, slots, down) for d in self.costs.deps[i]),
                    default=0.0)
        start = max(ready, self.threads[0], now)
        end = start + self.costs.cpu_s[i]
        if commit:
            self.gpu_free, self.down_free = slots, down
            heapq.heapreplace(self.threads, end)
            self.on_host[i] = end
            self.busy["cpu"] += self.costs.cpu_s[i]
        return end

    def copies_from(self) -> float:
        """When the copies to a device of the next device task placed may start: once the
        device task ``ahead`` places before it among those that copied a value to the device
        has ended (0: at once)."""
        ahead, ends = self.ahead, self.device_ends
        return ends[-ahead] if ahead is not None and 0 < ahead <= len(ends) else 0.0

    def gpu_finish(self, i: int, g: int, commit: bool, now: float = 0.0) -> float:
        gpu_s = self.costs.gpu_s[i]
        assert gpu_s is not None
        slots, up, down = list(self.gpu_free), list(self.up_free), list(self.down_free)
        lane = slots if self.copies == "slot" else up
        gate = self.copies_from()
        ready = 0.0
        copied = False
        for d in self.costs.deps[i]:
            there = self.on_gpu[d].get(g)
            if there is None:
                copied = True
                host = self._down(d, commit, slots, down)
                seconds = self.machine.h2d_s(self.costs.nbytes[d])
                start = max(host, lane[g], gate)
                there = lane[g] = start + seconds
                if commit:
                    self.on_gpu[d][g] = there
                    self.busy["h2d"] += seconds
            ready = max(ready, there)
        start = max(ready, slots[g], now)
        end = slots[g] = start + gpu_s
        if commit:
            self.gpu_free, self.up_free, self.down_free = slots, up, down
            self.on_gpu[i][g] = end
            if copied:  # (the gate counts the device tasks that copy a value to the device)
                self.device_ends.append(end)
            self.busy["gpu"] += gpu_s
            self.gpu_tasks += 1
            self.assignment[i] = g
        if i in self.costs.outputs:  # an output is copied back as soon as it is made
            back = slots if self.copies == "slot" else down
            seconds = self.machine.d2h_s(self.costs.nbytes[i])
            end = back[g] = max(end, back[g]) + seconds
            if commit:
                self.on_host[i] = end
                self.busy["d2h"] += seconds
        return end

    def dual_gpu_run(self, i: int, g: int, now: float, slot_s: float) -> float:
        """Run dual task ``i``, ready at ``now``, on GPU ``g``'s slot (its copies inside it)."""
        slots, down = list(self.gpu_free), list(self.down_free)
        ready = max((self._down(d, True, slots, down) for d in self.costs.deps[i]),
                    default=0.0)
        start = max(ready, slots[g], now)
        end = slots[g] = start + slot_s
        self.gpu_free, self.down_free = slots, down
        self.on_host[i] = end
        machine, costs = self.machine, self.costs
        self.busy["gpu"] += costs.gpu_s[i] or 0.0
        self.busy["h2d"] += sum(machine.h2d_s(costs.nbytes[d]) for d in costs.deps[i])
        self.busy["d2h"] += machine.d2h_s(costs.nbytes[i])
        self.gpu_tasks += 1
        self.assignment[i] = g
        return end

    def place_dual(self, i: int, now: float) -> float:
        """Send dual task ``i``, ready at ``now``, where the scheduler plugin would: the unit
        that finishes it first, on the ledger of when each is free."""
        slot_s = dual_slot_seconds(self.costs, self.machine, i)
        ledger = Ledger(threads={"cpu": [self.threads[0]]},
                        slots={str(g): [free] for g, free in enumerate(self.gpu_free)})
        choice = ledger.choose("", self.costs.cpu_s[i], slot_s, now)
        if choice.kind == GPU_UNIT and choice.worker is not None:
            return self.dual_gpu_run(i, int(choice.worker), now, slot_s)
        return self.cpu_finish(i, True, now)

    def best_gpu(self, i: int, now: float = 0.0) -> tuple[float, int] | None:
        """The GPU where task ``i``, ready at ``now``, would finish first."""
        return min(((self.gpu_finish(i, g, False, now), g) for g in range(self.machine.gpus)),
                   default=None)

    def place(self, i: int, policy: Policy, now: float) -> float:
        """Queue task ``i``, ready at ``now``, on the unit ``policy`` puts it on (its earliest
        free thread, or the GPU where it finishes first), as a worker queues what it is given:
        the time its result is ready."""
        costs, machine = self.costs, self.machine
        capable = machine.gpus > 0 and costs.gpu_s[i] is not None
        if policy == "dual" and capable and i in costs.dual:
            return self.place_dual(i, now)
        on_gpu = capable and (policy == "all-gpu" or
                              (policy in ("static", "dual") and costs.placement[i]))
        best = self.best_gpu(i, now) if capable else None
        if best is not None and (policy == "dmda" or (policy == "spill" and costs.placement[i])):
            gpu_end = best[0]
            if self.host_read[i] and i not in costs.outputs:  # (an output's copy is counted)
                gpu_end += machine.d2h_s(costs.nbytes[i])  # the copy back a CPU task needs
            on_gpu = gpu_end < self.cpu_finish(i, False, now)
        if on_gpu and best is not None:
            return self.gpu_finish(i, best[1], True, now)
        return self.cpu_finish(i, True, now)


def simulate(costs: Costs, machine: Machine, policy: Policy, *,
             copies: CopyMode = "link", ahead: int | None = None) -> Schedule:
    """List-schedule ``costs`` on ``machine`` under ``policy`` (see the module docstring;
    ``ahead``: the device tasks whose copies to the device may run ahead of the devices, on the
    links; None: no bound)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if copies not in ("link", "slot"):
        raise ValueError(f"copies must be 'link' or 'slot'; got {copies!r}")
    if ahead is not None and ahead < 1:
        raise ValueError(f"ahead must be a whole number >= 1 or None; got {ahead!r}")
    run = _Run(costs, machine, copies, ahead)
    n = len(costs)
    rank = costs.priority or list(range(n))
    waiting = [len(deps) for deps in costs.deps]
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, deps in enumerate(costs.deps):
        for d in deps:
            consumers[d].append(i)
    ready = [(rank[i], i) for i in range(n) if not waiting[i]]
    heapq.heapify(ready)
    running: list[tuple[float, int]] = []  # (when its result is ready, task)
    now, done = 0.0, 0
    while done < n:
        # the tasks ready now, in Dask's order, each queued where the policy puts it
        while ready:
            i = heapq.heappop(ready)[1]
            heapq.heappush(running, (run.place(i, policy, now), i))
        # then the next moment a result is ready, and the tasks that it makes ready
        if not running:  # (not expected: a task that waits on nothing ran)
            raise RuntimeError(f"the simulation of {policy!r} stopped with {n - done} tasks left")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, j = heapq.heappop(running)
            done += 1
            for c in consumers[j]:
                waiting[c] -= 1
                if not waiting[c]:
                    heapq.heappush(ready, (rank[c], c))
    for u in costs.outputs:  # outputs end on the host
        run._down(u, True, run.gpu_free, run.down_free)
    ends = [*run.threads, *run.gpu_free, *run.up_free, *run.down_free]
    return Schedule(policy, max(ends, default=0.0), run.busy, run.gpu_tasks, machine,
                    tuple(run.assignment))


# ---------------------------------------------------------------------------------------------
# What explain() shows
# ---------------------------------------------------------------------------------------------
#: explain() simulates graphs up to this many described tasks (Dask's ordering alone takes
#: seconds past it)
SIMULATE_MAX_TASKS: Final = 100_000
#: explain()'s bound: the LP up to this many tasks, given at most this many simplex iterations
#: (the largest graphs tests/test_shared_description.py explains, a map_overlap and a
#: matmul-sum, need 2,200 and 5,100: under a second each on a loaded 2-core machine)
EXPLAIN_LP_MAX_TASKS: Final = 3_000
EXPLAIN_LP_ITERATIONS: Final = 20_000


@dataclass(frozen=True)
class Summary:
    """A plan held against the machine: the ``bound`` and the plan's ``predicted`` schedule
    (policy ``static``, or ``dual`` where the plan has dual tasks; copies as the run makes
    them) on ``machine``."""

    machine: Machine
    costs: Costs
    bound: Bound
    predicted: Schedule

    def text(self) -> str:
        m, b, s = self.machine, self.bound, self.predicted
        ratio = s.makespan_s / b.seconds if b.seconds > 0 else 1.0
        # the parts within 1% of the bound bind it; none: the LP's copies and path together
        binding = " and ".join(k for k, v in b.parts.items() if v >= 0.99 * b.seconds) \
            or "copies and path together"
        gpus = f"{m.gpus} GPU" + ("s" if m.gpus != 1 else "")
        return (f"on {m.cpu_threads} CPU threads and {gpus} (the profile's machine): "
                f"predicted makespan {format_seconds(s.makespan_s)}, lower bound "
                f"{format_seconds(b.seconds)} ({ratio:.2f}x; bound by {binding}, "
                f"{b.gpu_share:.0%} of the device-capable work on the GPU); busy "
                f"CPU {s.busy_fraction('cpu'):.0%}, GPU {s.busy_fraction('gpu'):.0%}")

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_threads": self.machine.cpu_threads, "gpus": self.machine.gpus,
                "predicted_s": self.predicted.makespan_s, "bound_s": self.bound.seconds,
                "bound_method": self.bound.method, "bound_parts_s": dict(self.bound.parts),
                "mixed": self.bound.mixed,
                "busy": {kind: self.predicted.busy_fraction(kind) for kind in ("cpu", "gpu")}}


def summarize(graph: dict[Key, GraphNode], keys: Key | NestedKeys,
              description: GraphDescription, plan: Plan, profile: Profile, *,
              copies: CopyMode = "link", read_ahead: int | None = None) -> Summary | None:
    """The plan on the profile's machine (its threads and GPUs), or None past
    :data:`SIMULATE_MAX_TASKS` tasks. The bound is the LP up to :data:`EXPLAIN_LP_MAX_TASKS`
    tasks and within :data:`EXPLAIN_LP_ITERATIONS`, else the parts bound: explain() stays fast.
    Copies to the devices run at most :func:`~eugo_dask.pace.copies_ahead` device tasks ahead
    with ``eugo.read-ahead`` ``read_ahead`` (None: unbounded), as eugo's scheduler plugin holds
    them on a cluster."""
    if len(description.task_keys) > SIMULATE_MAX_TASKS:
        return None
    machine = Machine.from_profile(profile, gpus=max(int(profile.gpu.count), 1))
    costs = Costs.from_plan(graph, keys, description, plan, cpu_threads=profile.cpu.threads)
    bound = lower_bound(costs, machine, lp_max_tasks=EXPLAIN_LP_MAX_TASKS,
                        lp_iterations=EXPLAIN_LP_ITERATIONS)
    # (dual tasks as the scheduler plugin places them, where the plan has any)
    policy: Policy = "dual" if costs.dual else "static"
    ahead = copies_ahead(read_ahead, machine.gpus) if read_ahead is not None else None
    return Summary(machine, costs, bound,
                   simulate(costs, machine, policy, copies=copies, ahead=ahead))
