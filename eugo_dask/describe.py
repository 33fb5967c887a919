"""What each task of a graph is and costs: its operations, the chunks they see, estimates.

:func:`describe_graph` walks a graph (after :mod:`eugo_dask.unfuse`) in dependency order. For
every task eugo can reason about it follows the chunks through the task's operations (a fused
task runs several: :mod:`eugo_dask.shapes` says what each one returns and, for contractions and
FFTs, how much work it is), takes the output chunk's spec from that or from the collection's chunk
annotations, and asks the cost model for an :class:`~eugo_dask.cost_model.Estimate`. Work is
shared across the chunks of a layer (same functions and shapes: same estimate). With a
:class:`~eugo_dask.history.RuntimeHistory`, observed durations replace the profile's estimates.

Nothing here decides where a task runs: that is :mod:`eugo_dask.plan`'s job.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
from dask._task_spec import Alias, DataNode, GraphNode, List, Task, TaskRef, _identity_cast

from eugo_dask.cost_model import Estimate, Op, Step, estimate_task
from eugo_dask.graph import (
    FUSED_DEPS,
    FUSED_FUNC,
    FUSED_INKEYS,
    FUSED_INNER,
    FUSED_OUTKEY,
    ArraySpec,
    ChunkInfo,
    Fused,
    Graph,
    Key,
    alias_targets,
    dependency_order,
    execution_order,
    fused,
    is_fused,
    key_name,
)
from eugo_dask.history import RuntimeHistory
from eugo_dask.ops import CPU, CREATION, DATA, GPU, IO, Family, classify_node
from eugo_dask.profile import Profile
from eugo_dask.runtime import is_eugo_callable
from eugo_dask.shapes import UNKNOWN_ARRAY, infer_step

#: What a name in a task resolves to while its operations are followed: a chunk's spec, an
#: array of unknown shape, or a literal value (an index, an array-like being read).
Value = Any


def _resolve(arg: Any, env: Mapping[Key, Value]) -> Value:
    """A task argument as the shape rules see it."""
    if type(arg) in _AS_IS:
        return arg
    if type(arg) is TaskRef:
        return env.get(arg.key, UNKNOWN_ARRAY)
    if isinstance(arg, Alias):  # a reference to another task's result, as an argument
        return env.get(arg.target, UNKNOWN_ARRAY)
    if isinstance(arg, DataNode):
        return _literal(arg.value)
    if isinstance(arg, List) or (type(arg) is Task and arg.func is _identity_cast
                                 and arg.kwargs.get("typ") is list):
        # (a tree reduction's ``_chunk_sum(_identity_cast(Alias(k1), Alias(k2), typ=list))``
        # hands its function a list of the partial results, as a List does)
        return [_resolve(a, env) for a in arg.args]
    if isinstance(arg, GraphNode):  # a task nested in an argument: not followed
        return UNKNOWN_ARRAY
    return _literal(arg)


#: Types of argument that are neither graph nodes nor arrays: the shape rules see them as
#: they are (the common literals, looked up at once).
_AS_IS = frozenset({str, int, float, bool, type(None), tuple, slice, type})


def _literal(value: Any) -> Value:
    if isinstance(value, np.ndarray):
        return ArraySpec(value.shape, value.dtype)
    return value


class _Structure:
    """A fused task's inner graph in execution order with the names its task gives inputs and
    output, shared by every chunk of a blockwise-fused layer (they share one inner graph), and
    what stands for it in a follow key: its shape's number (see :func:`_shape`), or the inner
    graph's identity where it has none."""

    __slots__ = ("nodes", "inkeys", "outkey", "follow_id")

    def __init__(self, parts: Fused, shapes: dict[tuple[Any, ...], tuple[str, int]]) -> None:
        self.inkeys: tuple[Key, ...] = parts.inkeys
        self.outkey: Key = parts.outkey
        self.nodes: list[tuple[Key, GraphNode]] = [(n.key, n) for n in execution_order(parts.inner)]
        shape = _shape(self.nodes, parts.inkeys, parts.outkey)
        # one small key per shape: the follow key is looked up once per task
        self.follow_id: Any = (id(parts.inner) if shape is None
                               else shapes.setdefault(shape, ("shape", len(shapes))))


class _NoShape(Exception):
    pass


def _shape(nodes: list[tuple[Key, GraphNode]], inkeys: tuple[Key, ...], outkey: Key
           ) -> tuple[Any, ...] | None:
    """Everything following a fused task's inner graph (:func:`_follow`) depends on besides
    its inputs, with the graph's own names replaced by positions: its nodes in execution order,
    each one's function, literals and references. Linear fusion gives every chunk an inner graph
    of its own (``sum(_identity_cast(Alias(k)))`` per chunk): chunks whose graphs have one shape
    are followed once. None where a node holds something it cannot write down."""
    names: dict[Key, Any] = {k: ("in", i) for i, k in enumerate(inkeys)}
    shape: list[tuple[Any, ...]] = []
    try:
        for position, (key, node) in enumerate(nodes):
            if isinstance(node, DataNode):
                shape.append(("data", *_literal_shape(node.value)))
            elif type(node) is Task:
                shape.append(_task_shape(node, names))
            elif isinstance(node, Alias):
                shape.append(("alias", names[node.target]))
            else:
                shape.append(("other", type(node)))
            names[key] = position
        return (tuple(shape), names[outkey])
    except (_NoShape, KeyError):  # (KeyError: a reference to a name the graph does not hold)
        return None


def _task_shape(node: Task, names: dict[Key, Any]) -> tuple[Any, ...]:
    return (id(node.func), tuple([_arg_shape(a, names) for a in node.args]),
            tuple([(k, _arg_shape(v, names)) for k, v in node.kwargs.items()]))


def _arg_shape(arg: Any, names: dict[Key, Any]) -> Any:
    """What :func:`_resolve` makes of ``arg``, positions for names."""
    kind = type(arg)
    if kind is TaskRef:
        return ("ref", names[arg.key])
    # (the common types first, each given what the checks below give it)
    if kind in _PLAIN_LITERALS or kind in _RANDOM_STATE_TYPES:
        return ("value", kind, _freeze(arg))
    if kind is DataNode:
        return ("data", *_literal_shape(arg.value))
    if kind is dict and not any(isinstance(v, GraphNode) for v in arg.values()):
        return ("value", kind, _freeze(arg))
    if isinstance(arg, Alias):
        return ("ref", names[arg.target])
    if isinstance(arg, DataNode):
        return ("data", *_literal_shape(arg.value))
    if isinstance(arg, List):
        return ("list", tuple([_arg_shape(a, names) for a in arg.args]))
    if type(arg) is Task:  # nested (the shape rules do not follow it; its function counts)
        return ("task", _task_shape(arg, names))
    if isinstance(arg, GraphNode):
        raise _NoShape
    if isinstance(arg, dict) and any(isinstance(v, GraphNode) for v in arg.values()):
        # a nested fused task's inner graph: shared, or not the same
        return ("id", id(arg))
    return ("value", *_literal_shape(arg))


#: Argument types no check of :func:`_arg_shape` catches and :func:`_literal` leaves as they are:
#: frozen at once (a fused chunk task's signature is taken once per task).
_PLAIN_LITERALS = frozenset({str, int, float, bool, type(None), tuple, list, type})


def _chain_class(inner: dict[Key, GraphNode], inkeys: tuple[Key, ...], outkey: Key,
                 chunks: ChunkInfo) -> tuple[Any, ...] | None:
    """What a linearly fused task's chain is, in terms that chunks of the same layers share:
    for each node in order, a creation (a chunk made from nothing the task reads: its
    function, layer and annotated chunk) or a blockwise-fused node (its inner graph, which
    every chunk of its layer shares, its own names, and which earlier node or input of the
    task each of its arguments is); and the output's annotated chunk. None where a node is
    anything else (followed as a graph of its own, by :func:`_shape`).

    Linear fusion gives every chunk an inner graph of its own (``random -> (x + 1) * 2``: a
    creation, then the chunk's blockwise task): writing its shape down (:func:`_shape`) was
    most of describing such a graph. Chunks whose chains have one class have one shape:
    a blockwise node's arguments are references alone, and a creation's result is its
    annotated chunk (:func:`_creations_as_annotated` checks it on the first chunk of each
    class), which is all that following it depends on."""
    position: dict[Key, int] = {}
    nodes: list[tuple[Any, ...]] = []
    for i, (key, node) in enumerate(inner.items()):
        if type(node) is not Task:
            return None
        args = node.args
        if node.func is FUSED_FUNC:
            refs: list[Any] = []
            for d in args[FUSED_DEPS:]:
                if type(d) is DataNode:  # a literal of the layer's (the same object in each
                    refs.append(("data", id(d.value)))  # chunk: alive as long as the graph)
                    continue
                if type(d) is not TaskRef:
                    return None
                at = position.get(d.key)
                if at is None:
                    if d.key not in inkeys:
                        return None
                    refs.append(("in", inkeys.index(d.key)))
                else:
                    refs.append(at)
            nodes.append((id(args[FUSED_INNER]), args[FUSED_OUTKEY], args[FUSED_INKEYS],
                          tuple(refs)))
        elif (not node.dependencies and type(key) is tuple
              and classify_node(node)[0] == CREATION):
            spec = chunks.spec(key)
            if spec is None:
                return None
            nodes.append((id(node.func), key[0], id(spec)))
        else:
            return None
        position[key] = i
    out = position.get(outkey)
    if out is None:
        return None
    return (tuple(nodes), out, len(inkeys), id(chunks.spec(outkey)))


def _creations_as_annotated(inner: dict[Key, GraphNode], chunks: ChunkInfo) -> bool:
    """Whether the creations of a chain (see :func:`_chain_class`) make the chunks their layers
    are annotated with, as the shape rules read their arguments."""
    for key, node in inner.items():
        if type(node) is Task and node.func is not FUSED_FUNC:
            family, name = classify_node(node)
            args = [_resolve(a, {}) for a in node.args]
            kwargs = {k: _resolve(v, {}) for k, v in node.kwargs.items()}
            made = infer_step(family, name, node.func, args, kwargs).out
            if made != chunks.spec(key):
                return False
    return True


def _literal_shape(value: Any) -> tuple[Any, Any]:
    return type(value), _freeze(_literal(value))


def _follow(nodes: list[tuple[Key, GraphNode]], env: dict[Key, Value],
            steps: list[Step], embedded: list[ArraySpec], hosted: list[str]) -> None:
    """Work out what every node returns, in order, recording a step per operation, and in
    ``hosted`` the name of each creation that reads values of the task (see
    :func:`_hosted_creation`)."""
    for key, node in nodes:
        if isinstance(node, DataNode):
            value = _literal(node.value)
            env[key] = value
            if isinstance(node.value, np.ndarray):
                embedded.append(value)
                steps.append(Step(Op(DATA, "array"), (), value, None))
            continue
        parts = fused(node)
        if parts is not None:  # fused inside a fused task
            inner_env = {p: _resolve(d, env) for p, d in zip(parts.inkeys, parts.deps)}
            _follow([(n.key, n) for n in execution_order(parts.inner)], inner_env, steps,
                    embedded, hosted)
            env[key] = inner_env.get(parts.outkey, UNKNOWN_ARRAY)
            continue
        if isinstance(node, Alias):
            env[key] = env.get(node.target, UNKNOWN_ARRAY)
            continue
        if type(node) is not Task:
            env[key] = UNKNOWN_ARRAY
            continue
        family, name = classify_node(node)
        args = [_resolve(a, env) for a in node.args]
        kwargs = {k: _resolve(v, env) for k, v in node.kwargs.items()}
        inferred = infer_step(family, name, node.func, args, kwargs)
        out = inferred.out if isinstance(inferred.out, ArraySpec) else None  # not a tuple
        steps.append(_step(family, name, _arrays_in(args), out, inferred.flops))
        env[key] = inferred.out if inferred.out is not None else UNKNOWN_ARRAY
        if family == CREATION:
            if any(_is_array(env.get(d, UNKNOWN_ARRAY)) for d in node.dependencies):
                hosted.append(name)
            elif out is not None:
                # made on the host inside a GPU task, then copied: priced as an embedded chunk
                embedded.append(out)


def _is_array(value: Value) -> bool:
    return isinstance(value, ArraySpec) or value is UNKNOWN_ARRAY


def _hosted_creation(name: str) -> str:
    """Why a task that creates a chunk from values of its own stays on the CPU. A creation
    runs on the host so that its results are plain Dask's (NumPy's random streams, not
    CuPy's); inside a GPU task, what it reads (``lam`` of ``rng.poisson(lam)``: an input, or
    work before it in the task) is on the device, and NumPy refuses device arrays. The
    creation stays on the host, and the task with it."""
    return (f"creation ({name}) reads arrays of its task and runs on the host so results "
            "match plain Dask: the task stays on the CPU")


def _arrays_in(args: list[Value]) -> tuple[ArraySpec, ...]:
    """The arrays among an operation's arguments (as resolved): the inputs of its step."""
    return tuple([a for a in _flat(args) if isinstance(a, ArraySpec)])


def _step(family: Family, name: str, ins: tuple[ArraySpec, ...], out: ArraySpec | None,
          flops: float | None) -> Step:
    return Step(Op(family, name, max(1, len(ins))), ins, out, flops)


def _flat(values: list[Value]) -> list[Value]:
    out: list[Value] = []
    for v in values:
        if isinstance(v, list):
            out.extend(_flat(v))
        else:
            out.append(v)
    return out


_HASHABLE_AS_IS = frozenset({ArraySpec, str, type(None)})
#: Numbers: kept with their type (see :func:`_freeze`).
_NUMBERS = frozenset({int, float, bool, complex})
#: Random state a creation task draws from (a chunk's own seed): the chunk's shape, dtype and
#: cost do not depend on it.
_RANDOM_STATE = (np.random.SeedSequence, np.random.BitGenerator, np.random.Generator,
                 np.random.RandomState)
#: The common ones by exact type, looked up before the other checks (a seed per chunk task).
_RANDOM_STATE_TYPES = frozenset({np.random.SeedSequence, np.random.Generator,
                                 np.random.RandomState, np.random.PCG64, np.random.PCG64DXSM,
                                 np.random.MT19937, np.random.Philox, np.random.SFC64})


def _freeze(value: Any) -> Any:
    """A hashable stand-in for what a dependency holds (getter indexes are tuples of slices);
    the common cases return at once: this runs for every dependency of every task.

    Values that compare equal across types (``1 == 1.0 == True == np.float32(1)``) give
    results of different dtypes (``x + 1`` against ``x + 1.0``): they keep their type."""
    kind = type(value)
    if kind in _HASHABLE_AS_IS or value is UNKNOWN_ARRAY:
        return value
    if kind in _NUMBERS:
        return (kind, value)
    if kind in _RANDOM_STATE_TYPES:  # (a chunk's seed: what the isinstance check below gives)
        return ("random state", kind)
    if kind is tuple:  # (before the checks that take subclasses: a chunk's size, an index)
        return tuple([_freeze(v) for v in value])
    if kind is type:  # a class (dtype=np.float64): equal only to itself
        return ("class", value)
    if isinstance(value, slice):
        return ("slice", _freeze(value.start), _freeze(value.stop), _freeze(value.step))
    if isinstance(value, tuple):
        return tuple([_freeze(v) for v in value])
    if isinstance(value, list):
        return ("list", *[_freeze(v) for v in value])
    if isinstance(value, dict) and len(value) <= 8:  # keywords passed on as one argument
        return ("dict", *[(k, _freeze(v)) for k, v in value.items()])
    if isinstance(value, _RANDOM_STATE):
        return ("random state", type(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return (type(value), value)


def _learned(estimate: Estimate, history: RuntimeHistory) -> Estimate:
    """``estimate`` with observed medians in place of the profile's numbers, where known."""
    nbytes = estimate.in_bytes + estimate.out_bytes
    cpu = history.estimate(estimate.family, CPU, nbytes)
    gpu = history.estimate(estimate.family, GPU, nbytes) if estimate.gpu_capable else None
    if cpu is None and gpu is None:
        return estimate
    return replace(
        estimate,
        cpu_s=cpu if cpu is not None else estimate.cpu_s,
        gpu_s=gpu if gpu is not None else estimate.gpu_s,
        cpu_model_s=estimate.cpu_s if cpu is not None else None,
        gpu_model_s=estimate.gpu_s if gpu is not None else None,
    )


class _Followed(NamedTuple):
    """What following a task's operations gave: a step per operation, the chunks made on the
    host inside it (embedded, created), what it hands on, and the first creation that reads
    values of the task (None where none does)."""

    steps: tuple[Step, ...]
    embedded: tuple[ArraySpec, ...]
    value: Value
    hosted: str | None


class TaskDescriber:
    """Estimates tasks and infers their output chunks, reusing work across the chunks of a
    layer (same functions, same shapes: same estimate).

    With ``share=False`` nothing is reused: every task is followed and estimated on its own,
    the description per-task planning gives, which the shared one must equal (the tests compare
    them)."""

    def __init__(self, chunks: ChunkInfo, profile: Profile,
                 history: RuntimeHistory | None = None, *, share: bool = True) -> None:
        self.chunks, self.profile, self.history = chunks, profile, history
        self.share = share
        self._forget()

    def _forget(self) -> None:
        """Empty the caches that carry one task's work over to the next."""
        self._structures: dict[tuple[int, tuple[Key, ...], Key], _Structure] = {}
        self._chains: dict[tuple[Any, ...], _Structure | None] = {}
        self._shapes: dict[tuple[Any, ...], tuple[str, int]] = {}
        self._followed: dict[tuple[Any, ...], _Followed] = {}
        self._estimates: dict[tuple[Any, ...], Estimate] = {}
        self._results: dict[tuple[Any, ...], tuple[Estimate, ArraySpec | None, Value]] = {}
        self._read_steps: dict[tuple[tuple[Family, str], tuple[ArraySpec, ...]],
                               tuple[Step, ...]] = {}

    def _structure(self, parts: Fused) -> _Structure:
        # Chunks of one blockwise layer share their inner graph: order it once. The graph keeps
        # these objects alive while we plan, so ids are not reused. (The names of its inputs
        # and its output belong to the task: one inner graph could serve two tasks that name
        # them differently.) Linear fusion gives each chunk an inner graph of its own: chunks
        # whose chains are of one class (:meth:`chain_structure`) share one structure.
        chain = self.chain_structure(parts.inner, parts.inkeys, parts.outkey)
        if chain is not None:
            return chain
        which = (id(parts.inner), parts.inkeys, parts.outkey)
        cached = self._structures.get(which)
        if cached is None:
            cached = self._structures[which] = _Structure(parts, self._shapes)
        return cached

    def chain_structure(self, inner: dict[Key, GraphNode], inkeys: tuple[Key, ...],
                        outkey: Key) -> _Structure | None:
        """The structure a linearly fused task shares with the other chunks whose chains are of
        its class (:func:`_chain_class`), made from the first of them; None where the task is
        not such a chain (the structure is then its own)."""
        if not self.share:
            return None
        which = _chain_class(inner, inkeys, outkey, self.chunks)
        if which is None:
            return None
        try:
            return self._chains[which]
        except KeyError:
            structure = None
            if _creations_as_annotated(inner, self.chunks):
                parts = Fused(inner, outkey, inkeys, ())
                structure = _Structure(parts, self._shapes)
            self._chains[which] = structure
            return structure

    def describe(self, key: Key, node: Task, deps: frozenset[Key], values: Mapping[Key, Value]
                 ) -> tuple[Estimate, ArraySpec | None, Value, bool]:
        """Estimate one task and infer its output chunk's spec. ``deps``: the keys it reads;
        ``values``: what each key described so far holds (a chunk's spec,
        :data:`~eugo_dask.shapes.UNKNOWN_ARRAY`, or a literal such as an array-like a read takes
        its chunk from; an alias holds its target's). Returns the estimate, the output spec and
        what the task hands on (its spec, or a tuple of them), and whether every chunk of the
        layer with the same inputs gets the same answer.

        Chunks of one layer with the same inputs get the same answer: it is worked out once
        (the pass runs this for every task of graphs a million tasks large), and the lookup
        reads ``values`` directly rather than building a dict of the task's inputs first."""
        if not self.share:
            self._forget()
        parts = fused(node)
        structure = None
        if parts is not None:
            env_values = [values.get(d.key, UNKNOWN_ARRAY) if type(d) is TaskRef
                          else _resolve(d, values) for d in parts.deps]
            structure = self._structure(parts)
            follow_key: tuple[Any, ...] = (structure.follow_id, *map(_freeze, env_values))
            layer = parts.outkey[0] if type(parts.outkey) is tuple else key_name(key)
        elif (op := classify_node(node))[0] == IO:
            # A read: no shape rule follows it (its chunk is the annotation's), so its step
            # depends on its function and the arrays among its arguments alone, not on the
            # indexes that differ from chunk to chunk (nothing to share by those)
            return (*self._read(key, node, op, deps, values), False)
        else:  # one function: its own arguments are all there is to follow
            follow_key = (id(node.func), *[_freeze(_resolve(a, values)) for a in node.args])
            if node.kwargs:
                follow_key += tuple([(k, _freeze(_resolve(v, values)))
                                     for k, v in node.kwargs.items()])
            layer = key_name(key)
        result_key = (follow_key, layer, _held(deps, values))
        result = self._results.get(result_key)
        if result is not None:
            return (*result, True)
        inputs = {d: values.get(d, UNKNOWN_ARRAY) for d in deps}
        followed = self._followed.get(follow_key)
        if followed is None:
            steps: list[Step] = []
            embedded: list[ArraySpec] = []
            hosted: list[str] = []
            if structure is not None:
                env = dict(zip(structure.inkeys, env_values))
                _follow(structure.nodes, env, steps, embedded, hosted)
                value = env.get(structure.outkey)
            else:
                env = dict(inputs)
                _follow([(key, node)], env, steps, embedded, hosted)
                value = env.get(key)
            followed = self._followed[follow_key] = _Followed(
                tuple(steps), tuple(embedded), value, hosted[0] if hosted else None)
        result = self._estimated(key, parts, inputs, *followed)
        # where the result follows from the inputs (the annotation only confirms the dtype),
        # it is the same for every chunk of the layer with these inputs
        shared = isinstance(followed.value, ArraySpec)
        if shared:
            self._results[result_key] = result
        return (*result, shared)

    def _read(self, key: Key, node: Task, op: tuple[Family, str], deps: frozenset[Key],
              values: Mapping[Key, Value]) -> tuple[Estimate, ArraySpec | None, Value]:
        """:meth:`describe` of a task of the IO family (``op``: its family and name): what
        following it would give (one step, the arrays it reads, an unknown result) without
        following it."""
        ins = _arrays_in([_resolve(a, values) for a in node.args])
        steps = self._read_steps.get((op, ins))
        if steps is None:  # (one per read function and arrays read: the estimates' cache key)
            steps = self._read_steps[(op, ins)] = (_step(*op, ins, None, None),)
        inputs = {d: values.get(d, UNKNOWN_ARRAY) for d in deps}
        return self._estimated(key, None, inputs, steps, (), UNKNOWN_ARRAY)

    def _estimated(self, key: Key, parts: Fused | None, inputs: dict[Key, Value],
                   steps_t: tuple[Step, ...], embedded_t: tuple[ArraySpec, ...],
                   inferred: Value, hosted: str | None = None
                   ) -> tuple[Estimate, ArraySpec | None, Value]:
        """The estimate, the output spec and what the task hands on, from what following its
        operations gave (a :class:`_Followed`'s fields)."""
        out = self._output_spec(key, parts, inferred)
        known = [v for v in inputs.values() if isinstance(v, ArraySpec)]
        unknown_input = any(v is UNKNOWN_ARRAY for v in inputs.values())
        arrays = tuple(known) + embedded_t
        special = self.chunks.special_chunk_type(
            parts.outkey if parts is not None and type(parts.outkey) is tuple else key)
        cache_key = (steps_t, arrays, out, unknown_input, special, hosted)
        estimate = self._estimates.get(cache_key)
        if estimate is None:
            estimate = estimate_task(list(steps_t), list(arrays), out, self.profile)
            if hosted is not None and estimate.gpu_capable:
                estimate = replace(estimate, gpu_capable=False, gpu_s=math.inf,
                                   why_cpu=_hosted_creation(hosted))
            if unknown_input and estimate.gpu_capable:
                estimate = replace(estimate, gpu_capable=False, gpu_s=math.inf,
                                   why_cpu="an input chunk's size is unknown")
            if special is not None and estimate.gpu_capable:
                estimate = replace(estimate, gpu_capable=False, gpu_s=math.inf,
                                   why_cpu=f"chunks of type {special} stay on the host")
            if self.history is not None:
                estimate = _learned(estimate, self.history)
            self._estimates[cache_key] = estimate
        return (estimate, out, out if out is not None else inferred)

    def _output_spec(self, key: Key, parts: Fused | None, inferred: Value) -> ArraySpec | None:
        """The task's result: the collection's annotation where it agrees with what the
        operations give (it knows the dtype for sure), what they give where it does not (Dask
        annotates a reduction's chunk step with its input's chunks), either where alone."""
        annotated = None
        if parts is not None and type(parts.outkey) is tuple:
            # blockwise fusion keeps the output layer's name; linear fusion renames the key
            annotated = self.chunks.spec(parts.outkey)
        annotated = annotated or self.chunks.spec(key)
        if not isinstance(inferred, ArraySpec):
            return annotated
        if annotated is not None and annotated.shape == inferred.shape:
            return annotated
        return inferred


@dataclass
class GraphDescription:
    """What :func:`describe_graph` found:

    - ``order``: every key, each after its dependencies; ``targets``: each alias's final target;
    - ``values``: what each key holds as the shape rules see it (a chunk's spec,
      :data:`~eugo_dask.shapes.UNKNOWN_ARRAY`, or a literal such as an array-like a read takes
      its chunk from);
    - the tasks eugo can reason about, in dependency order: ``task_keys``, and key for key with
      them ``task_estimates``, ``inputs`` (the distinct keys each task reads, aliases resolved),
      ``task_specs`` (its output spec) and ``task_nodes`` (its node): the placement and the
      rewrite walk them side by side rather than look each task up (lists: a table of a million
      keys is no small thing to grow); :attr:`estimates` looks a task's estimate up by key;
    - ``undescribed``: the other keys with their nodes (chunks, aliases, tasks eugo wrote).
    """

    order: list[Key]
    targets: dict[Key, Key]
    values: dict[Key, Value]
    task_keys: list[Key]
    task_estimates: list[Estimate]
    inputs: list[frozenset[Key]]
    task_specs: list[ArraySpec | None]
    task_nodes: list[Task]
    undescribed: list[tuple[Key, GraphNode]]

    def resolve(self, key: Key) -> Key:
        """The key an alias finally stands for (the key itself for anything else)."""
        return self.targets.get(key, key)

    def spec(self, key: Key) -> ArraySpec | None:
        """The chunk ``key`` holds, where its shape and dtype are known."""
        value = self.values.get(key)
        return value if isinstance(value, ArraySpec) else None

    @functools.cached_property
    def estimates(self) -> dict[Key, Estimate]:
        """Each described task's estimate, by key."""
        return dict(zip(self.task_keys, self.task_estimates, strict=True))

    @property
    def specs(self) -> dict[Key, ArraySpec | None]:
        """:meth:`spec` of every key."""
        return {k: self.spec(k) for k in self.order}


_NESTED, _WHOLE = object(), object()  # markers in the keys _same_inputs makes


def _held(deps: frozenset[Key], values: Mapping[Key, Value]) -> tuple[int, ...]:
    """What a task's distinct inputs hold (by identity, in no order), for the keys under which
    chunks share a description: a task is priced on the chunks it reads once each, which its
    arguments alone do not tell (``x @ x.T``'s diagonal chunks read one chunk twice, the others
    two chunks of one shape)."""
    if not deps:
        return ()
    return tuple(sorted([id(values.get(d, UNKNOWN_ARRAY)) for d in deps]))


def _same_inputs(key: Key, node: Task, deps: frozenset[Key], values: Mapping[Key, Value],
                 chunks: ChunkInfo, describer: TaskDescriber) -> tuple[Any, ...] | None:
    """The identity key under which ``describe_graph`` shares a task's description with the
    chunks of its layer: its function (a fused task's inner graph) and layer, and the very
    objects its arguments are (a dependency's: what ``values`` holds for it, a key from outside
    the graph being an unknown array; a wrapped literal's: its value, which chunks share where
    each has its own ``DataNode``). None for a task with keyword arguments.

    A task nesting another one (a tree reduction's ``_chunk_sum(_identity_cast(Alias(k1),
    Alias(k2)))``) is described from its inputs and its own chunk's annotation, not from its
    arguments alone: those go into the key too, which then holds everything the description
    depends on (it ends with ``_WHOLE``)."""
    args = node.args
    if node.func is FUSED_FUNC:
        outkey = args[FUSED_OUTKEY]
        # a linear chain's inner graph is its own: the class of chain stands for it
        chain = (describer.chain_structure(args[FUSED_INNER], args[FUSED_INKEYS], outkey)
                 if type(outkey) is tuple else None)
        return (id(chain) if chain is not None else id(args[FUSED_INNER]),
                id(args[FUSED_INKEYS]) if chain is None else None,
                outkey[0] if type(outkey) is tuple else key_name(key), _held(deps, values),
                *[id(values.get(d.key, UNKNOWN_ARRAY)) if type(d) is TaskRef
                  else id(d.value) if type(d) is DataNode else id(d)
                  for d in args[FUSED_DEPS:]])
    if node.kwargs:
        return None
    same: list[Any] = [id(node.func), key_name(key), _held(deps, values)]
    nested = False
    for a in args:
        if type(a) is TaskRef:
            same.append(id(values.get(a.key, UNKNOWN_ARRAY)))
        elif type(a) is Task:  # (the shape rules do not follow it)
            same.append(_NESTED)
            nested = True
        elif type(a) is DataNode:  # a literal wrapped per chunk: the value is what counts
            same.append(id(a.value))
        else:
            same.append(id(a))
    if nested:  # (what its inputs hold is in the key already)
        same.append(id(chunks.spec(key)))
        same.append(_WHOLE)
    return tuple(same)


def describe_graph(dsk: Graph, chunks: ChunkInfo, profile: Profile,
                   history: RuntimeHistory | None = None, *, share: bool = True
                   ) -> GraphDescription:
    """Describe every task of ``dsk`` (task-spec nodes, after Dask's optimization), inputs'
    specs feeding outputs'. ``share=False``: each task described on its own (see
    :class:`TaskDescriber`), for the tests that hold the shared description to it."""
    targets = alias_targets(dsk)
    resolve = targets.get  # an alias's final target, in one dict access on the hot path
    ordered = dependency_order(dsk)
    order = [k for k, _ in ordered]
    aliases = frozenset(targets)
    describer = TaskDescriber(chunks, profile, history, share=share)
    values: dict[Key, Value] = {}  # what a task's dependencies hold, as the shape rules see it
    task_keys: list[Key] = []
    task_estimates: list[Estimate] = []
    task_specs: list[ArraySpec | None] = []
    task_nodes: list[Task] = []
    inputs: list[frozenset[Key]] = []
    undescribed: list[tuple[Key, GraphNode]] = []
    # Once per task of graphs a million tasks large: chunk tasks (the common case) first, and
    # an alias's own entry in ``values`` holds its target's, so a task's inputs are read from
    # ``values`` by the keys the task names, aliases or not.
    ours: dict[int, bool] = {}  # id(func) -> whether eugo put it there (the graph keeps it alive)
    # The describer's answers for a layer's chunks with the same inputs, looked up first by
    # identity: the function (or fused inner graph) and the very objects the task reads (a
    # layer's chunks of one shape share one spec object, and everything compared is kept alive
    # by the graph or by ``values`` until the walk ends), without hashing what they hold.
    shared: dict[tuple[Any, ...], tuple[Estimate, ArraySpec | None, Value]] = {}
    for k, node in ordered:
        if type(node) is Task:
            func = node.func
            written = ours.get(id(func))
            if written is None:
                written = ours[id(func)] = not is_fused(node) and is_eugo_callable(func)
            if written:
                values[k] = UNKNOWN_ARRAY
                undescribed.append((k, node))
                continue
            deps = node.dependencies
            # what a task reading an alias reads is the alias's target (two sets compared by
            # the hashes they hold: a tuple key's hash is not kept, computing it costs)
            inputs.append(frozenset([resolve(d, d) for d in deps])
                          if aliases and not aliases.isdisjoint(deps) else deps)
            same = _same_inputs(k, node, deps, values, chunks, describer) if share else None
            answer = shared.get(same) if same is not None else None
            if answer is None:
                estimate, spec, handed_on, cacheable = describer.describe(k, node, deps, values)
                answer = (estimate, spec, handed_on)
                if same is not None and (cacheable or same[-1] is _WHOLE):
                    shared[same] = answer
            estimate, spec, handed_on = answer
            task_keys.append(k)
            task_estimates.append(estimate)
            task_specs.append(spec)
            task_nodes.append(node)
            # (its spec where known: where the spec is None, what it hands on is no spec)
            values[k] = UNKNOWN_ARRAY if handed_on is None else handed_on
        else:
            undescribed.append((k, node))
            if isinstance(node, DataNode):
                values[k] = _literal(node.value)  # a chunk, or an array-like to read from
            elif isinstance(node, Alias):
                values[k] = values.get(resolve(k, k), UNKNOWN_ARRAY)
            else:
                values[k] = UNKNOWN_ARRAY
    return GraphDescription(order, targets, values, task_keys, task_estimates, inputs, task_specs,
                            task_nodes, undescribed)


__all__ = ["GraphDescription", "TaskDescriber", "describe_graph"]
