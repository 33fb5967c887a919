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
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

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
#: The policies whose placement the graph itself fixes (bar dual tasks): their copies are tasks
#: of their own, made as soon as the value is (dmda and spill decide a task as it becomes ready,
#: its copies with it)
FIXED_POLICIES: Final = frozenset({"static", "all-cpu", "all-gpu", "dual"})
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
    #: how many like tasks each stands for, where one stands for a group (empty: one each);
    #: only the bound reads them (a group's work, copies and results are its tasks' together)
    counts: list[int] = field(default_factory=list)

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


def work_by_group(description: GraphDescription, keys: Key | NestedKeys, *, cpu_threads: int
                  ) -> tuple[Costs, list[int]]:
    """The graph's described work as the bound sees it with each layer's chunks of one
    estimate taken together (a group: one task of the model standing for ``counts`` of them),
    and the group of each described task (in ``description.task_keys``' order).

    Small whatever the graph's size (a layer's chunks share their estimate), for placing
    layers by the bound's split (:func:`balanced_shares`). A group reads a group where any of
    its tasks reads one of the other's (its copies: all of the other's values); the chunks
    tasks read from outside, and those fused into device tasks, are groups of values on the
    host (by layer). A group is an output where any of its tasks is. Where a group reads one
    made later in the walk (two layers interleaved), that edge is left out: the model's tasks
    come in dependency order. ``cpu_threads``: the threads the profile's estimates assumed (as
    :meth:`Costs.from_plan`)."""
    resolve = description.resolve
    groups: dict[tuple[Any, ...], int] = {}
    # per group: (cpu_s, gpu_s, bytes of a value, count, deps); the values on the host apart
    work: list[list[Any]] = []
    sources: dict[Any, list[int]] = {}  # layer -> [bytes of its values, how many]
    source_of: dict[Key, Any] = {}
    made: dict[Key, tuple[int, int]] = {}  # a described task's key -> (group, bytes)
    of_task: list[int] = []
    for k, est, inputs in zip(description.task_keys, description.task_estimates,
                              description.inputs, strict=True):
        name = k[0] if type(k) is tuple else k
        g = groups.get((name, id(est)))
        if g is None:
            g = groups[(name, id(est))] = len(work)
            capable = est.gpu_capable and math.isfinite(est.gpu_s)
            work.append([est.cpu_s * (1 if est.cpu_parallel else cpu_threads),
                         est.gpu_s if capable else None, est.out_bytes, 0, set()])
        group = work[g]
        group[3] += 1
        read = 0
        for d in inputs:
            d = resolve(d)
            if d in made:
                u, nbytes = made[d]
                if u != g:
                    group[4].add(u)
            else:
                spec = description.spec(d)
                nbytes = spec.nbytes if spec is not None else 0
                layer = d[0] if type(d) is tuple else d
                if d not in source_of:
                    source_of[d] = layer
                    totals = sources.setdefault(layer, [0, 0])
                    totals[0] += nbytes
                    totals[1] += 1
                group[4].add(("host", layer))
            read += nbytes
        if est.in_bytes > read and group[1] is not None:  # chunks fused into the task
            layer = ("eugo-embedded", name)
            totals = sources.setdefault(layer, [0, 0])
            totals[0] += est.in_bytes - read
            totals[1] += 1
            group[4].add(("host", layer))
        made[k] = (g, est.out_bytes)
        of_task.append(g)
    # the values on the host first, then the groups in the walk's order
    first = {("host", layer): i for i, layer in enumerate(sources)}
    shift = len(first)
    out = Costs([], [], [], [], [], frozenset(), [], counts=[])
    for layer, (nbytes, count) in sources.items():
        out.keys.append(("host", layer))
        out.cpu_s.append(0.0)
        out.gpu_s.append(None)
        out.nbytes.append(nbytes // max(count, 1))
        out.deps.append(())
        out.placement.append(False)
        out.counts.append(count)
    for g, (cpu_s, gpu_s, nbytes, count, deps) in enumerate(work):
        index = shift + g
        out.keys.append(("group", g))
        out.cpu_s.append(cpu_s)
        out.gpu_s.append(gpu_s)
        out.nbytes.append(nbytes)
        out.deps.append(tuple(sorted({first[d] if type(d) is tuple else shift + d
                                      for d in deps} - {index, *range(index, len(work) + shift)})))
        out.placement.append(False)
        out.counts.append(count)
    out.outputs = frozenset(shift + made[resolve(k)][0] for k in flatten_keys(keys)
                            if resolve(k) in made)
    return out, [shift + g for g in of_task]


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
    #: the LP's split behind it: each device-capable task's share on the devices (by index;
    #: empty for the parts bound)
    shares: dict[int, float] = field(default_factory=dict)

    @property
    def mixed(self) -> bool:
        """Whether the bound uses both kinds of device (each gets at least 5% of the work)."""
        return 0.05 <= self.gpu_share <= 0.95


def lower_bound(costs: Costs, machine: Machine, *, lp_max_tasks: int = LP_MAX_TASKS,
                lp_iterations: int | None = None) -> Bound:
    """No schedule of ``costs`` on ``machine`` finishes sooner (see the module docstring): the
    LP up to ``lp_max_tasks`` tasks (within ``lp_iterations`` of HiGHS's simplex for each
    solve, where given: a limit of work, not of time, so that the answer does not depend on
    how busy the machine is), else, or where the LP gives no answer, the parts bound."""
    if machine.gpus == 0 or not any(g is not None for g in costs.gpu_s):
        return _parts_bound(costs, machine)
    if len(costs) <= lp_max_tasks:
        try:
            found = _lp_bound(costs, machine, lp_iterations)
        except ImportError:
            found = None
        if found is not None:
            return found[0]
    return _parts_bound(costs, machine)


@dataclass(frozen=True)
class _Chains:
    """Copy-free chains through a graph: for each task ``fast``, the least it takes (its faster
    device); ``head``, the longest chain of those before it starts; ``tail``, after it ends."""

    fast: list[float]
    head: list[float]
    tail: list[float]

    @classmethod
    def of(cls, costs: Costs, machine: Machine) -> _Chains:
        fast = [c if g is None or machine.gpus == 0 else min(c, g)
                for c, g in zip(costs.cpu_s, costs.gpu_s)]
        head = [0.0] * len(costs)
        for i, deps in enumerate(costs.deps):  # (inputs come first)
            head[i] = max((head[d] + fast[d] for d in deps), default=0.0)
        tail = [0.0] * len(costs)
        for i in reversed(range(len(costs))):
            for d in costs.deps[i]:
                tail[d] = max(tail[d], fast[i] + tail[i])
        return cls(fast, head, tail)

    @property
    def path(self) -> float:
        return max((h + f for h, f in zip(self.head, self.fast)), default=0.0)


def _critical_path(costs: Costs, machine: Machine) -> float:
    """The longest chain, each task at its faster device, copies left out."""
    return _Chains.of(costs, machine).path


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


def _whole_task_limits(costs: Costs, machine: Machine, chains: _Chains
                       ) -> dict[int, tuple[float, float]]:
    """For each device-capable task, the least makespan of a schedule that runs it whole on a
    CPU thread, and on a device: the chains before and after it and its own time there (on a
    device also the copies in of its inputs that only the host makes, and the copy back of its
    result for an output or a consumer that only the host runs). A task runs whole where it
    runs: no schedule shorter than the first runs it on the CPU, none shorter than the second
    on a device."""
    head, tail, fast = chains.head, chains.tail, chains.fast
    host_only = [g is None for g in costs.gpu_s]
    back = [0.0] * len(costs)  # after the task on a device, what must follow
    for i in costs.outputs:
        back[i] = machine.d2h_s(costs.nbytes[i])
    for w, deps in enumerate(costs.deps):
        if host_only[w]:
            for u in deps:
                back[u] = max(back[u], machine.d2h_s(costs.nbytes[u]) + fast[w] + tail[w])
    limits = {}
    for v, gpu in enumerate(costs.gpu_s):
        if gpu is None:
            continue
        start = max([head[v], *(head[u] + fast[u] + machine.h2d_s(costs.nbytes[u])
                                for u in costs.deps[v] if host_only[u])])
        limits[v] = (head[v] + costs.cpu_s[v] + tail[v], start + gpu + max(tail[v], back[v]))
    return limits


class _Solved(NamedTuple):
    """One solve of :class:`_BoundLP`: its optimum (a bound), the split that reaches it, and
    the kinds of work whose windows held."""

    seconds: float
    shares: dict[int, float]
    windows: tuple[str, ...]


class _BoundLP:
    """The linear program of :func:`lower_bound`, built once, solved with some tasks' device
    fixed. Variables: each device-capable task's share on the devices ``x`` (0 to 1), when each
    task ends ``C``, the makespan ``T``, and the copies each edge and value needs.

    - a task ends after its inputs, their copies and its own time (``cpu + (gpu - cpu) x``);
    - each kind of resource does its work within the window its work can fall in: the CPU
      threads their tasks' share ``sum cpu (1 - x) <= p (T - r - q)``, with ``r`` the earliest
      any of it can start and ``q`` the least that must follow any of it (the copy-free
      chains); the devices theirs; each direction of the links the copies the split needs
      (a value copied once however many read it), between the first value that can be copied
      and the least that follows a copy.
    """

    def __init__(self, costs: Costs, machine: Machine) -> None:
        import numpy as np
        from scipy.sparse import coo_array

        n = len(costs)
        p, g_count = machine.cpu_threads, machine.gpus
        counts = costs.counts or [1] * n
        chains = _Chains.of(costs, machine)
        head, tail, fast = chains.head, chains.tail, chains.fast
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

        # the windows: (earliest start, least that follows) of each kind of work
        working = [i for i in range(n) if costs.cpu_s[i] > 0] or list(range(n))
        to_device = [v for _, v in edges if v in x_of]
        consumers: list[list[int]] = [[] for _ in range(n)]
        for v, deps in enumerate(costs.deps):
            for u in deps:
                consumers[u].append(v)
        after_back = [0.0 if u in costs.outputs else
                      min((fast[w] + tail[w] for w in consumers[u]), default=0.0) for u in moved]
        self.windows = {
            "cpu": (min(head[i] for i in working), min(tail[i] for i in working)),
            "gpu": (min(head[i] for i in capable), min(tail[i] for i in capable)),
            "h2d": (min((head[u] + fast[u] for u in moved), default=0.0),
                    min(((costs.gpu_s[v] or 0.0) + tail[v] for v in to_device), default=0.0)),
            "d2h": (min((head[u] + (costs.gpu_s[u] or 0.0) for u in moved if u in x_of),
                        default=0.0), min(after_back, default=0.0)),
        }
        # sum cpu (1 - x) <= p (T - r - q), sum gpu x <= G (T - r - q), and the links alike:
        # the window only where that kind of work is sure to be done (else T - r - q may be
        # below 0 where none is); the right-hand sides without and with it
        self.area_rows = {"cpu": len(rhs), "gpu": len(rhs) + 1, "h2d": len(rhs) + 2,
                          "d2h": len(rhs) + 3}
        row([*[(x_of[i], -costs.cpu_s[i] * counts[i]) for i in capable], (t, -float(p))],
            -sum(c * k for c, k in zip(costs.cpu_s, counts)))
        row([*[(x_of[i], (costs.gpu_s[i] or 0.0) * counts[i]) for i in capable],
             (t, -float(g_count))], 0.0)
        row([*[(up_of[u], h2d[u] * counts[u]) for u in moved], (t, -float(g_count))], 0.0)
        row([*[(down_of[u], d2h[u] * counts[u]) for u in moved], (t, -float(g_count))], 0.0)
        units = {"cpu": p, "gpu": g_count, "h2d": g_count, "d2h": g_count}
        self.window_rhs = {kind: rhs[r] - units[kind] * sum(self.windows[kind])
                           for kind, r in self.area_rows.items()}
        host_only = [g is None for g in costs.gpu_s]
        # what makes each kind of work sure: a host-only task with CPU work; a task fixed on a
        # device with device work, with a host-only input to copy in, with a result that must
        # come back
        self._cpu_sure = any(h and c > 0 for h, c in zip(host_only, costs.cpu_s))
        self._copies_in = {v for v in capable
                           if any(host_only[u] and costs.nbytes[u] for u in costs.deps[v])}
        self._copies_back = {v for v in capable if costs.nbytes[v] and (
            v in costs.outputs or any(host_only[w] for w in consumers[v]))}
        # (duration, how many, column) of each task and copy, for the rows of capacity()
        self.whole: dict[str, list[tuple[float, int, int | None]]] = {
            "cpu": [(costs.cpu_s[i], counts[i], x_of.get(i)) for i in range(n)
                    if costs.cpu_s[i] > 0],
            "gpu": [((costs.gpu_s[i] or 0.0), counts[i], x_of[i]) for i in capable
                    if costs.gpu_s[i]],
            "h2d": [(h2d[u], counts[u], up_of[u]) for u in moved if h2d[u] > 0],
            "d2h": [(d2h[u], counts[u], down_of[u]) for u in moved if d2h[u] > 0],
        }
        self.costs, self.machine, self.chains = costs, machine, chains
        self.capable, self.moved, self.edges = capable, moved, edges
        self.x_of, self.t, self.h2d, self.d2h, self.counts = x_of, t, h2d, d2h, counts
        self.objective = np.zeros(var)
        self.objective[t] = 1.0
        # the work of a split: each resource's seconds over its units, added up
        self.work = np.zeros(var)
        for i in capable:
            self.work[x_of[i]] = counts[i] * ((costs.gpu_s[i] or 0.0) / g_count
                                              - costs.cpu_s[i] / p)
        for u in moved:
            self.work[up_of[u]] = counts[u] * h2d[u] / g_count
            self.work[down_of[u]] = counts[u] * d2h[u] / g_count
        self.upper = np.full(var, np.inf)
        for i in x_of.values():
            self.upper[i] = 1.0
        self.matrix = coo_array((vals, (rows, cols)), shape=(len(rhs), var)).tocsr()
        self.rhs = np.asarray(rhs)

    def capacity(self, tau: float) -> tuple[list[list[tuple[int, float]]], list[float]]:
        """The rows that hold in a schedule of makespan ``tau`` because its units run whole
        tasks and copies: a CPU thread runs at most ``k`` tasks longer than ``tau / (k + 1)``,
        and so does a device, and a link copies at most ``k`` values that take longer (for
        ``k`` up to :data:`WHOLE_TASK_ROUNDS`). As (terms, right-hand side) of ``<=`` rows."""
        rows: list[list[tuple[int, float]]] = []
        rhs: list[float] = []
        for kind, items in self.whole.items():
            units = self.machine.cpu_threads if kind == "cpu" else self.machine.gpus
            for k in range(1, WHOLE_TASK_ROUNDS + 1):
                over = tau / (k + 1) * (1 + 1e-9) + 1e-15
                chosen = [item for item in items if item[0] > over]
                if sum(count for _, count, _ in chosen) <= k * units:
                    continue  # (it holds whatever the split)
                sign = -1.0 if kind == "cpu" else 1.0  # sum count (1 - x) <= k p
                rows.append([(col, sign * count) for _, count, col in chosen if col is not None])
                rhs.append(k * units - (sum(count for _, count, _ in chosen) if kind == "cpu"
                                        else 0.0))
        return rows, rhs

    def solve(self, on_gpu: Iterable[int], on_cpu: Iterable[int], iterations: int | None,
              *, tau: float | None = None, within: float | None = None) -> _Solved | None:
        """The LP's optimum with the tasks ``on_gpu`` wholly on the devices and ``on_cpu`` on
        the CPU (less the solver's tolerance: a bound), and each capable task's share; with
        ``tau``, the rows of :meth:`capacity` added. Infinite where nothing is feasible; None
        where the solver ran out of iterations (or, ``within`` given, found none). With
        ``within``: the split of least work (:attr:`work`) of makespan at most ``within``."""
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import coo_array, vstack

        on_gpu, on_cpu = set(on_gpu), set(on_cpu)
        lower, upper = np.zeros(len(self.upper)), self.upper.copy()
        for i in on_gpu:
            lower[self.x_of[i]] = 1.0
        for i in on_cpu:
            upper[self.x_of[i]] = 0.0
        rhs = self.rhs.copy()
        sure = self.sure(on_gpu, on_cpu)
        for kind in sure:
            rhs[self.area_rows[kind]] = self.window_rhs[kind]
        options = {"maxiter": iterations} if iterations is not None else {}
        # the dual simplex: deterministic, one thread (HiGHS's choice between methods is its own)
        objective = self.objective
        if within is not None:
            objective, upper[self.t] = self.work, within
        matrix = self.matrix
        if tau is not None:
            extra, extra_rhs = self.capacity(tau)
            if extra:
                r = [i for i, terms in enumerate(extra) for _ in terms]
                c = [col for terms in extra for col, _ in terms]
                v = [value for terms in extra for _, value in terms]
                matrix = vstack([matrix, coo_array((v, (r, c)), shape=(len(extra),
                                                                       matrix.shape[1]))]).tocsr()
                rhs = np.concatenate([rhs, extra_rhs])
        result = linprog(objective, A_ub=matrix, b_ub=rhs,
                         bounds=np.column_stack([lower, upper]), method="highs-ds",
                         options=options)
        if result.status == 2 and within is None:  # infeasible: no schedule this short
            return _Solved(math.inf, {}, ())
        if result.status != 0:  # out of iterations
            return None
        # the LP's optimum, less its solver's tolerance, is the bound (splits clipped to [0, 1]:
        # the solver's may stray by its tolerance)
        seconds = max(float(result.x[self.t]) * (1 - 1e-6) - 1e-12, 0.0)
        return _Solved(seconds, {i: min(max(float(result.x[x]), 0.0), 1.0)
                                 for i, x in self.x_of.items()}, tuple(sure))

    def sure(self, on_gpu: set[int], on_cpu: set[int]) -> list[str]:
        """The kinds of work a schedule with ``on_gpu`` on the devices and ``on_cpu`` on the
        CPU is sure to do (their windows hold)."""
        costs = self.costs
        sure = {"cpu": self._cpu_sure or any(costs.cpu_s[i] > 0 for i in on_cpu),
                "gpu": any(costs.gpu_s[i] for i in on_gpu),
                "h2d": not on_gpu.isdisjoint(self._copies_in),
                "d2h": not on_gpu.isdisjoint(self._copies_back)}
        return [kind for kind, yes in sure.items() if yes]

    def bound(self, seconds: float, share: dict[int, float],
              windows: Iterable[str] = ()) -> Bound:
        """The bound ``seconds`` with the parts of the split ``share`` that reaches it."""
        costs, capable, moved, counts = self.costs, self.capable, self.moved, self.counts
        g_count = self.machine.gpus
        gpu_work = sum((costs.gpu_s[i] or 0.0) * share[i] * counts[i] for i in capable)
        # the copies the split itself needs (the LP's own copy variables may sit anywhere below T)
        up = dict.fromkeys(moved, 0.0)
        down = {u: share.get(u, 0.0) if u in costs.outputs else 0.0 for u in moved}
        for u, v in self.edges:
            up[u] = max(up[u], share.get(v, 0.0) - share.get(u, 0.0))
            down[u] = max(down[u], share.get(u, 0.0) - share.get(v, 0.0))
        w = {kind: self.windows[kind] if kind in windows else (0.0, 0.0) for kind in self.windows}
        cpu_work = sum(c * k for c, k in zip(costs.cpu_s, counts)) - sum(
            costs.cpu_s[i] * share[i] * counts[i] for i in capable)
        parts = {
            "cpu": sum(w["cpu"]) + cpu_work / self.machine.cpu_threads,
            "gpu": sum(w["gpu"]) + gpu_work / g_count,
            "h2d": sum(w["h2d"]) + sum(self.h2d[u] * up[u] * counts[u] for u in moved) / g_count,
            "d2h": sum(w["d2h"]) + sum(self.d2h[u] * down[u] * counts[u] for u in moved) / g_count,
            "path": self.chains.path,
        }
        total_gpu = sum((costs.gpu_s[i] or 0.0) * counts[i] for i in capable) or 1.0
        # (the copy-free critical path is a bound of its own; the LP's optimum is at least it, up
        # to the solver's tolerance)
        seconds = max(seconds, parts["path"])
        return Bound(seconds, {k: min(v, seconds) for k, v in parts.items()},
                     gpu_work / total_gpu, "lp", share)


def _fixed_at(limits: dict[int, tuple[float, float]], tau: float
              ) -> tuple[set[int], set[int]] | None:
    """The tasks no schedule of makespan ``tau`` runs off the devices, and those none runs on
    them (:func:`_whole_task_limits`); None where a task fits nowhere."""
    over = tau * (1 + 1e-9) + 1e-15  # (fixing fewer tasks is always safe)
    on_gpu = {v for v, (cpu, _) in limits.items() if cpu > over}
    on_cpu = {v for v, (_, gpu) in limits.items() if gpu > over}
    return None if on_gpu & on_cpu else (on_gpu, on_cpu)


def _lp_bound(costs: Costs, machine: Machine, iterations: int | None
              ) -> tuple[Bound, _BoundLP, dict[int, tuple[float, float]]] | None:
    """The LP (:class:`_BoundLP`) with every task whole: the least ``tau`` that the LP reaches
    with the tasks that would make a schedule longer than ``tau`` off the device that would
    (:func:`_whole_task_limits`) kept off it.

    Call ``B(tau)`` the LP's optimum with those tasks fixed. A schedule of makespan ``M`` is a
    solution of the LP at ``tau = M``, so ``M >= B(M)``; ``B`` only falls as ``tau`` grows (fewer
    tasks are fixed), so the ``tau`` with ``tau >= B(tau)`` are those from a least one on, and it
    is the bound. ``B`` changes only at the limits: between two of them it is one LP's optimum,
    and a bisection over them finds the least such ``tau`` with a few solves."""
    lp = _BoundLP(costs, machine)
    free = lp.solve((), (), iterations)
    if free is None:
        return None
    limits = _whole_task_limits(costs, machine, lp.chains)
    best = lp.bound(*free)
    # the makespans at which the fixed tasks change, above the free LP's (below it, none is
    # reached: B(tau) >= B(inf))
    durations = {d for items in lp.whole.values() for d, _, _ in items}
    points = sorted({v for v in (*(v for pair in limits.values() for v in pair),
                                 *((k + 1) * d for d in durations
                                   for k in range(1, WHOLE_TASK_ROUNDS + 1)))
                     if math.isfinite(v) and v > best.seconds})
    candidates = [best.seconds, *points]

    def at(tau: float) -> _Solved | None:
        """B(tau), or None (the solver ran out); infinite where a task fits nowhere."""
        fixed = _fixed_at(limits, tau)
        return (_Solved(math.inf, {}, ()) if fixed is None
                else lp.solve(*fixed, iterations, tau=tau))

    lo, hi = 0, len(candidates)  # (past the last candidate nothing is fixed: B = B(inf))
    while lo < hi:
        mid = (lo + hi) // 2
        solved = at(candidates[mid])
        if solved is None:  # (out of iterations: what is known so far)
            break
        if solved[0] <= candidates[mid]:
            hi = mid
            continue
        # no tau up to this candidate is reached; up to the next one, none below B(candidate)
        lo = mid + 1
        reach = min(solved[0], candidates[lo] if lo < len(candidates) else math.inf)
        if reach > best.seconds and math.isfinite(reach):
            best = (lp.bound(*solved) if solved.seconds <= reach
                    else lp.bound(reach, free.shares, free.windows))
    return best, lp, limits


#: :func:`balanced_shares` puts a group whose share on the devices is at most this wholly on
#: the CPU, one whose share is at least 1 less this wholly on the devices, and rounds the others
SPLIT_SHARE: Final = 0.05
#: :meth:`_BoundLP.capacity` counts the whole tasks a unit runs up to this many a unit
WHOLE_TASK_ROUNDS: Final = 3
#: :func:`balanced_shares` takes the split of least work among those within this fraction of
#: the bound
SHARE_SLACK: Final = 0.05


def balanced_shares(costs: Costs, machine: Machine, *, slack: float = SHARE_SLACK,
                    lp_iterations: int | None = None) -> tuple[Bound, dict[int, float]] | None:
    """The LP bound of ``costs`` on ``machine`` and a split of the work that reaches it: each
    device-capable task's share on the devices. The bound's own split is one of many that
    reach it (an idle device's share is any that keeps it idle enough): this is the one of
    least work (every resource's seconds over its units, added up) among the splits within
    ``slack`` of the bound, so that no work moves where it gains nothing. None without the LP
    (no SciPy, no device, nothing a device can run, or out of iterations)."""
    if machine.gpus == 0 or not any(g is not None for g in costs.gpu_s):
        return None
    try:
        found = _lp_bound(costs, machine, lp_iterations)
    except ImportError:
        return None
    if found is None:
        return None
    bound, lp, limits = found
    within = bound.seconds * (1 + slack)
    fixed = _fixed_at(limits, within)
    solved = (lp.solve(*fixed, lp_iterations, tau=within, within=within)
              if fixed is not None else None)
    shares = solved.shares if solved is not None else bound.shares
    return bound, _whole_rounds(costs, machine, shares)


def _whole_rounds(costs: Costs, machine: Machine, shares: dict[int, float]
                  ) -> dict[int, float]:
    """``shares`` with each group's within :data:`SPLIT_SHARE` of 0 or 1 made that, and each
    split group's (of ``count`` tasks) rounded to a number of its tasks on the devices that
    leaves neither side a part-filled round where a round more or less would do: of the counts
    within a round of the devices of the share's, and none and all, the one whose rounds end
    first (its tasks on the threads one at a time each, their copies back of what they read
    from the devices on the links; on the devices one at a time each at the pace of its slowest
    stage, copy in, kernel or copy back, after the first one's other stages), the nearest the
    share's on a tie."""
    out = dict(shares)
    p, g = machine.cpu_threads, machine.gpus
    counts = costs.counts or [1] * len(costs)
    consumers: list[list[int]] = [[] for _ in range(len(costs))]
    for v, deps in enumerate(costs.deps):
        for u in deps:
            consumers[u].append(v)
    for i, share in shares.items():
        n, gpu = counts[i], costs.gpu_s[i]
        if share <= SPLIT_SHARE or share >= 1 - SPLIT_SHARE:  # (nearly all on one side: all)
            out[i] = 0.0 if share <= SPLIT_SHARE else 1.0
            continue
        if n < 2 or gpu is None:
            continue
        # each value a task reads is copied once for all its readers: a task's share of the
        # copies of what it reads from the other side (on the CPU, copies back on the links)
        on_host = [shares.get(u, 0.0) < 0.5 for u in costs.deps[i]]
        copy_in = sum(min(counts[u] / n, 1.0) * machine.h2d_s(costs.nbytes[u])
                      for u, host in zip(costs.deps[i], on_host) if host)
        copy_out = sum(min(counts[u] / n, 1.0) * machine.d2h_s(costs.nbytes[u])
                       for u, host in zip(costs.deps[i], on_host) if not host)
        back = i in costs.outputs or any(shares.get(w, 0.0) < 0.5 for w in consumers[i])
        stages = (copy_in, gpu, machine.d2h_s(costs.nbytes[i]) if back else 0.0)
        stage, fill = max(stages), sum(stages) - max(stages)  # (fill: the first task's others)
        want = share * n
        near = range(max(0, math.floor(want) - g), min(n, math.ceil(want) + g) + 1)
        # (each count's rounds' end, then how far from the share's; -(-a // b): a / b up)
        ends = [(max(-(-(n - k) // p) * costs.cpu_s[i], (n - k) * copy_out / g,
                     -(-k // g) * stage + (fill if k else 0)), abs(k - want), k)
                for k in {0, n, *near}]
        out[i] = min(ends)[2] / n
    return out


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


def dual_copy_seconds(costs: Costs, machine: Machine, i: int) -> tuple[float, float]:
    """The copies dual task ``i`` makes inside it on a device: its inputs in, its result back
    (as :class:`~eugo_dask.runtime.DualCall` makes them)."""
    return (sum(machine.h2d_s(costs.nbytes[d]) for d in costs.deps[i]),
            machine.d2h_s(costs.nbytes[i]))


def dual_slot_seconds(costs: Costs, machine: Machine, i: int) -> float:
    """What dual task ``i`` holds a GPU slot for: its inputs copied in, its work, its result
    copied back (:func:`dual_copy_seconds`)."""
    return sum(dual_copy_seconds(costs, machine, i)) + (costs.gpu_s[i] or 0.0)


class _Run:
    """The state of one simulation: when each unit is next free, where each value is."""

    def __init__(self, costs: Costs, machine: Machine, copies: CopyMode,
                 ahead: int | None = None) -> None:
        self.costs, self.machine, self.copies = costs, machine, copies
        # the copies to the devices run at most `ahead` device tasks ahead (links only)
        self.ahead = ahead if copies == "link" else None
        # when each device task placed that copied a value to its device ends, in order
        self.device_ends: list[float] = []
        self.copied: set[int] = set()  # the values copied to a device
        # held copies made ahead (plan_copies, copy_ahead): each first reader's place among
        # the device tasks that read a copy, and the copies waiting for their gate's task
        self.first_reader: list[int | None] = []
        self.reader_place: dict[int, int] = {}
        self.held: deque[tuple[int, int]] = deque()  # (the reader's place, the value)
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
        self.ahead_up: list[bool] = []  # (see plan_copies)
        self.ahead_down: list[bool] = []
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
        for d in self.costs.deps[i]:
            there = self.on_gpu[d].get(g)
            if there is None:
                host = self._down(d, commit, slots, down)
                seconds = self.machine.h2d_s(self.costs.nbytes[d])
                start = max(host, lane[g], gate)
                there = lane[g] = start + seconds
                if commit:
                    self.on_gpu[d][g] = there
                    self.copied.add(d)
                    self.busy["h2d"] += seconds
            ready = max(ready, there)
        start = max(ready, slots[g], now)
        end = slots[g] = start + gpu_s
        if commit:
            self.gpu_free, self.up_free, self.down_free = slots, up, down
            self.on_gpu[i][g] = end
            if any(d in self.copied for d in self.costs.deps[i]):
                # (the gate counts the device tasks that read a value copied to the device)
                self.device_ends.append(end)
                self._release_held()
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

    def dual_gpu_run(self, i: int, g: int, now: float) -> float:
        """Run dual task ``i``, ready at ``now``, on GPU ``g``'s slot: its copies inside it,
        each on its direction of the link as well (the link is one, whoever copies)."""
        machine, costs = self.machine, self.costs
        slots, up, down = list(self.gpu_free), list(self.up_free), list(self.down_free)
        ready = max((self._down(d, True, slots, down) for d in costs.deps[i]), default=0.0)
        copy_in, copy_back = dual_copy_seconds(costs, machine, i)
        t = max(ready, slots[g], now)
        if copy_in and self.copies == "link":
            t = up[g] = max(t, up[g]) + copy_in
        else:
            t += copy_in
        t += costs.gpu_s[i] or 0.0
        if copy_back and self.copies == "link":
            t = down[g] = max(t, down[g]) + copy_back
        else:
            t += copy_back
        end = slots[g] = t
        self.gpu_free, self.up_free, self.down_free = slots, up, down
        self.on_host[i] = end
        self.busy["gpu"] += costs.gpu_s[i] or 0.0
        self.busy["h2d"] += copy_in
        self.busy["d2h"] += copy_back
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
            return self.dual_gpu_run(i, int(choice.worker), now)
        return self.cpu_finish(i, True, now)

    def plan_copies(self, policy: Policy, consumers: list[list[int]]) -> None:
        """Under a placement fixed in the graph, its copies are tasks of their own (eugo's
        ``eugo-todevice-…``, ``eugo-tohost-…``), ready as soon as the value they copy is: mark
        the values to copy to a device (a fixed GPU task reads them) and back (a host task,
        or a dual one, reads them), for :meth:`copy_ahead`."""
        costs = self.costs
        fixed_gpu = [g is not None and not (policy == "dual" and i in costs.dual)
                     and (policy == "all-gpu" or (policy != "all-cpu" and costs.placement[i]))
                     for i, g in enumerate(costs.gpu_s)]
        self.ahead_up = [any(fixed_gpu[v] for v in consumers[u]) for u in range(len(costs))]
        self.ahead_down = [any(not fixed_gpu[v] for v in consumers[u])
                           for u in range(len(costs))]
        rank = costs.priority or list(range(len(costs)))
        self.first_reader = [min((v for v in consumers[u] if fixed_gpu[v]),
                                 key=rank.__getitem__, default=None)
                             for u in range(len(costs))]

    def copy_ahead(self, u: int) -> None:
        """Value ``u`` is made: copy it ahead where :meth:`plan_copies` says, to the device
        whose link frees first (where its readers are placed later, the device that finishes
        them first: where it is, unless that is busier than a copy). Held ``ahead`` device
        tasks ahead, as eugo's plugin holds a copy task until its gate ends: the copies of the
        k-th device task reading a copy (its place among them: the order their values are
        made in, as a worker takes copy tasks) start once the (k - ahead)-th has ended, held
        until that task is placed where it is not yet (:meth:`_release_held`)."""
        if not self.ahead_up:
            return
        made = self.on_host[u]
        if made is not None and self.ahead_up[u] and not self.on_gpu[u]:
            if self.ahead is None:
                self._copy_up(u, made)
                return
            reader = self.first_reader[u]
            place = self.reader_place.setdefault(reader, len(self.reader_place))  # type: ignore[arg-type]
            if place < self.ahead:
                self._copy_up(u, made)
            else:
                self.held.append((place, u))
                self._release_held()
        elif made is None and self.on_gpu[u] and self.ahead_down[u]:
            self._down(u, True, self.gpu_free, self.down_free)

    def _copy_up(self, u: int, start: float) -> None:
        """Copy value ``u`` to the device whose lane frees first, from ``start``."""
        lane = self.gpu_free if self.copies == "slot" else self.up_free
        g = min(range(self.machine.gpus), key=lambda g: (max(start, lane[g]), g))
        seconds = self.machine.h2d_s(self.costs.nbytes[u])
        there = lane[g] = max(start, lane[g]) + seconds
        self.on_gpu[u][g] = there
        self.copied.add(u)
        self.busy["h2d"] += seconds

    def _release_held(self) -> None:
        """Make the held copies whose gate's device task is placed (in their readers' order),
        each once that task ends; a copy its reader made itself meanwhile is not made again."""
        ends = self.device_ends
        while self.held and self.ahead is not None and self.held[0][0] - self.ahead < len(ends):
            place, u = self.held.popleft()
            if not self.on_gpu[u]:
                self._copy_up(u, max(self.on_host[u] or 0.0, ends[place - self.ahead]))

    def best_gpu(self, i: int, now: float = 0.0, *, local: bool = False
                 ) -> tuple[float, int] | None:
        """The GPU where task ``i``, ready at ``now``, would finish first; with ``local``,
        among those that hold one of its inputs where any does (distributed sends a task to a
        worker that holds a dependency: a placement fixed in the graph follows its copies)."""
        gpus: Iterable[int] = range(self.machine.gpus)
        if local:
            holding = {g for d in self.costs.deps[i] for g in self.on_gpu[d]}
            gpus = sorted(holding) or gpus
        return min(((self.gpu_finish(i, g, False, now), g) for g in gpus), default=None)

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
        best = self.best_gpu(i, now, local=policy in FIXED_POLICIES) if capable else None
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
    if policy in FIXED_POLICIES and machine.gpus:
        run.plan_copies(policy, consumers)
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
        made = []
        while running and running[0][0] <= now:
            _, j = heapq.heappop(running)
            done += 1
            made.append(j)
            for c in consumers[j]:
                waiting[c] -= 1
                if not waiting[c]:
                    heapq.heappush(ready, (rank[c], c))
        # (copies ahead as a worker takes copy tasks: in Dask's order, that of their readers)
        for j in sorted(made, key=lambda j: min((rank[c] for c in consumers[j]), default=0)):
            run.copy_ahead(j)
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
    #: whose machine it is, as the text says it
    origin: str = "the profile's machine"

    def text(self) -> str:
        m, b, s = self.machine, self.bound, self.predicted
        ratio = s.makespan_s / b.seconds if b.seconds > 0 else 1.0
        # the parts within 1% of the bound bind it; none: the LP's copies and path together
        binding = " and ".join(k for k, v in b.parts.items() if v >= 0.99 * b.seconds) \
            or "copies and path together"
        gpus = f"{m.gpus} GPU" + ("s" if m.gpus != 1 else "")
        threads = f"{m.cpu_threads} CPU thread" + ("s" if m.cpu_threads != 1 else "")
        return (f"on {threads} and {gpus} ({self.origin}): "
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
              copies: CopyMode = "link", machine: Machine | None = None,
              read_ahead: int | None = None) -> Summary | None:
    """The plan on ``machine`` (None: the profile's, its threads and GPUs), or None past
    :data:`SIMULATE_MAX_TASKS` tasks. The bound is the LP up to :data:`EXPLAIN_LP_MAX_TASKS`
    tasks and within :data:`EXPLAIN_LP_ITERATIONS`, else the parts bound: explain() stays fast.
    Copies to the devices run at most :func:`~eugo_dask.pace.copies_ahead` device tasks ahead
    with ``eugo.read-ahead`` ``read_ahead`` (None: unbounded), as eugo's scheduler plugin holds
    them on a cluster."""
    if len(description.task_keys) > SIMULATE_MAX_TASKS:
        return None
    origin = "the profile's machine" if machine is None else machine.name or "the machine given"
    if machine is None:
        machine = Machine.from_profile(profile, gpus=max(int(profile.gpu.count), 1))
    costs = Costs.from_plan(graph, keys, description, plan, cpu_threads=profile.cpu.threads)
    bound = lower_bound(costs, machine, lp_max_tasks=EXPLAIN_LP_MAX_TASKS,
                        lp_iterations=EXPLAIN_LP_ITERATIONS)
    # (dual tasks as the scheduler plugin places them, where the plan has any)
    policy: Policy = "dual" if costs.dual else "static"
    ahead = copies_ahead(read_ahead, machine.gpus) if read_ahead is not None else None
    return Summary(machine, costs, bound,
                   simulate(costs, machine, policy, copies=copies, ahead=ahead), origin)
