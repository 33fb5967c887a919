"""Pure estimates: what a chunk task costs on the CPU, on the GPU, and to move.

Given a task's op family (from its function), the shapes and dtypes of its inputs and output and
a :class:`~eugo_dask.profile.Profile`, :func:`estimate_task` returns FLOPs, bytes and estimated
seconds per device. Transfers are priced by :func:`estimate_h2d_seconds` and
:func:`estimate_d2h_seconds`, per size where the profile has per-size copy rates. Nothing here
imports CuPy or distributed, and nothing decides: placement is the planner's job.

The model, per op family (``n`` elements, ``b`` bytes, rates from the profile):

- elementwise ufuncs: ``max(traffic / bandwidth, n * weight / flop_rate)`` per ufunc, where
  ``weight`` is the ufunc's cost in flop-equivalents per element (:data:`UFUNC_WEIGHTS`: add is 1,
  divide 4, exp/log/sin 20, power 40); fused chains add their ops up, each with its temporaries;
- matmul/tensordot/dot/einsum: ``2 * sqrt(|A| |B| |C|)`` FLOPs at the BLAS/cuBLAS rate, scaled by
  an efficiency ramp for small matrices;
- FFT: ``5 n log2 n`` FLOPs (half for real input), plus cuFFT plan creation on the GPU;
- reductions (chunk step): one pass over the input; aggregation of partials never offloads;
- creation (random, ones, arange), I/O getters, ``map_blocks`` of unknown functions: CPU only;
- data movement (getitem, concatenate, rechunk, transpose): bytes copied;
- fixed costs: per-task Python dispatch on the CPU; CuPy call and kernel launch per op on the GPU;
  link latency per transfer.

CPU seconds are per task as Dask runs it: one worker thread, except matmul whose BLAS uses all
cores. The planner divides per-thread estimates by the number of chunks that can run side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from eugo_dask.graph import ArraySpec
from eugo_dask.ops import (
    AGGREGATE,
    CREATION,
    DATA,
    DEFAULT_UFUNC_WEIGHT,
    ELEMENTWISE,
    FAMILY_RANK,
    FFT,
    GPU_FAMILIES,
    IO,
    MATMUL,
    MOVEMENT,
    REDUCTION,
    SOURCE_FAMILIES,
    UFUNC_WEIGHTS,
    UNKNOWN,
    Family,
    device_dtype_ok,
)
from eugo_dask.profile import Profile

# Efficiency factors applied to a spec-sheet profile's peaks (kernels reach less); a calibrated
# profile's figures are achieved rates (``gpu.measured``) and get none.
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_FLOPS_EFFICIENCY = 0.5
GPU_MATMUL_EFFICIENCY = 0.8
GPU_FFT_FLOPS_EFFICIENCY = 0.3
# Matrix size at which matmul reaches half its peak rate (n = cube root of m*n*k).
CPU_MATMUL_HALF_N = 32
GPU_MATMUL_HALF_N = 256
# Per NumPy call inside a task (Python overhead beyond the task's dispatch).
CPU_CALL_S = 1e-6

# ---------------------------------------------------------------------------------------------
# Estimates
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One operation inside a task (a fused task has several)."""

    family: Family
    name: str
    n_inputs: int = 1


@dataclass(frozen=True)
class Estimate:
    """What one task costs. ``gpu_s`` is compute only; transfers are priced separately.
    ``family`` names the heaviest kind of work in the task."""

    family: Family
    detail: str
    flops: float
    in_bytes: int
    out_bytes: int
    cpu_s: float
    gpu_s: float
    cpu_parallel: bool
    gpu_capable: bool
    why_cpu: str | None
    #: the profile's estimates, where observed durations (eugo.learn) replaced cpu_s / gpu_s
    cpu_model_s: float | None = None
    gpu_model_s: float | None = None
    #: seconds of work that runs on the host wherever the task is placed (a creation fused into
    #: it: on the GPU it still makes its chunk on the host), counted in cpu_s and gpu_s both
    host_s: float = 0.0


def _efficiency(profile: Profile, factor: float) -> float:
    return 1.0 if profile.gpu.measured else factor


def _gpu_bw(profile: Profile) -> float:
    return profile.gpu.memory_bandwidth_bytes_per_s * _efficiency(profile, GPU_BANDWIDTH_EFFICIENCY)


def _gpu_fft_rate(profile: Profile, dtype: np.dtype[Any]) -> float:
    gpu = profile.gpu
    if gpu.fft_flops_per_s is not None:  # measured on the device
        return gpu.fft_flops_per_s.for_dtype(dtype)
    return gpu.flops_per_s.for_dtype(dtype) * GPU_FFT_FLOPS_EFFICIENCY


def _gpu_call_s(profile: Profile) -> float:
    return profile.gpu.call_overhead_s + profile.gpu.kernel_launch_s


def _contracted_size(a: ArraySpec, b: ArraySpec) -> int:
    """Length of the axis two matmul operands share, guessed from their shapes (only where the
    operation itself could not be read: :mod:`eugo_dask.shapes` reads it from the task)."""
    if len(a.shape) >= 2 and len(b.shape) >= 2:
        for i, j in ((-1, -2), (-1, -1), (-2, -2)):
            if a.shape[i] == b.shape[j]:
                return max(a.shape[i], 1)
    shared = set(a.shape) & set(b.shape)
    return max(max(shared, default=1), 1)


def _guessed_matmul_flops(arrays: list[ArraySpec], out: ArraySpec | None = None) -> float:
    """FLOPs of a contraction of its two largest operands, by shape alone. With one operand
    known and the result, the product of the two: ``(m, k) @ ? -> (m, n)`` is ``2 m n k``;
    with one array alone, a product with a square ``(k, k)``. (An unknown operand is not
    taken for a copy of the known one: ``(m, k)`` times itself is an ``m x m`` product.)"""
    if not arrays:
        return 0.0
    if len(arrays) == 1 and (out is None or arrays == [out]) and len(arrays[0].shape) >= 2:
        # one array known, operand or result, and nothing to say what it meets: the other side
        # taken square on its smaller side, (m, k) @ (k, k) (the guess below took the array for
        # both operands and priced an m x m product, m / k times more)
        (a,) = arrays
        return 2.0 * float(a.size) * min(a.shape[-2:])
    if len(arrays) < 2 and out is not None and len(out.shape) >= 2 and len(arrays[0].shape) >= 2:
        (a,) = arrays
        if a.shape[:-1] == out.shape[:-1]:  # (m, k) @ (k, n)
            return 2.0 * float(out.size) * a.shape[-1]
        if a.shape[-1] == out.shape[-1] and a.shape[:-2] == out.shape[:-2]:  # ? @ (k, n)
            return 2.0 * float(out.size) * a.shape[-2]
    if len(arrays) < 2:
        arrays = arrays * 2
    a, b = sorted(arrays, key=lambda s: s.size)[-2:]
    return 2.0 * float(a.size) * float(b.size) / _contracted_size(a, b)


class Step(NamedTuple):
    """One operation of a task with the chunks it sees: its array operands, its result (None
    where unknown) and, for contractions and FFTs, its FLOPs as read from the operation."""

    op: Op
    ins: tuple[ArraySpec, ...]
    out: ArraySpec | None
    flops: float | None = None


#: What one operation costs: (flops, cpu_s, gpu_s).
StepCost = tuple[float, float, float]


def estimate_step(step: Step, n_fallback: int, dtype_fallback: np.dtype[Any],
                  profile: Profile) -> StepCost:
    """(flops, cpu_s, gpu_s) of one operation, by its op family. Sizes are the operation's own
    where known, else ``n_fallback`` elements of ``dtype_fallback`` (the task's largest array)."""
    out = step.out
    n = out.size if out is not None else n_fallback
    dtype = out.dtype if out is not None and device_dtype_ok(out.dtype) else dtype_fallback
    cost = _STEP_COSTS.get(step.op.family, _host_step)
    return cost(step, n, dtype, n_fallback, profile)


def _elementwise_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
                      profile: Profile) -> StepCost:
    """A ufunc: its weight per element against the FLOP rate, or its memory traffic (or the
    rate calibrated on this CPU for its class)."""
    cpu, gpu, op, out = profile.cpu, profile.gpu, step.op, step.out
    weight = UFUNC_WEIGHTS.get(op.name, DEFAULT_UFUNC_WEIGHT)
    if dtype.kind == "c":
        weight *= 4
    flops = n * weight
    operands = max(len(step.ins), 1)
    if out is not None and step.ins:
        traffic = sum(s.nbytes for s in step.ins) + out.nbytes
    else:
        traffic = (op.n_inputs + 1) * n * dtype.itemsize
    measured = cpu.elementwise_seconds(op.name, dtype, n)
    if measured is not None:  # calibrated on this CPU for the ufunc's class
        cpu_s = n * measured * (4 if dtype.kind == "c" else 1) * (operands + 1) / 3
    else:
        cpu_s = max(traffic / cpu.memory_bandwidth_bytes_per_s,
                    flops / cpu.flops_per_s.for_dtype(dtype))
    gpu_s = max(traffic / _gpu_bw(profile),
                flops / (gpu.flops_per_s.for_dtype(dtype) * _efficiency(profile, GPU_FLOPS_EFFICIENCY)))
    return flops, cpu_s + CPU_CALL_S, gpu_s + _gpu_call_s(profile)


def _matmul_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
                 profile: Profile) -> StepCost:
    """A contraction: its FLOPs (read from the operation, else guessed from its operands'
    shapes) at the BLAS/cuBLAS rate for its effective matrix order."""
    cpu, gpu, out = profile.cpu, profile.gpu, step.out
    flops = step.flops if step.flops is not None else _guessed_matmul_flops(
        list(step.ins) or ([out] if out is not None else []), out)
    if flops <= 0:
        return 0.0, CPU_CALL_S, _gpu_call_s(profile)
    size = (flops / 2) ** (1.0 / 3.0)  # effective matrix order: cube root of m*n*k
    per_flop = cpu.matmul_seconds_per_flop(dtype, size)
    if per_flop is not None:  # calibrated at the chunk sizes that matter
        cpu_rate = 1.0 / per_flop
    else:
        half_n = cpu.matmul_half_n or CPU_MATMUL_HALF_N
        cpu_rate = cpu.matmul_flops_per_s.for_dtype(dtype) * size / (size + half_n)
    gpu_rate = (gpu.matmul_flops_per_s.for_dtype(dtype) * _efficiency(profile, GPU_MATMUL_EFFICIENCY)
                * size / (size + GPU_MATMUL_HALF_N))
    return flops, flops / cpu_rate + CPU_CALL_S, flops / gpu_rate + _gpu_call_s(profile)


def _fft_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
              profile: Profile) -> StepCost:
    """An FFT: ``5 n log2 n`` FLOPs (half for real input), and cuFFT's plan on the GPU."""
    cpu, gpu, op, out = profile.cpu, profile.gpu, step.op, step.out
    item = dtype.itemsize
    source = step.ins[0] if step.ins else out
    points = max(source.size if source is not None else n, 2)
    if step.flops is not None:
        flops = step.flops
    else:
        flops = 5.0 * points * math.log2(points) * (0.5 if op.name.startswith(("r", "ih")) else 1)
    traffic = 2 * points * max(out.dtype.itemsize if out is not None else item, item)
    per_flop = cpu.fft_seconds_per_flop(dtype, points)
    cpu_s = flops * per_flop if per_flop is not None else flops / cpu.fft_flops_per_s.for_dtype(dtype)
    gpu_s = max(flops / _gpu_fft_rate(profile, dtype), 3 * traffic / _gpu_bw(profile))
    return flops, cpu_s + CPU_CALL_S, gpu_s + gpu.fft_plan_s + _gpu_call_s(profile)


def _reduction_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
                    profile: Profile) -> StepCost:
    """A reduction's chunk step: one pass over its input (``n_fallback`` elements where its
    input is not known)."""
    cpu = profile.cpu
    source = step.ins[0] if step.ins else None
    n_in = source.size if source is not None else n_fallback
    in_dtype = source.dtype if source is not None and device_dtype_ok(source.dtype) else dtype
    traffic = n_in * in_dtype.itemsize
    flops = float(n_in)
    per_element = cpu.reduction_seconds(in_dtype, n_in)
    if per_element is not None:  # calibrated on this CPU
        cpu_s = n_in * per_element
    else:
        read_bw = cpu.reduction_bandwidth_bytes_per_s or cpu.memory_bandwidth_bytes_per_s
        cpu_s = max(traffic / read_bw, flops / cpu.flops_per_s.for_dtype(in_dtype))
    return flops, cpu_s + CPU_CALL_S, traffic / _gpu_bw(profile) + _gpu_call_s(profile)


def _movement_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
                   profile: Profile) -> StepCost:
    """Data movement: the bytes it copies (a view copies none)."""
    if step.op.name in _VIEW_NAMES:
        return 0.0, CPU_CALL_S, _gpu_call_s(profile)  # views: no copy
    traffic = 2 * n * dtype.itemsize
    return (0.0, traffic / profile.cpu.memory_bandwidth_bytes_per_s + CPU_CALL_S,
            traffic / _gpu_bw(profile) + _gpu_call_s(profile))


def _data_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
               profile: Profile) -> StepCost:
    """A chunk embedded in the graph: already in host memory."""
    return 0.0, 0.0, 0.0


def _host_step(step: Step, n: int, dtype: np.dtype[Any], n_fallback: int,
               profile: Profile) -> StepCost:
    """Creation, I/O, aggregation and unknown functions, which run on the host: their memory
    traffic (and a random generator's FLOPs). Inside a GPU task a creation source still runs
    on the host (then its chunk is copied); the others cannot run there at all."""
    cpu, op = profile.cpu, step.op
    traffic = sum(s.nbytes for s in step.ins) + n * dtype.itemsize
    flops = 5.0 * n if op.name.startswith("_apply_random") else 0.0
    cpu_s = traffic / cpu.memory_bandwidth_bytes_per_s + flops / cpu.flops_per_s.for_dtype(dtype)
    cpu_s += CPU_CALL_S
    return flops, cpu_s, cpu_s if op.family == CREATION else math.inf


#: How an operation of each op family is priced (the others: :func:`_host_step`).
_STEP_COSTS: dict[Family, Callable[[Step, int, np.dtype[Any], int, Profile], StepCost]] = {
    ELEMENTWISE: _elementwise_step, MATMUL: _matmul_step, FFT: _fft_step,
    REDUCTION: _reduction_step, MOVEMENT: _movement_step, DATA: _data_step,
}


_VIEW_NAMES = frozenset("getitem transpose identity _identity_cast squeeze expand_dims reshape "
                        "moveaxis swapaxes broadcast_to diagonal".split())
_ZERO_D = ("a 0-d result: NumPy hands back a scalar or a 0-d array where CuPy gives a 0-d "
           "device array, and only the CPU path returns exactly what plain Dask does")


def estimate_task(steps: list[Step], inputs: list[ArraySpec], out: ArraySpec | None,
                  profile: Profile) -> Estimate:
    """Estimate a task made of ``steps`` (in execution order) producing ``out``.

    ``inputs`` are the arrays the task reads: its dependencies and any chunk embedded in it or
    created inside it. ``out`` is None where the result's shape is unknown (such tasks stay on
    the CPU).
    """
    steps = steps or [Step(Op(MOVEMENT, "identity"), (), out)]
    ops = [s.op for s in steps]
    main = max(ops, key=lambda o: FAMILY_RANK[o.family])
    in_bytes = sum(s.nbytes for s in inputs)
    cpu_only = [o for o in ops if o.family not in GPU_FAMILIES and o.family not in SOURCE_FAMILIES]
    why_cpu = None
    if cpu_only:
        first = cpu_only[0]
        why_cpu = {
            AGGREGATE: "aggregation of partial results stays on the CPU",
            IO: f"I/O ({first.name}) stays on the CPU",
            CREATION: f"creation ({first.name}) runs on the host so results match plain Dask",
            UNKNOWN: f"unknown function {first.name}: cannot tell that it runs on a device",
        }[first.family]
    elif main.family in SOURCE_FAMILIES:
        why_cpu = f"creation ({main.name}) runs on the host so results match plain Dask"
    if out is None:
        why_cpu = why_cpu or "chunk shape unknown"
        out = ArraySpec((max((s.size for s in inputs), default=0),),
                        inputs[0].dtype if inputs else np.dtype("float64"))
    if why_cpu is None:
        bad = [s.dtype for s in (*inputs, out) if not device_dtype_ok(s.dtype)]
        if bad:
            why_cpu = f"dtype {bad[0]} never offloads"
        elif out.shape == ():
            why_cpu = _ZERO_D
    # where an operation's own sizes are unknown: the largest array the task touches
    n = max([out.size, *(s.size for s in inputs)])
    dtype = out.dtype if device_dtype_ok(out.dtype) else np.dtype("float64")
    flops = cpu_s = gpu_s = host_s = 0.0
    for step in steps:
        f, c, g = estimate_step(step, n, dtype, profile)
        flops, cpu_s, gpu_s = flops + f, cpu_s + c, gpu_s + g
        if step.op.family == CREATION:
            host_s += c
    # Dask's per-task dispatch is paid wherever the task runs
    cpu_s += profile.cpu.task_overhead_s
    gpu_s += profile.cpu.task_overhead_s
    return Estimate(
        family=main.family,
        detail=">".join(o.name for o in ops[:4]) + (f">…({len(ops)} ops)" if len(ops) > 4 else ""),
        flops=flops,
        in_bytes=in_bytes,
        out_bytes=out.nbytes,
        cpu_s=cpu_s,
        gpu_s=gpu_s if why_cpu is None else math.inf,
        cpu_parallel=main.family != MATMUL,
        gpu_capable=why_cpu is None,
        why_cpu=why_cpu,
        host_s=host_s,
    )


def estimate_h2d_seconds(nbytes: float, profile: Profile) -> float:
    """Seconds to copy ``nbytes`` of pageable host memory to the device (:func:`_copy_seconds`)."""
    return _copy_seconds(nbytes, profile, "h2d")


def estimate_d2h_seconds(nbytes: float, profile: Profile) -> float:
    """Seconds to copy ``nbytes`` from the device to pageable host memory (:func:`_copy_seconds`)."""
    return _copy_seconds(nbytes, profile, "d2h")


def _copy_seconds(nbytes: float, profile: Profile, direction: str) -> float:
    """The link's latency and ``nbytes`` at the rate of a copy that size: interpolated in log
    size between the per-size rates of a calibrated profile (``link.copies_by_size``: the
    path the runtime takes at each size, measured), else the link's one rate that way."""
    if not nbytes:
        return 0.0
    link = profile.link
    rate = link.copies_by_size.bytes_per_s(direction, nbytes) if link.copies_by_size else None
    if rate is None:
        rate = link.h2d_bytes_per_s if direction == "h2d" else link.d2h_bytes_per_s
    return link.latency_s + nbytes / rate
