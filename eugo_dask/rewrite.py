"""Plan -> graph: GPU tasks, transfer tasks and resource annotations.

For every task the plan puts on the GPU, with key ``K`` (``("name", i, j)``):

- ``("eugo-gpu-<prefix>-name", i, j)`` runs the original function through
  :class:`~eugo_dask.runtime.DeviceCall` on device inputs and leaves its result on the device;
- each input produced on the host gets one ``("eugo-todevice-<prefix>-name", ...)`` copy task, shared by all of
  its GPU consumers;
- where an output or a CPU consumer needs NumPy, ``("eugo-tohost-<prefix>-name", i, j)`` copies the
  result back: an output ``K`` becomes an alias of it, any other ``K`` is renamed to it (its CPU
  consumers read the copy); where nothing needs NumPy, ``K`` disappears (its GPU consumers read
  the device copy).

A task the plan made dual (``eugo.dispatch: dual``) keeps reading its host inputs and runs
through :class:`~eugo_dask.runtime.DualCall` (both paths, its result on the host); it carries
role ``dual`` and its seconds either way, for the scheduler plugin that places it.

Output keys, culling and persist keep working because every output key still exists and still
holds NumPy. GPU and transfer tasks are annotated with the worker resource (``eugo.resource``)
so a distributed scheduler can pin them; key prefixes start with
``eugo-gpu``/``eugo-todevice``/``eugo-tohost`` so the dashboard tells them apart.
"""

from __future__ import annotations

import functools
import operator
import uuid
from typing import Any, Final, Literal, NamedTuple

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.utils import key_split

from eugo_dask.describe import GraphDescription
from eugo_dask.graph import (
    D2H_PREFIX,
    DUAL_PREFIX,
    FUSED_DEPS,
    FUSED_FUNC,
    FUSED_INNER,
    GPU_PREFIX,
    H2D_PREFIX,
    NO_KWARGS,
    Graph,
    Key,
    barrier_key,
    fused,
    keeps_its_name,
    new_task,
    shuffle_id_of,
    substitute_keys,
    with_shuffle_id,
)
from eugo_dask.ops import GPU, GPU_FAMILIES, HOST_FAMILIES, SOURCE_FAMILIES, classify_node, device_dtype_ok
from eugo_dask.pace import pace_reads
from eugo_dask.plan import Plan
from eugo_dask.runtime import DeviceCall, DualCall, pace_token, sources_on_device, to_device, to_host
from eugo_dask.unfuse import task_families

_KEY_OF = operator.attrgetter("key")
_IS_REF = TaskRef.__instancecheck__  # isinstance(x, TaskRef), for map


def _is_input(arg: Any) -> bool:
    """A fused task's input the fast path of :func:`rewrite_graph` takes: a reference (to be
    read from its device copy) or a literal (left as it is: ``DeviceCall`` copies an array
    among its arguments to the device)."""
    return isinstance(arg, (TaskRef, DataNode))


def _copy_task(key: Key, copy: Any, source: Key, device: str) -> Task:
    """``Task(key, copy, TaskRef(source), device)``, a copy to or from the device, made with its
    one dependency known."""
    return new_task(key, copy, (TaskRef(source), device), NO_KWARGS, frozenset([source]))


def _alphabetic_words(name: str) -> list[str]:
    # key_split keeps only alphabetic words, and stops at an 8-letter word starting a-f (it
    # takes that for a hex token): split "chunk_sum" into "chunk", "sum"; pad such words.
    words = []
    for part in name.replace("_", "-").split("-"):
        word = "".join(filter(str.isalpha, part))
        if len(word) == 8 and word[0] in "abcdef":
            word += "s"
        if word:
            words.append(word)
    return words


@functools.lru_cache(maxsize=4096)
def _prefixed_name(name: str, prefix: str, token: str) -> str:
    return "-".join([prefix, *_alphabetic_words(key_split(name)), name, token])


def prefixed_key(key: Key, prefix: str, token: str) -> Key:
    """``("chunk_sum-abc", 0, 1)`` -> ``("eugo-gpu-chunk-sum-chunk_sum-abc-<token>", 0, 1)``.

    The original name is kept whole after a copy of its task prefix in alphabetic words, so the
    dashboard's prefix (``key_split``) reads ``eugo-gpu-chunk-sum``; ``token`` names the
    settings the plan was made under, so a key keeps one meaning across plans.
    """
    if isinstance(key, tuple):
        return (_prefixed_name(str(key[0]), prefix, token), *key[1:])
    return _prefixed_name(str(key), prefix, token)


def renamed_key(key: Key, token: str) -> Key:
    """A key whose task eugo changed (or whose inputs it renamed): ``name`` -> ``name-<token>``.
    The prefix the dashboard shows is unchanged (``key_split`` stops at the token)."""
    if isinstance(key, tuple):
        return (f"{key[0]}-{token}", *key[1:])
    return f"{key}-{token}"


#: What a task of a rewritten graph is, carried to the scheduler in the ``eugo`` annotation:
#: device work, a copy to or from the device, host work that belongs on CPU workers
#: (aggregation, ``finalize``, I/O), other work the plan kept on the CPU, or work that carries
#: both paths, placed as it becomes ready (``dual``: its ``cpu_s`` is its seconds on one CPU
#: thread, its ``est_s`` on a GPU slot, copies in and back included).
#: ``pace``: a read's token (:mod:`eugo_dask.pace`), run on the GPU worker after a device task.
Role = Literal["gpu", "todevice", "tohost", "host", "cpu", "dual", "pace"]
GPU_ROLE: Final = "gpu"
TODEVICE_ROLE: Final = "todevice"
TOHOST_ROLE: Final = "tohost"
HOST_ROLE: Final = "host"
CPU_ROLE: Final = "cpu"
DUAL_ROLE: Final = "dual"
PACE_ROLE: Final = "pace"
#: Roles that run on GPU workers (device work, the copies on either side of it, reads' tokens).
DEVICE_ROLES: frozenset[Role] = frozenset({GPU_ROLE, TODEVICE_ROLE, TOHOST_ROLE, PACE_ROLE})
#: Roles of the tasks eugo writes (told by their functions).
_WRITTEN_ROLES: frozenset[Role] = DEVICE_ROLES | {DUAL_ROLE}
#: Roles that move data over the link: on a GPU worker, but never holding its GPU slot.
COPY_ROLES: frozenset[Role] = frozenset({TODEVICE_ROLE, TOHOST_ROLE})
#: Roles on a GPU worker that never hold its GPU slot: the copies, and the tokens (which run
#: where the device result they wait for is, and take no time).
SLOTLESS_ROLES: frozenset[Role] = COPY_ROLES | {PACE_ROLE}


def device_request(role: Role, resource: str, user: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The resources a task of ``role`` asks for on top of the user's own (``user``).

    Device work holds one unit of ``resource``, the GPU slot: one kernel stream per GPU. A copy
    (and a read's token, :mod:`eugo_dask.pace`, which takes no time and runs where the device
    result it waits for is) asks for none of it (``{resource: 0}``): it still goes only to
    workers that advertise the resource (distributed's ``valid_workers`` keeps the workers that
    have it, and a worker runs a task whose request it meets: 0 of 0 free), but it runs on a
    thread of its own while
    a kernel holds the slot, so copies and kernels overlap instead of taking turns. The link is
    shared by the copies in flight; CUDA orders each direction's copies on the device."""
    return {resource: 0 if role in SLOTLESS_ROLES else 1, **(user or {})}
#: A task's role with the estimates behind it: (role, CPU seconds, seconds as chosen).
RoleEntry = tuple[Role, float | None, float | None]


class TaskRoles:
    """What each task of a rewritten graph is, for the distributed scheduler, plus the user's
    own annotations of the tasks it came from.

    Per-key annotations come from it: ``eugo`` (``{"role": ..., "cpu_s": ..., "est_s": ...}``:
    ``host`` marks aggregation, ``finalize`` and I/O, which belong on CPU workers), every
    annotation the user put on the original tasks (``carried``: type -> key -> value), and, where
    the pass asks for it (``resource`` not None), ``resources``: ``{resource: 1}`` for device
    work and ``{resource: 0}`` for transfers (:func:`device_request`), so only GPU workers run
    them, with the resources the user asked of the task (its own, or else ``resources``: those
    around ``compute``). Keys with nothing get None,
    which the scheduler ignores.

    A per-key ``resources`` replaces the one the user gave the whole submission
    (``client.compute(..., resources=...)``), which the pass does not see: where eugo's scheduler
    plugin runs, it asks for the resource itself (``resource`` None), after the scheduler
    applied the user's restrictions.

    The scheduler keeps each task's annotations (half a million of them for a large graph):
    tasks with the same role and estimates share one ``eugo`` dict, and device tasks without
    resources of the user's own share one ``resources`` dict (neither Dask nor eugo's plugin
    changes an annotation in place).
    """

    def __init__(self, roles: dict[Key, RoleEntry], resource: str | None,
                 carried: dict[str, dict[Key, Any]] | None = None,
                 resources: dict[str, Any] | None = None, plan: str | None = None,
                 pacing: tuple[int, int] | None = None) -> None:
        self.roles = roles
        self.pacing = pacing
        self.resource = resource
        self.plan = plan
        self.carried = carried or {}
        self.resources = resources or {}
        self._shared: dict[RoleEntry, dict[str, Any]] = {}
        self._device_resources: dict[Role, dict[str, Any]] = (
            {role: device_request(role, resource, self.resources) for role in DEVICE_ROLES}
            if resource is not None else {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaskRoles, (self.roles, self.resource, self.carried, self.resources, self.plan,
                            self.pacing))

    def value(self, kind: str, key: Key) -> Any:
        """The ``kind`` annotation of ``key``."""
        if kind == "eugo":
            role = self.roles.get(key)
            if role is None:
                return None
            shared = self._shared.get(role)
            if shared is None:
                shared = self._shared[role] = {"role": role[0], "cpu_s": role[1],
                                               "est_s": role[2]}
                if self.plan is not None:
                    shared["plan"] = self.plan
                if role[0] == TODEVICE_ROLE and self.pacing is not None:
                    shared["reads_ahead"], shared["ahead"] = self.pacing
            return shared
        user = self.carried.get(kind, {}).get(key)
        if kind == "resources" and self.resource is not None:
            role = self.roles.get(key)
            if role is not None and role[0] in DEVICE_ROLES:
                return (device_request(role[0], self.resource, user) if user
                        else self._device_resources[role[0]])
        return user

    def annotations(self) -> dict[str, Any]:
        kinds = {"eugo", *self.carried}
        if self.resource is not None:
            kinds.add("resources")
        return {kind: _Lookup(self, kind) for kind in kinds}


class _Lookup:
    """A picklable per-key annotation callable: ``roles.value(kind, key)``."""

    def __init__(self, roles: TaskRoles, kind: str) -> None:
        self.roles, self.kind = roles, kind

    def __call__(self, key: Key) -> Any:
        return self.roles.value(self.kind, key)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Lookup, (self.roles, self.kind))


def annotated_graph(dsk: Graph, roles: TaskRoles) -> HighLevelGraph:
    """One-layer HighLevelGraph of (a copy of) ``dsk``, annotated with ``roles``."""
    return _one_layer(dict(dsk), roles)


def _one_layer(graph: dict[Key, GraphNode], roles: TaskRoles) -> HighLevelGraph:
    """``graph`` itself as the one layer of a HighLevelGraph, annotated with ``roles``."""
    name = f"eugo-{uuid.uuid4().hex}"
    layer = MaterializedLayer(graph, annotations=roles.annotations())
    return HighLevelGraph({name: layer}, {name: set()})


def roles_of_rewritten(dsk: Graph, resource: str | None) -> TaskRoles:
    """Roles read back from a graph rewritten earlier (its annotations lost to Dask's fusion);
    ``resource`` as :class:`TaskRoles` takes it."""
    roles: dict[Key, RoleEntry] = {}
    for key, node in dsk.items():
        role = _rewritten_role(node)
        cost = getattr(getattr(node, "func", None), "cost", None) if role == DUAL_ROLE else None
        if cost is not None:
            roles[key] = (DUAL_ROLE, *cost)
        elif role is not None:
            roles[key] = (role, None, None)
    return TaskRoles(roles, resource)


def written_by_eugo(node: Any) -> bool:
    """Whether ``node`` is a task eugo wrote: device work or a copy to or from the device (also
    fused by Dask into a task of its own after the pass), told by its function, whatever its
    key is called."""
    return _rewritten_role(node) in _WRITTEN_ROLES


def _rewritten_role(node: GraphNode) -> Role | None:
    if type(node) is not Task:
        return None
    if isinstance(node.func, DualCall):
        return DUAL_ROLE
    if isinstance(node.func, DeviceCall):
        return GPU_ROLE
    if node.func is to_device:
        return TODEVICE_ROLE
    if node.func is to_host:
        return TOHOST_ROLE
    if node.func is pace_token:
        return PACE_ROLE
    parts = fused(node)
    if parts is not None and any(_rewritten_role(p) in DEVICE_ROLES for p in parts.inner.values()):
        return GPU_ROLE  # fused by Dask after the first pass: device work inside
    families = task_families(node)
    if families & HOST_FAMILIES and not families & GPU_FAMILIES:
        return HOST_ROLE
    return None


def is_inner_source(node: GraphNode) -> bool:
    """A node inside a fused task whose result starts on the host: an embedded chunk, or a
    creation function (ones, arange, random...)."""
    if isinstance(node, DataNode):
        value = node.value
        return isinstance(value, np.ndarray) and value.ndim > 0 and device_dtype_ok(value.dtype)
    return type(node) is Task and classify_node(node)[0] in SOURCE_FAMILIES


def _nested_on_device(node: GraphNode, copies: dict[Key, TaskRef], outer: frozenset[Key],
                      reads: frozenset[Key]) -> GraphNode:
    """A node nested in a GPU task's arguments with every key it reads replaced by its device
    copy (``copies``: the references to those, for every key the task reads). The common shape
    (a tree reduction's ``_identity_cast(Alias(k1), Alias(k2), ...)``, a task per chunk) is
    rebuilt here with its dependencies known, each reference to an input becoming the reference
    to its copy: a ``TaskRef``, which ``Task`` evaluates as it does an alias of a key, without a
    set of dependencies of its own (a quarter of the tasks of a large matmul's graph are
    these). Anything else by ``substitute``. ``outer``: the keys the task it is nested in reads,
    whose copies are ``reads``: the nested task's own where it reads the same keys (the common
    case: the whole of the outer task's work is the nested one)."""
    if type(node) is not Task or not node.dependencies:
        return _substituted(node, copies)
    args: list[Any] = []
    for a in node.args:
        # a reference by alias (Alias(k)) or by TaskRef (a distributed Future is one too)
        if (type(a) is Alias and a.key is a.target) or isinstance(a, TaskRef):
            args.append(copies[a.key])
        elif isinstance(a, GraphNode):
            return _substituted(node, copies)
        else:
            args.append(a)
    kwargs = node.kwargs
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, (GraphNode, TaskRef)):
                return _substituted(node, copies)
    deps = node.dependencies
    return new_task(node.key, node.func, tuple(args), dict(kwargs) if kwargs else NO_KWARGS,
                    reads if deps == outer else frozenset([copies[d].key for d in deps]),
                    node.data_producer)


def _substituted(arg: Any, copies: dict[Key, TaskRef]) -> Any:
    """``arg`` reading the device copies of the keys it reads."""
    if isinstance(arg, TaskRef):  # a distributed Future is one too
        return copies[arg.key]
    if isinstance(arg, GraphNode):
        return arg.substitute({d: copies[d].key for d in arg.dependencies})
    return arg


class Rewrite(NamedTuple):
    """How a plan becomes a graph: the device that runs GPU tasks, the worker resource they
    ask for (None: eugo's scheduler plugin asks for it; see :class:`TaskRoles`), the token that
    names the settings (it goes into every key eugo writes), the user's own annotations of the
    original keys (type -> key -> value), and the resources the user asked of every task
    (``dask.annotate(resources=...)`` around ``compute``)."""

    device: str
    resource: str | None
    token: str
    carried: dict[str, dict[Key, Any]]
    resources: dict[str, Any] = {}
    #: the plan's id in the pass's log (:mod:`eugo_dask.pass_log`), carried in every task's
    #: ``eugo`` annotation so the scheduler plugin finds the plan of the tasks it runs
    plan: str | None = None
    #: the resource whose unit a dual task must be granted to run on the device
    #: (``eugo.resource``)
    slot_resource: str = "GPU"
    #: the reads that may run ahead of the device tasks consuming them (:mod:`eugo_dask.pace`);
    #: None: reads are not paced
    read_window: int | None = None
    #: where eugo's scheduler plugin paces the reads and the copies to the device on the
    #: scheduler instead (:mod:`eugo_dask.gates`): how many reads, and how many device tasks'
    #: copies, may run ahead of the device (carried in the copies' ``eugo`` annotation)
    pacing: tuple[int, int] | None = None


class Rewritten(NamedTuple):
    """The rewritten graph, and what :attr:`executed` is worked out from (only learning needs
    it)."""

    graph: HighLevelGraph
    plan: Plan
    on_device: dict[Key, TaskRef]  # a GPU task's key -> its device task
    renames: dict[Key, Key]

    @property
    def executed(self) -> dict[Key, Key]:
        """For each planned task, the key it runs under."""
        on_device, renames = self.on_device, self.renames
        return {k: on_device[k].key if d.device == GPU else renames.get(k, k)
                for k, d in self.plan.decisions.items()}


class _Transfers(dict[Key, TaskRef]):
    """The copies between host and device a rewrite writes (into ``out``, each with its role
    and origin).

    As a dict: a GPU task's key, or a key read by one (an alias, a host result) -> a reference
    to its device copy; a host result's copy task is written the first time it is asked for.
    One reference per copy, shared by its consumers. :meth:`copy_back` writes a GPU result's
    copy back to the host.

    A class of its own rather than one made inside :func:`rewrite_graph`: a class is a
    reference cycle, and one closing over the graph being written would keep that graph and the
    plan alive until the cyclic collector ran."""

    def __init__(self, plan: Plan, targets: dict[Key, Key], out: dict[Key, GraphNode],
                 roles: dict[Key, RoleEntry], outputs: set[Key], device: str,
                 token: str) -> None:
        super().__init__()
        self.plan, self.targets, self.out, self.roles = plan, targets, out, roles
        self.outputs, self.device, self.token = outputs, device, token
        self.origin: dict[Key, Key] = {}  # a copy written -> the original key it stands in for
        self.to_device_keys: list[Key] = []  # the copy tasks to the device written, in order
        # a key whose copy back took its place -> the copy's key
        self.copied_back: dict[Key, Key] = {}

    def __missing__(self, dep: Key) -> TaskRef:
        source: Key = self.targets.get(dep, dep)
        ref = self.get(source)
        if ref is None:
            placed = self.plan.decisions.get(source)
            if placed is not None and placed.device == GPU:
                # (the plan is in dependency order: never, in practice)
                ref = TaskRef(prefixed_key(source, GPU_PREFIX, self.token))
            else:
                key = prefixed_key(source, H2D_PREFIX, self.token)
                self.out[key] = _copy_task(key, to_device, source, self.device)
                self.roles[key] = (TODEVICE_ROLE, None, None)
                self.origin[key] = source
                self.to_device_keys.append(key)
                ref = self[source] = TaskRef(key)
        self[dep] = ref
        return ref

    def copy_back(self, key: Key, device_key: Key) -> None:
        """The result of the GPU task ``key`` (run as ``device_key``) copied back to the host,
        for an output or a CPU consumer; the copy gets a prefix of its own (the task stream
        tells it apart)."""
        host_key = prefixed_key(key, D2H_PREFIX, self.token)
        copy_back = _copy_task(host_key, to_host, device_key, self.device)
        self.roles[host_key] = (TOHOST_ROLE, None, None)
        self.origin[host_key] = key
        if key in self.outputs:  # the caller reads the original key: an alias of the copy
            self.out[host_key] = copy_back
            self.out[key] = Alias(key, host_key)
        else:  # in the original key's place, which CPU consumers read under its name
            self.out[key] = copy_back
            self.copied_back[key] = host_key


def rewrite_graph(dsk: Graph, plan: Plan, description: GraphDescription, original: Graph,
                  outputs: set[Key], how: Rewrite) -> Rewritten:
    """Apply ``plan`` to ``dsk`` (task-spec nodes, as ``description`` found them: its
    dependency order, its aliases' targets): see the module docstring. ``original`` is the
    graph as Dask's optimization left it: a key whose task differs from its task there (or
    reads a key that was renamed) gets a new name, unless it is one of the ``outputs``, so a key
    keeps one meaning whoever computes it."""
    device, token = how.device, how.token
    out = dict(dsk)
    decisions = plan.decisions
    host_needed = plan.host_needed
    roles: dict[Key, RoleEntry] = {}
    # one entry per role and estimates, shared by the tasks that have them (a layer's chunks):
    # the roles live as long as the graph does
    entries: dict[RoleEntry, RoleEntry] = {}
    inner_on_device: dict[int, dict[Key, GraphNode]] = {}
    dual_calls: dict[tuple[Any, ...], DualCall] = {}  # one per function, layer and cost
    # one DeviceCall per function and layer, and the layer's device name: by function and
    # layer, and the last one by layer (a layer has one function: one lookup by its name)
    calls: dict[tuple[int, Key], tuple[DeviceCall, Key]] = {}
    layer_calls: dict[Key, tuple[DeviceCall, Key]] = {}
    on_device = _Transfers(plan, description.targets, out, roles, outputs, device, token)
    # The loop runs once per task of graphs a million tasks large: what one task of a layer
    # works out (its DeviceCall, its device name, its fused inner graph on the device), every
    # task shares; the device task is made with the dependencies already known (new_task).
    # What is rarer (a task other than a fused one of plain inputs, a layer's first task, a
    # copy back) is a helper of its own.
    device_copy = on_device.__getitem__
    # (one decision per described task, in the order of the description's nodes)
    for (key, decision), node in zip(decisions.items(), description.task_nodes, strict=True):
        if decision.device != GPU:
            if decision.dual is not None:
                out[key] = _dual_task(node, how, inner_on_device, dual_calls,
                                      (decision.dual.thread_s, decision.dual.slot_s))
                entry: RoleEntry = (DUAL_ROLE, *decision.dual)
            else:
                role: Role = HOST_ROLE if decision.op in HOST_FAMILIES else CPU_ROLE
                entry = (role, decision.cpu_s, decision.cpu_s)
            roles[key] = entries.setdefault(entry, entry)
            continue
        func, args = node.func, node.args
        # the device copies of what the task reads, made (where missing) in the order of its
        # dependencies: that order makes the new graph's order and its dependency set's
        # (dask.order breaks ties by it)
        reads = frozenset(map(_KEY_OF, map(device_copy, node.dependencies)))
        refs = None
        if func is FUSED_FUNC and not node.kwargs:
            inputs = args[FUSED_DEPS:]
            if all(map(_IS_REF, inputs)):  # (a distributed Future is a TaskRef too)
                refs = list(map(device_copy, map(_KEY_OF, inputs)))
            elif all(map(_is_input, inputs)):  # literals among them (a scalar operand)
                refs = [device_copy(a.key) if _IS_REF(a) else a for a in inputs]
        if refs is not None:
            # the common case, a fused task reading plain references (and literals), its
            # inner graph shared by every chunk of a blockwise layer
            inner = args[FUSED_INNER]
            inner_on = inner_on_device.get(id(inner))
            if inner_on is None:
                inner_on = inner_on_device[id(inner)] = sources_on_device(
                    inner, is_inner_source, device, inner_on_device)
            args = (inner_on, *args[FUSED_INNER + 1:FUSED_DEPS], *refs)  # (inner comes first)
            kwargs: dict[str, Any] = NO_KWARGS
        else:
            args, kwargs = _arguments_on_device(node, on_device, reads, inner_on_device, device)
        name = key[0] if type(key) is tuple else key
        call = layer_calls.get(name)
        if call is None or call[0].func is not func:
            call = layer_calls[name] = _device_call(calls, func, key, name, device, token)
        device_key = (call[1], *key[1:]) if type(key) is tuple else call[1]
        out[device_key] = new_task(device_key, call[0], args, kwargs, reads, node.data_producer)
        on_device[key] = TaskRef(device_key)
        entry = (GPU_ROLE, decision.cpu_s, decision.gpu_total_s)
        roles[device_key] = entries.setdefault(entry, entry)
        if key in host_needed:
            on_device.copy_back(key, device_key)
        else:
            del out[key]
    _drop_aliases_on_device(out, description.targets, plan)
    renames, readers, shuffle_ids = _renames(out, description.order, original, outputs,
                                             on_device.to_device_keys, token,
                                             on_device.copied_back)
    graph = _renamed_graph(out, renames, readers, shuffle_ids)
    for old, new in renames.items():
        if old in roles:
            roles[new] = roles.pop(old)
    if how.read_window is not None:
        graph = _paced(graph, roles, renames, on_device.to_device_keys, outputs, how.read_window)
    carried = _carried_by_final_keys(how.carried, renames, on_device) if how.carried else {}
    return Rewritten(_one_layer(graph, TaskRoles(roles, how.resource, carried, how.resources,
                                                      how.plan, how.pacing)),
                     plan, on_device, renames)


def _dual_task(node: Task, how: Rewrite, inner_on_device: dict[int, dict[Key, GraphNode]],
               calls: dict[tuple[Any, ...], DualCall], cost: tuple[float, float]) -> Task:
    """The task of a dual ``node``: its function through :class:`DualCall` (one per function,
    layer and ``cost``, in ``calls``), reading its host inputs as it did (the task copies them
    itself where it runs on the device), the sources fused into it landing on the device on
    that path. (Its key is renamed ``eugo-dual-…`` with the others, :func:`_renames`.)"""
    reads = {d: TaskRef(d) for d in node.dependencies}
    args, kwargs = _arguments_on_device(node, reads, node.dependencies, inner_on_device,
                                        how.device)
    prefix = key_split(node.key)
    call = calls.get((id(node.func), prefix, cost))
    if call is None:
        call = calls[(id(node.func), prefix, cost)] = DualCall(
            node.func, how.device, prefix, how.slot_resource, cost)
    return new_task(node.key, call, args, kwargs, node.dependencies, node.data_producer)


def _paced(graph: dict[Key, GraphNode], roles: dict[Key, RoleEntry], renames: dict[Key, Key],
           copies: list[Key], outputs: set[Key], window: int) -> dict[Key, GraphNode]:
    """``graph`` with its reads paced to the device (:func:`~eugo_dask.pace.pace_reads`): the
    tokens get their role, a paced read keeps its own under its new key, and ``renames`` maps
    each original key to the key it finally runs under."""
    paced = pace_reads(graph, copies, outputs, window)
    if not paced.tokens:
        return graph
    for token in paced.tokens:
        roles[token] = _PACE_ENTRY
    before = {new: old for old, new in renames.items() if new in paced.renames}
    for old, new in paced.renames.items():
        if old in roles:
            roles[new] = roles.pop(old)
        renames[before.get(old, old)] = new
    return paced.graph


_PACE_ENTRY: RoleEntry = (PACE_ROLE, None, None)


def _arguments_on_device(node: Task, on_device: dict[Key, TaskRef], reads: frozenset[Key],
                         inner_on_device: dict[int, dict[Key, GraphNode]], device: str
                         ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments and keyword arguments of a GPU task other than a fused one reading plain
    references and literals, each reading the device copies of the keys it reads (``reads``:
    the references to those); a fused task's inner graph with its sources on the device
    (``inner_on_device``: those made so far, by the inner graph's id)."""
    rewritten = [on_device[a.key] if isinstance(a, TaskRef)  # a Future is one too
                 else _nested_on_device(a, on_device, node.dependencies, reads)
                 if isinstance(a, GraphNode)
                 else a
                 for a in node.args]
    kwargs = ({k: _substituted(v, on_device) for k, v in node.kwargs.items()}
              if node.kwargs else NO_KWARGS)
    parts = fused(node)
    if parts is not None:
        inner = parts.inner
        if id(inner) not in inner_on_device:
            inner_on_device[id(inner)] = sources_on_device(inner, is_inner_source, device,
                                                           inner_on_device)
        rewritten[0] = inner_on_device[id(inner)]
    return tuple(rewritten), kwargs


def _device_call(calls: dict[tuple[int, Key], tuple[DeviceCall, Key]], func: Any, key: Key,
                 name: Key, device: str, token: str) -> tuple[DeviceCall, Key]:
    """The ``DeviceCall`` of ``func`` in layer ``name`` (``key`` one of its tasks) and the
    layer's name on the device: made once per function and layer (``calls``)."""
    call = calls.get((id(func), name))
    if call is None:
        call = calls[(id(func), name)] = (DeviceCall(func, device, key_split(key)),
                                          prefixed_key(name, GPU_PREFIX, token))
    return call


def _drop_aliases_on_device(out: dict[Key, GraphNode], targets: dict[Key, Key],
                            plan: Plan) -> None:
    """Drop from ``out`` the aliases of results that stay on the device: they had only GPU
    consumers, now rewired to the device tasks."""
    decisions, host_needed = plan.decisions, plan.host_needed
    for key, source in targets.items():
        placed = decisions.get(source)
        if placed is not None and placed.device == GPU and source not in host_needed:
            del out[key]


def _carried_by_final_keys(user: dict[str, dict[Key, Any]], renames: dict[Key, Key],
                           transfers: _Transfers) -> dict[str, dict[Key, Any]]:
    """The user's annotations (type -> key -> value) by the keys of the rewritten graph: a GPU
    task's go to its device task too, and a copy's are those of the key it stands in for
    (see :func:`_carried`)."""
    origin = dict(transfers.origin)
    origin.update({transfers[k].key: k for k, d in transfers.plan.decisions.items()
                   if d.device == GPU})
    return _carried(user, renames, origin)


def _renames(out: Graph, order: list[Key], original: Graph, outputs: set[Key],
             to_device_keys: list[Key], token: str, copied_back: dict[Key, Key]
             ) -> tuple[dict[Key, Key], list[Key], dict[Key, tuple[str, str]]]:
    """New names for the original keys whose meaning changed: their task is not Dask's (split
    from a fused task, replaced by a copy back) or reads a renamed key. Keys eugo
    wrote carry the token already; outputs keep their names (their values are Dask's). A key
    whose copy back took its place (``copied_back``) takes the copy's name. A P2P shuffle whose
    transfers read renamed keys becomes a shuffle of its own (:func:`_renamed_shuffle`).

    Also the keys whose task may read a renamed key, to be looked at again once the names are
    known: the original keys whose meaning changed, and the copies to the device (which read
    host results by their original keys). The device tasks and copies back read only keys eugo
    wrote. And the shuffle ids to change, by key."""
    # (an original key reads a key eugo wrote only where eugo changed its task: seen below)
    changed: set[Key] = set()
    renames: dict[Key, Key] = {}
    readers: list[Key] = []
    shuffle_ids: dict[Key, tuple[str, str]] = {}
    barriers: set[Key] = set()  # of the shuffles renamed
    # (the keys moved to the device and consumed there are skipped by C, not by bytecode)
    for key in filter(out.__contains__, order):
        node = out[key]
        if node is not original.get(key) or not changed.isdisjoint(node.dependencies):
            if keeps_its_name(node):  # a P2P barrier: the whole shuffle gets a new id
                readers.extend(_renamed_shuffle(out, node, token, renames, shuffle_ids))
                barriers.add(key)
                changed.add(key)
                continue
            if barriers and not barriers.isdisjoint(node.dependencies):  # an unpack (fused?)
                shuffle_ids[key] = next(shuffle_ids[d] for d in node.dependencies
                                        if d in barriers)
            changed.add(key)
            copy_back = copied_back.get(key)
            if copy_back is not None:
                renames[key] = copy_back
                continue
            readers.append(key)
            if key not in outputs:
                dual = type(node) is Task and isinstance(node.func, DualCall)
                renames[key] = (prefixed_key(key, DUAL_PREFIX, token) if dual
                                else renamed_key(key, token))
    return renames, readers + to_device_keys, shuffle_ids


def _renamed_shuffle(out: Graph, barrier: Task, token: str, renames: dict[Key, Key],
                     shuffle_ids: dict[Key, tuple[str, str]]) -> list[Key]:
    """Make the P2P shuffle of ``barrier``, some of whose transfers read keys eugo renamed, a
    shuffle of its own: id ``<id>-<token>``, its barrier ``shuffle-barrier-<id>-<token>`` (the
    name distributed's shuffle plugins look it up by), every transfer renamed (with the tasks
    linear fusion glued to it), and its unpacks renamed as the barrier's readers are. Kept
    under Dask's id, the barrier had one name and two specs where the same rechunk was also
    computed without eugo ('Detected different run_spec'). Returns the keys to rewrite."""
    old_id = shuffle_id_of(barrier)
    new_id = f"{old_id}-{token}"
    parts = [barrier.key]
    for dep in barrier.dependencies:
        parts.append(dep)
        while isinstance(node := out.get(parts[-1]), Alias):  # a transfer fused with its input
            parts.append(node.target)
    renames[barrier.key] = barrier_key(new_id)
    for part in parts:
        shuffle_ids[part] = (old_id, new_id)
        renames.setdefault(part, renamed_key(part, token))
    return parts


def _renamed_graph(out: Graph, renames: dict[Key, Key], readers: list[Key],
                   shuffle_ids: dict[Key, tuple[str, str]]) -> dict[Key, GraphNode]:
    """``out`` with ``renames`` applied, each key where it was: dask.order breaks ties by the
    order of the graph's keys. A new dict either way (``out`` has the holes of the keys moved
    to the device)."""
    if not renames:
        return dict(out)
    renamed = renames.keys()
    changed = {}
    for key in readers:
        node = out[key]
        if key in renames or not renamed.isdisjoint(node.dependencies):
            changed[key] = _renamed_node(key, node, renames)
            if key in shuffle_ids:
                changed[key] = with_shuffle_id(changed[key], *shuffle_ids[key])
    # (renames.get(key, key) and changed.get(key, node) for every key, mapped in C)
    return dict(zip(map(renames.get, out, out), map(changed.get, out, out.values())))


def _renamed_node(key: Key, node: GraphNode, renames: dict[Key, Key]) -> GraphNode:
    new_key: Key = renames.get(key, key)
    if isinstance(node, Alias):  # (Alias.substitute keeps its key when nothing else changes)
        target: Key = node.target
        return Alias(new_key, renames.get(target, target))
    if type(node) is Task:
        return _renamed_task(node, renames, new_key)
    return substitute_keys(node, renames, new_key)


def _renamed_task(node: Task, renames: dict[Key, Key], key: Key) -> Task:
    """``node.substitute(renames, key=key)`` for a plain ``Task``, made with its dependencies
    known: Dask's reads its constructor's signature on every call (``inspect``), for each task
    and each task nested in one, which made renaming a tenth of a rewrite."""
    deps = node.dependencies
    subs = {d: new for d in deps if (new := renames.get(d, d)) != d}
    if not subs:
        if key == node.key:
            return node
        return new_task(key, node.func, node.args, node.kwargs, deps, node.data_producer)
    args = tuple([_renamed_arg(a, subs) for a in node.args])
    kwargs = {k: _renamed_arg(v, subs) for k, v in node.kwargs.items()}
    return new_task(key, node.func, args, kwargs, frozenset([subs.get(d, d) for d in deps]),
                    node.data_producer)


def _renamed_arg(arg: Any, subs: dict[Key, Key]) -> Any:
    """A task's argument with the keys it reads renamed (``subs``: only those it reads)."""
    if type(arg) is Task:
        return _renamed_task(arg, subs, arg.key)
    if isinstance(arg, GraphNode):
        return substitute_keys(arg, subs)
    if isinstance(arg, TaskRef):  # (a distributed Future is one too)
        return arg.substitute(subs)
    return arg


def _carried(user: dict[str, dict[Key, Any]], renames: dict[Key, Key],
             origin: dict[Key, Key]) -> dict[str, dict[Key, Any]]:
    """The user's annotations, keyed by the final keys: a renamed key keeps its own, a key
    eugo wrote takes those of the key it stands in for."""
    carried: dict[str, dict[Key, Any]] = {}
    for kind, values in user.items():
        by_key = {renames.get(k, k): v for k, v in values.items()}
        for written, source in origin.items():
            if source in values:
                by_key[written] = values[source]
        carried[kind] = by_key
    return carried
