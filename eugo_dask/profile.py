"""Hardware profiles: plain data describing a GPU, its host link and the CPU beside it.

A profile is selected with ``dask.config.set({"eugo.profile": NAME_OR_PATH_OR_DICT})``:

- a preset name (``b200``, ``gb200``, ``h200``, ``h100-sxm``, ``h100-pcie``, ``gh200``, ``a100``,
  ``l40s``, ``a10``, ``l4``, ``v100``, ``t4``): GPU and link figures from spec sheets, shipped as
  YAML under ``eugo_dask/profiles/``; :func:`preset_for_device` matches a CUDA device's exact
  model name to one (:data:`DEVICE_MODELS`) and takes the memory from the device, prices a MIG
  slice by its share of the GPU, and an unknown model from its attributes (SMs, clock, memory
  bus) over the slowest preset (:data:`UNKNOWN_DEVICE_PRESET`), never as a faster one;
- a path to a YAML or JSON file in the same format (what ``eugo-dask calibrate`` will write);
- a dict in the same format; ``base: PRESET`` starts from a preset and overrides its fields.

A profile's ``cpu`` section is a dict, the name of a CPU preset (``server-x86``), or absent, in
which case the local CPU's figures come from whoever loads the profile (``local_cpu`` of
:func:`load_profile`; :func:`eugo_dask.config.load_profile`, which ``eugo_dask.load_profile`` is,
measures the local CPU once, under a second, and caches it per machine). The format is
documented in the README; :func:`validate_profile_dict` checks it and names what is wrong.

This module holds data, validation and loading only: it measures nothing (it imports neither
:mod:`eugo_dask.measure` nor the devices), and what the numbers mean for a task is the cost
model's job.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eugo_dask.ops import UFUNC_CLASS

#: GPU presets shipped with the package (spec-sheet figures).
PRESETS = ("a10", "a100", "b200", "gb200", "gh200", "h100-pcie", "h100-sxm", "h200", "l40s", "l4",
           "t4", "v100")
#: CPU presets shipped with the package (assumed figures for dry runs).
CPU_PRESETS = ("server-x86",)

_CONFIG_KEY = "eugo.profile"
_RATE_DTYPES = ("float16", "float32", "float64")

# field -> kind; "rates" is a mapping dtype -> positive number with float32 and float64 required.
_GPU_FIELDS = {
    "name": "str",
    "count": "count",
    "memory_bytes": "positive",
    "memory_bandwidth_bytes_per_s": "positive",
    "flops_per_s": "rates",
    "matmul_flops_per_s": "rates",
    "call_overhead_s": "non-negative",
    "kernel_launch_s": "non-negative",
    "fft_plan_s": "non-negative",
    "source": "str?",
    # figures measured on the device (calibrate): no efficiency factors apply
    "measured": "bool?",
    # measured FFT rate (5 n log2 n per second); else a share of flops_per_s
    "fft_flops_per_s": "rates?",
    # once per process (context, first kernel compile) and once per worker thread and device
    # (cuBLAS handle, stream, FFT plan cache): measured by calibrate
    "first_use_s": "non-negative?",
    "thread_setup_s": "non-negative?",
}
_LINK_FIELDS = {
    "name": "str",
    "h2d_bytes_per_s": "positive",
    "d2h_bytes_per_s": "positive",
    "pinned_h2d_bytes_per_s": "positive?",
    "pinned_d2h_bytes_per_s": "positive?",
    "latency_s": "non-negative",
    # per-size copy rates, each with the path that measured best (calibrate)
    "copies_by_size": "copies?",
}
_CPU_FIELDS = {
    "name": "str",
    "source": "str?",
    "threads": "count",
    "memory_bandwidth_bytes_per_s": "positive",
    "flops_per_s": "rates",
    "matmul_flops_per_s": "rates",
    "fft_flops_per_s": "rates",
    "task_overhead_s": "non-negative",
    "reduction_bandwidth_bytes_per_s": "positive?",
    "matmul_half_n": "positive?",
    "matmul_s_per_flop": "class-rates?",
    "warnings": "str-list?",
    "elementwise_s_per_element": "class-rates?",
    "fft_s_per_flop": "class-rates?",
    "reduction_s_per_element": "class-rates?",
}
_TOP_FIELDS = {"name", "source", "description", "base", "gpu", "link", "cpu"}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Rates:
    """Rates by dtype; dtypes not listed use the nearest listed precision."""

    float16: float
    float32: float
    float64: float

    def for_dtype(self, dtype: np.dtype) -> float:
        dtype = np.dtype(dtype)
        size = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
        if dtype.kind in "fc":
            return self.float16 if size <= 2 else self.float32 if size <= 4 else self.float64
        # integers and bools run at single-precision rates, 64-bit ints at double's
        return self.float64 if size >= 8 else self.float32


@dataclass(frozen=True)
class GPUProfile:
    name: str
    count: int
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    flops_per_s: Rates
    matmul_flops_per_s: Rates
    call_overhead_s: float
    kernel_launch_s: float
    fft_plan_s: float
    source: str | None = None
    #: True where the figures were measured on the device (calibrate): achieved rates, to which
    #: the cost model applies no spec-sheet efficiency factors
    measured: bool = False
    fft_flops_per_s: Rates | None = None
    first_use_s: float | None = None
    thread_setup_s: float | None = None


#: The copy paths a point of ``link.copies_by_size`` may name, by direction: ``direct`` (from or to
#: the pageable chunk itself), ``staged`` (through pinned staging buffers, the host memcpy split
#: over ``threads``), ``registered`` (the chunk page-locked in place, one DMA), ``pinned`` (the
#: result copied straight into a pinned block of the result pool).
COPY_PATHS: dict[str, tuple[str, ...]] = {"h2d": ("direct", "registered", "staged"),
                                          "d2h": ("direct", "pinned", "staged")}
_COPY_POINT_FIELDS = ("bytes", "bytes_per_s", "measured", "path", "threads")


@dataclass(frozen=True)
class CopyPoint:
    """One measured size of a copy direction: the rate of the path that measured best there
    (``threads``: a staged copy's host memcpy threads; None for the other paths) and, where
    calibration kept them, every path's rate at that size (``measured``, ``dma``: raw pinned
    DMA; not compared: it says what lost, nothing decides by it)."""

    bytes: int
    bytes_per_s: float
    path: str
    threads: int | None = None
    measured: Mapping[str, float] | None = dataclasses.field(default=None, compare=False)


@dataclass(frozen=True)
class CopiesBySize:
    """A link's copy rates by size and direction (``link.copies_by_size``), sizes increasing.
    The cost model prices a copy from :meth:`bytes_per_s`; the runtime takes, for a copy of
    ``n`` bytes, the path of the point nearest ``n`` (:mod:`eugo_dask.devices.copies`)."""

    h2d: tuple[CopyPoint, ...] = ()
    d2h: tuple[CopyPoint, ...] = ()

    def bytes_per_s(self, direction: str, nbytes: float) -> float | None:
        """The rate of a copy of ``nbytes`` in ``direction`` (``h2d``/``d2h``), interpolated in
        log size between the measured points and held flat past either end; None where the
        direction has none."""
        points: tuple[CopyPoint, ...] = getattr(self, direction)
        if not points:
            return None
        return float(np.interp(math.log(max(nbytes, 1.0)), [math.log(p.bytes) for p in points],
                               [p.bytes_per_s for p in points]))


@dataclass(frozen=True)
class LinkProfile:
    name: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    latency_s: float
    pinned_h2d_bytes_per_s: float | None = None
    pinned_d2h_bytes_per_s: float | None = None
    #: per-size rates and paths (calibrate); None: one rate each way, the two above
    copies_by_size: CopiesBySize | None = None


@dataclass(frozen=True)
class CPUProfile:
    name: str
    threads: int
    memory_bandwidth_bytes_per_s: float
    flops_per_s: Rates
    matmul_flops_per_s: Rates
    fft_flops_per_s: Rates
    task_overhead_s: float
    source: str | None = None
    #: one thread reading (a reduction); memory_bandwidth_bytes_per_s where not measured
    reduction_bandwidth_bytes_per_s: float | None = None
    #: matrix order at which BLAS reaches half its peak rate (measured by calibrate)
    matmul_half_n: float | None = None
    #: measured seconds per element of a binary call, by dtype and ufunc class (calibrate)
    elementwise_s_per_element: Mapping[str, Mapping[str, float]] | None = None
    #: measured seconds per matmul flop by dtype and matrix order (calibrate: up to 2048-4096)
    matmul_s_per_flop: Mapping[str, Mapping[str, Any]] | None = None
    #: what the measurement noticed (unstable rounds, a busy machine)
    warnings: tuple[str, ...] | None = None

    def matmul_seconds_per_flop(self, dtype: np.dtype, n: float) -> float | None:
        """Calibrated seconds per matmul flop at ``dtype`` and matrix order ``n`` (interpolated;
        held flat past the largest size measured), or None where not measured."""
        return _lookup(self.matmul_s_per_flop, dtype, "matmul", int(max(n, 1)))

    #: measured seconds per FFT flop (5 n log2 n) by dtype and size (calibrate)
    fft_s_per_flop: Mapping[str, Mapping[str, Any]] | None = None

    def elementwise_seconds(self, ufunc: str, dtype: np.dtype, n: int) -> float | None:
        """Calibrated seconds per element for ``ufunc``'s class at ``dtype`` and ``n`` elements,
        or None where not measured."""
        return _lookup(self.elementwise_s_per_element, dtype, UFUNC_CLASS.get(ufunc, ""), n)

    #: measured seconds per element of a sum by dtype and size (calibrate)
    reduction_s_per_element: Mapping[str, Mapping[str, Any]] | None = None

    def reduction_seconds(self, dtype: np.dtype, n: int) -> float | None:
        """Calibrated seconds per element of a reduction's chunk step, or None."""
        return _lookup(self.reduction_s_per_element, dtype, "sum", n)

    def fft_seconds_per_flop(self, dtype: np.dtype, n: int) -> float | None:
        """Calibrated seconds per FFT flop at ``dtype`` and ``n`` points, or None."""
        return _lookup(self.fft_s_per_flop, dtype, "fft", n)


def _lookup(table: Mapping[str, Mapping[str, Any]] | None, dtype: np.dtype, name: str,
            n: int) -> float | None:
    """A calibrated table's value, interpolated in log n between measured sizes (caches make
    small chunks cheaper per element, fresh memory makes big ones dearer)."""
    if not table:
        return None
    dtype = np.dtype(dtype)
    precision = dtype.itemsize // (2 if dtype.kind == "c" else 1)
    points = (table.get("float64" if precision >= 8 else "float32") or {}).get(name)
    if not points:
        return None
    if isinstance(points, (int, float)):
        return float(points)
    sizes, values = zip(*sorted(points))
    return float(np.interp(np.log(max(n, 1)), np.log(sizes), values))


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    gpu: GPUProfile
    link: LinkProfile
    cpu: CPUProfile

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data of the caller's own: its tables as dicts, not read-only."""
        return {name: ({field: _unfrozen(value) for field, value in section.items()}
                       if isinstance(section, dict) else section)
                for name, section in asdict(self).items()}


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
#: What a number in a profile may be: Python's, or NumPy's (a rate worked out with NumPy).
_NUMBERS = (int, float, np.integer, np.floating)


def _check_number(where: str, value: Any, kind: str) -> None:
    if isinstance(value, bool) or not isinstance(value, _NUMBERS) or not math.isfinite(value):
        raise ProfileError(f"{_CONFIG_KEY}: {where} must be a finite number; got {value!r}")
    if kind.startswith("positive") and value <= 0:
        raise ProfileError(f"{_CONFIG_KEY}: {where} must be a positive number; got {value!r}")
    if kind == "non-negative" and value < 0:
        raise ProfileError(f"{_CONFIG_KEY}: {where} must be zero or more; got {value!r}")
    if kind == "count" and (value < 1 or int(value) != value):
        raise ProfileError(f"{_CONFIG_KEY}: {where} must be a whole number >= 1; got {value!r}")


def _check_section(section: str, data: Any, fields: Mapping[str, str]) -> None:
    """Check a profile's section ``section`` against ``fields`` (field -> kind; ``?`` after a
    kind: optional): a mapping of known fields, each present unless optional, of its kind."""
    _check_keys(data, fields,
                f"'{section}' must be a mapping with fields {sorted(fields)}; "
                f"got {type(data).__name__}",
                lambda unknown: f"unknown field(s) {unknown} in '{section}'; "
                                f"allowed: {sorted(fields)}")
    for field, kind in fields.items():
        where = f"{section}.{field}"
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        if field not in data:
            if optional:
                continue
            raise ProfileError(f"{_CONFIG_KEY}: '{where}' is missing (kind: {kind})")
        _check_field(where, data[field], kind)


def _check_keys(data: Any, allowed: Iterable[str], not_mapping: str,
                unknown: Callable[[list[Any]], str]) -> None:
    """Raise :class:`ProfileError` saying ``not_mapping`` where ``data`` is not a mapping, or
    ``unknown(its keys not allowed, sorted)`` where it has any."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{_CONFIG_KEY}: {not_mapping}")
    bad = set(data) - set(allowed)
    if bad:
        raise ProfileError(f"{_CONFIG_KEY}: {unknown(sorted(bad))}")


def _check_field(where: str, value: Any, kind: str) -> None:
    """Check the value of the field ``where`` against its kind: a string, a list of strings,
    a boolean, rates by dtype and ufunc class (``class-rates``), rates by dtype (``rates``), or
    a number (:func:`_check_number`'s kinds)."""
    if kind == "str":
        if not isinstance(value, str):
            raise ProfileError(f"{_CONFIG_KEY}: {where} must be a string; got {value!r}")
    elif kind == "str-list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ProfileError(f"{_CONFIG_KEY}: {where} must be a list of strings; got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ProfileError(f"{_CONFIG_KEY}: {where} must be true or false; got {value!r}")
    elif kind == "class-rates":
        _check_class_rates(where, value)
    elif kind == "rates":
        _check_rates(where, value)
    elif kind == "copies":
        _check_copies(where, value)
    else:
        _check_number(where, value, kind)


def _check_class_rates(where: str, value: Any) -> None:
    """``{dtype: {name: seconds}}``, or ``{dtype: {name: [[size, seconds per unit], ...]}}``:
    every figure a positive number."""
    if not isinstance(value, Mapping) or not all(
        isinstance(v, Mapping) for v in value.values()
    ):
        raise ProfileError(
            f"{_CONFIG_KEY}: {where} must map dtypes to {{ufunc class: seconds}}; got {value!r}"
        )
    for dtype, classes in value.items():
        for name, points in classes.items():
            if isinstance(points, list):  # [[elements, seconds per element], ...]
                for i, point in enumerate(points):
                    if not (isinstance(point, (list, tuple)) and len(point) == 2):
                        raise ProfileError(
                            f"{_CONFIG_KEY}: {where}.{dtype}.{name}[{i}] must be "
                            f"[elements, seconds per element]; got {point!r}"
                        )
                    _check_number(f"{where}.{dtype}.{name}[{i}]", point[0], "positive")
                    _check_number(f"{where}.{dtype}.{name}[{i}]", point[1], "positive")
            else:
                _check_number(f"{where}.{dtype}.{name}", points, "positive")


def _check_copies(where: str, value: Any) -> None:
    """``{h2d: [point, ...], d2h: [point, ...]}`` (either direction or both), each point
    ``{bytes, bytes_per_s, path[, threads][, measured]}`` (a null optional field is an absent
    one; a direction without points is one the link's single rate prices): sizes whole and
    increasing, rates
    positive, ``path`` one of the direction's :data:`COPY_PATHS`, ``threads`` (1 to 64) given
    for a staged copy and only for one, ``measured`` a mapping of names to positive rates."""
    _check_keys(value, COPY_PATHS,
                f"{where} must be a mapping with fields {sorted(COPY_PATHS)} (either or both); "
                f"got {value!r}",
                lambda unknown: f"{where} has unknown field(s) {unknown}; allowed: {sorted(COPY_PATHS)}")
    for direction, points in value.items():
        there = f"{where}.{direction}"
        if not isinstance(points, (list, tuple)):
            raise ProfileError(f"{_CONFIG_KEY}: {there} must be a list of points "
                               f"{{bytes, bytes_per_s, path[, threads][, measured]}}; got {points!r}")
        last = 0
        for i, point in enumerate(points):
            _check_copy_point(f"{there}[{i}]", point, COPY_PATHS[direction], last)
            last = point["bytes"]


def _check_copy_point(where: str, point: Any, paths: tuple[str, ...], last: int) -> None:
    _check_keys(point, _COPY_POINT_FIELDS,
                f"{where} must be a mapping with fields {list(_COPY_POINT_FIELDS)}; got {point!r}",
                lambda unknown: f"{where} has unknown field(s) {unknown}; "
                                f"allowed: {list(_COPY_POINT_FIELDS)}")
    for name in ("bytes", "bytes_per_s", "path"):
        if name not in point:
            raise ProfileError(f"{_CONFIG_KEY}: '{where}.{name}' is missing")
    _check_number(f"{where}.bytes", point["bytes"], "count")
    if point["bytes"] <= last:
        raise ProfileError(f"{_CONFIG_KEY}: {where}.bytes must be larger than the point's before "
                           f"({last}): sizes increase; got {point['bytes']!r}")
    _check_number(f"{where}.bytes_per_s", point["bytes_per_s"], "positive")
    path = point["path"]
    if path not in paths:
        raise ProfileError(f"{_CONFIG_KEY}: {where}.path must be one of {list(paths)}; got {path!r}")
    threads = point.get("threads")
    if path == "staged":
        if threads is None or isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) \
                or not 1 <= threads <= 64:
            raise ProfileError(f"{_CONFIG_KEY}: {where}.threads must be a whole number from 1 to 64 "
                               f"for a staged copy; got {threads!r}")
    elif threads is not None:
        raise ProfileError(f"{_CONFIG_KEY}: {where}.threads is a staged copy's; path {path!r} has "
                           f"none; got {threads!r}")
    measured = point.get("measured")
    if measured is not None:
        if not isinstance(measured, Mapping) or not all(isinstance(k, str) for k in measured):
            raise ProfileError(f"{_CONFIG_KEY}: {where}.measured must map path names to rates; "
                               f"got {measured!r}")
        for name, rate in measured.items():
            _check_number(f"{where}.measured.{name}", rate, "positive")


def _check_rates(where: str, value: Any) -> None:
    """``{dtype: rate}``: float32 and float64 at least, only :data:`_RATE_DTYPES`, every rate
    a positive number."""
    _check_keys(value, _RATE_DTYPES,
                f"{where} must map dtypes {list(_RATE_DTYPES)} to rates; got {value!r}",
                lambda unknown: f"{where} has unknown dtype(s) {unknown}; "
                                f"allowed: {list(_RATE_DTYPES)}")
    for dtype in ("float32", "float64"):
        if dtype not in value:
            raise ProfileError(f"{_CONFIG_KEY}: '{where}.{dtype}' is missing")
    for dtype, rate in value.items():
        _check_number(f"{where}.{dtype}", rate, "positive")


def validate_profile_dict(data: Any, *, require_cpu: bool = True) -> None:
    """Check a profile in its dict form; raise :class:`ProfileError` naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ProfileError(
            f"{_CONFIG_KEY} must be a preset name {list(PRESETS)}, a path to a YAML/JSON "
            f"profile, or a mapping; got {type(data).__name__}"
        )
    unknown = set(data) - _TOP_FIELDS
    if unknown:
        raise ProfileError(
            f"{_CONFIG_KEY}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_TOP_FIELDS)}"
        )
    for section, fields in (("gpu", _GPU_FIELDS), ("link", _LINK_FIELDS)):
        if section not in data:
            raise ProfileError(f"{_CONFIG_KEY}: section '{section}' is missing")
        _check_section(section, data[section], fields)
    if "cpu" in data and not isinstance(data["cpu"], str):
        _check_section("cpu", data["cpu"], _CPU_FIELDS)
    elif require_cpu and "cpu" not in data:
        raise ProfileError(f"{_CONFIG_KEY}: section 'cpu' is missing")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _read_packaged(filename: str) -> dict[str, Any]:
    """A preset file's contents, the caller's to change (parsed once per process: checking a
    profile mapping reads its base preset, and that happens on every pass)."""
    return copy.deepcopy(_parse_packaged(filename))


@functools.cache
def _parse_packaged(filename: str) -> dict[str, Any]:
    text = resources.files("eugo_dask").joinpath("profiles").joinpath(filename).read_text()
    return yaml.safe_load(text)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{_CONFIG_KEY}: cannot read profile file {str(path)!r}: {e}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ProfileError(f"{_CONFIG_KEY}: {str(path)!r} is not valid YAML/JSON: {e}") from e
    return data


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_profile_spec(spec: Any, *, allow_auto: bool = True) -> Any:
    """``spec`` if it has the form of a profile: ``auto``, a preset name, a path to a YAML or
    JSON file, or a valid mapping. Paths are not opened here (a client may name a file that
    exists only on the scheduler); everything else is checked now, so a typo such as ``h300``
    is an error whatever the device. Raises :class:`ProfileError`."""
    if isinstance(spec, str) and (spec in PRESETS or (allow_auto and spec == "auto")):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.suffix in {".yaml", ".yml", ".json"} or path.exists():
            return spec
        raise ProfileError(
            f"{_CONFIG_KEY} must be {'auto, ' if allow_auto else ''}one of the presets "
            f"{list(PRESETS)}, a path to a .yaml/.json profile, or a mapping; got {str(spec)!r}")
    if isinstance(spec, Mapping):
        try:
            frozen = _frozen(spec)
        except ProfileError:
            profile_dict(spec)  # names what is wrong, or passes: not plain data, not remembered
        else:
            _check_mapping(frozen)
        return spec
    raise ProfileError(
        f"{_CONFIG_KEY} must be {'auto, ' if allow_auto else ''}a preset name {list(PRESETS)}, "
        f"a path, or a mapping; got {type(spec).__name__}")


def _frozen(spec: Any) -> str:
    """``spec`` as sorted JSON: what the per-process caches of profiles are keyed by."""
    try:
        return json.dumps(spec, sort_keys=True, default=_plain)
    except (TypeError, ValueError) as e:  # ValueError: a mapping that contains itself
        raise ProfileError(f"{_CONFIG_KEY} must be plain data (str, numbers, mappings): {e}") from e


def _plain(value: Any) -> Any:
    """What JSON cannot write itself but a profile may hold: a NumPy number as Python's, a
    mapping of another type as a dict. Anything else is not plain data."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):  # (float: a longdouble's item() is a longdouble)
        return float(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@functools.lru_cache(maxsize=64)
def _check_mapping(frozen: str) -> None:
    """Check a profile mapping (as JSON) once per process: the settings are read on every pass.
    A bad one raises every time (lru_cache keeps no exception)."""
    profile_dict(json.loads(frozen))


def profile_dict(spec: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Resolve a profile spec (name, path or dict) to its validated dict form, with ``cpu``
    either a dict, a CPU preset name, or absent (measure the local CPU)."""
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec not in PRESETS):
        path = Path(spec)
        if not (path.suffix in {".yaml", ".yml", ".json"} or path.exists()):
            raise ProfileError(
                f"{_CONFIG_KEY} must be one of the presets {list(PRESETS)}, a path to a "
                f".yaml/.json profile, or a mapping; got {str(spec)!r}"
            )
        data = _read_file(path)
    elif isinstance(spec, str):
        data = _read_packaged(f"{spec}.yaml")
    elif isinstance(spec, Mapping):
        data = dict(spec)
    else:
        raise ProfileError(
            f"{_CONFIG_KEY} must be a preset name {list(PRESETS)}, a path, or a mapping; "
            f"got {type(spec).__name__}"
        )
    if isinstance(data, Mapping) and "base" in data:
        base = data["base"]
        if base not in PRESETS:
            raise ProfileError(f"{_CONFIG_KEY}: base must be one of {list(PRESETS)}; got {base!r}")
        data = _merge(_read_packaged(f"{base}.yaml"), {k: v for k, v in data.items() if k != "base"})
    validate_profile_dict(data, require_cpu=False)
    cpu = data.get("cpu")
    if isinstance(cpu, str) and cpu not in CPU_PRESETS:
        raise ProfileError(
            f"{_CONFIG_KEY}: cpu must be a mapping or one of the CPU presets {list(CPU_PRESETS)}; "
            f"got {cpu!r}"
        )
    return data


def _rates(data: Mapping[str, float]) -> Rates:
    return Rates(
        float16=float(data.get("float16", data["float32"])),
        float32=float(data["float32"]),
        float64=float(data["float64"]),
    )


class ReadOnlyTable(dict[str, Any]):
    """A calibrated table of a profile (dtype -> {name: seconds, or (size, seconds) points}),
    read-only: one :class:`Profile` object serves every pass of the process (``load_profile``
    keeps it), so a change made to it in place would change every plan made after. A dict
    otherwise: it pickles, compares and reads as one."""

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a profile's tables are read-only (every pass shares the profile); "
                        "to change one, load a profile from a changed mapping or file")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only
    __ior__ = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __copy__(self) -> ReadOnlyTable:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReadOnlyTable:
        return self  # (nothing in it changes: its values are tables, numbers and tuples)


def _unfrozen(value: Any) -> Any:
    if isinstance(value, dict):  # a read-only table, or a section's table made a dict by asdict
        return {key: _unfrozen(inner) for key, inner in value.items()}
    if isinstance(value, tuple) and any(isinstance(inner, dict) for inner in value):
        return [_unfrozen(inner) for inner in value]  # copies_by_size's points
    return value


def _class_rates(table: Mapping[str, Mapping[str, Any]]) -> ReadOnlyTable:
    return ReadOnlyTable({
        dtype: ReadOnlyTable({name: (tuple(tuple(p) for p in v) if isinstance(v, list) else v)
                              for name, v in classes.items()})
        for dtype, classes in table.items()})


def _copies(table: Mapping[str, Any]) -> CopiesBySize:
    def point(p: Mapping[str, Any]) -> CopyPoint:
        measured = p.get("measured")
        return CopyPoint(bytes=int(p["bytes"]), bytes_per_s=float(p["bytes_per_s"]), path=str(p["path"]),
                         threads=None if p.get("threads") is None else int(p["threads"]),
                         measured=None if measured is None else ReadOnlyTable(
                             {str(k): float(v) for k, v in measured.items()}))

    return CopiesBySize(**{direction: tuple(point(p) for p in points)
                           for direction, points in table.items()})


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "str": str, "bool": bool, "str-list": tuple, "count": int, "positive": float,
    "non-negative": float, "rates": _rates, "class-rates": _class_rates, "copies": _copies,
}


def _section(cls: type, data: Mapping[str, Any], fields: Mapping[str, str]) -> Any:
    """Build one profile section from its validated dict; the field table is the schema."""
    return cls(**{
        field: _CONVERTERS[kind.rstrip("?")](data[field])
        for field, kind in fields.items()
        if field in data
    })


def _build(data: Mapping[str, Any], cpu: Mapping[str, Any]) -> Profile:
    return Profile(
        name=str(data.get("name", "custom")),
        source=str(data.get("source", "user")),
        gpu=_section(GPUProfile, data["gpu"], _GPU_FIELDS),
        link=_section(LinkProfile, data["link"], _LINK_FIELDS),
        cpu=_section(CPUProfile, cpu, _CPU_FIELDS),
    )


#: What loading a profile without a ``cpu`` section calls for the local CPU's section, as
#: ``local_cpu(accept=check)``: ``check`` says whether a cached reading is one this version can
#: use (:func:`eugo_dask.measure.cached_local_cpu`, handed in by the caller).
LocalCPU = Callable[..., dict[str, Any]]


@functools.lru_cache(maxsize=64)
def _load_cached(frozen: str, version: tuple[int, ...] | None,
                 local_cpu: LocalCPU | None) -> Profile:
    # version (the file's change time, modification time, size and inode) is part of the cache
    # key only: an edited profile file is read again, also one whose modification time was
    # kept (cp -p, rsync -t, tar x), since writing it changes its change time
    spec = json.loads(frozen)
    data = profile_dict(spec)
    cpu = data.get("cpu")
    if cpu is None:
        if local_cpu is None:
            raise ProfileError(f"{_CONFIG_KEY}: this profile has no cpu section, and nothing was "
                               "handed in to measure the local CPU (eugo_dask.load_profile does)")
        cpu_data = local_cpu(accept=_valid_cpu_section)
    elif isinstance(cpu, str):
        cpu_data = _read_packaged(f"{cpu}.cpu.yaml")
    else:
        cpu_data = cpu
    return _build(data, cpu_data)


def _valid_cpu_section(data: dict[str, Any]) -> bool:
    try:
        _check_section("cpu", data, _CPU_FIELDS)
    except ProfileError:
        return False
    return True


def load_profile(spec: str | os.PathLike[str] | Mapping[str, Any], *,
                 local_cpu: LocalCPU | None = None) -> Profile:
    """Load the profile ``spec``: a preset name, a path, or a mapping (see the module doc).
    ``local_cpu`` gives the ``cpu`` section of a profile that has none (see :data:`LocalCPU`);
    without it such a profile raises :class:`ProfileError`."""
    return _load_cached(*_cache_key(spec), local_cpu)


def _cache_key(spec: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    """What the per-process caches of profiles are keyed by: ``spec`` as sorted JSON and, for a
    file, its version (change and modification time, size, inode)."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    try:
        frozen = _frozen(spec)
    except ProfileError as e:
        if isinstance(e.__cause__, TypeError):  # a value of another type: which field
            profile_dict(spec)
        raise
    version = None
    if isinstance(spec, str) and spec not in PRESETS:
        try:
            stat = os.stat(spec)
            version = (stat.st_ctime_ns, stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError:
            pass  # profile_dict names the problem
    return frozen, version


def copies_by_size(spec: str | os.PathLike[str] | Mapping[str, Any]) -> CopiesBySize | None:
    """The per-size copy paths and rates of the profile ``spec`` (``link.copies_by_size``), or
    None where it has none (no preset has). Validated as :func:`profile_dict` does, its CPU
    section neither read nor measured; cached per spec and file version, as profiles are.
    Raises :class:`ProfileError` naming what is wrong."""
    if isinstance(spec, str) and spec in PRESETS:
        return None
    return _copies_cached(*_cache_key(spec))


@functools.lru_cache(maxsize=64)
def _copies_cached(frozen: str, version: tuple[int, ...] | None) -> CopiesBySize | None:
    link = profile_dict(json.loads(frozen))["link"]
    table = link.get("copies_by_size")
    return None if table is None else _copies(table)


# ---------------------------------------------------------------------------------------------
# CUDA devices -> presets
# ---------------------------------------------------------------------------------------------
#: CUDA device names (exactly as ``cudaGetDeviceProperties`` reports them) -> (preset, the
#: model's own figures where they differ from the preset's). Names are matched exactly: an
#: unknown model is never priced as a look-alike ("L40S" is not an "L4").
_V100_PCIE = {"flops_per_s": {"float16": 1.4e13, "float32": 1.4e13, "float64": 7.0e12},
              "matmul_flops_per_s": {"float16": 1.12e14, "float32": 1.4e13, "float64": 7.0e12}}
DEVICE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "NVIDIA H200": ("h200", {}),
    "NVIDIA H200 NVL": ("h200", {"gpu": {"name": "NVIDIA H200 NVL",
                                         "flops_per_s": {"float16": 6.0e13, "float32": 6.0e13,
                                                         "float64": 3.0e13},
                                         "matmul_flops_per_s": {"float16": 8.36e14, "float32": 6.0e13,
                                                                "float64": 6.0e13}}}),
    "NVIDIA H100 80GB HBM3": ("h100-sxm", {}),
    "NVIDIA H100 PCIe": ("h100-pcie", {}),
    "NVIDIA H100 NVL": ("h100-sxm", {"gpu": {"name": "NVIDIA H100 NVL",
                                             "memory_bandwidth_bytes_per_s": 3.9e12,
                                             "flops_per_s": {"float16": 6.0e13, "float32": 6.0e13,
                                                             "float64": 3.0e13}}}),
    "NVIDIA A100-SXM4-80GB": ("a100", {}),
    "NVIDIA A100-SXM4-40GB": ("a100", {"gpu": {"name": "NVIDIA A100 SXM4 40GB",
                                               "memory_bandwidth_bytes_per_s": 1.555e12}}),
    "NVIDIA A100-PCIE-40GB": ("a100", {"gpu": {"name": "NVIDIA A100 PCIe 40GB",
                                               "memory_bandwidth_bytes_per_s": 1.555e12}}),
    "NVIDIA A100 80GB PCIe": ("a100", {"gpu": {"name": "NVIDIA A100 PCIe 80GB",
                                               "memory_bandwidth_bytes_per_s": 1.935e12}}),
    "NVIDIA GH200 480GB": ("gh200", {}),
    "NVIDIA GH200 144G HBM3e": ("gh200", {"gpu": {"name": "NVIDIA GH200 144GB HBM3e",
                                                  "memory_bandwidth_bytes_per_s": 4.9e12}}),
    "NVIDIA L40S": ("l40s", {}),
    "NVIDIA L40": ("l40s", {"gpu": {"name": "NVIDIA L40 48GB",
                                    "flops_per_s": {"float16": 9.05e13, "float32": 9.05e13,
                                                    "float64": 1.41e12},
                                    "matmul_flops_per_s": {"float16": 1.81e14, "float32": 9.05e13,
                                                           "float64": 1.41e12}}}),
    "NVIDIA L4": ("l4", {}),
    "Tesla T4": ("t4", {}),
    "NVIDIA B200": ("b200", {}),
    "NVIDIA GB200": ("gb200", {}),
    "NVIDIA A10": ("a10", {}),
    "NVIDIA A10G": ("a10", {"gpu": {"name": "NVIDIA A10G 24GB (priced as the A10)"}}),
    "Tesla V100-SXM2-32GB": ("v100", {}),
    "Tesla V100-SXM2-16GB": ("v100", {"gpu": {"name": "Tesla V100 SXM2 16GB"}}),
    "Tesla V100-PCIE-32GB": ("v100", {"gpu": dict(_V100_PCIE, name="Tesla V100 PCIe 32GB")}),
    "Tesla V100-PCIE-16GB": ("v100", {"gpu": dict(_V100_PCIE, name="Tesla V100 PCIe 16GB")}),
}
#: The preset an unknown CUDA model starts from: the slowest (a test keeps it so); its figures
#: are replaced by what the device's attributes give (:func:`gpu_figures_from_attributes`).
UNKNOWN_DEVICE_PRESET = "t4"
#: MIG's compute slices per GPU on every MIG-capable model (A100, A30 aside, H100, H200, B200).
MIG_COMPUTE_SLICES = 7
_MIG_NAME = re.compile(r"(?P<parent>.+?)\s+MIG\s+(?P<compute>\d+)g\.(?P<memory>\d+)gb", re.IGNORECASE)


def preset_for_device(name: str, *, memory_bytes: float | None = None,
                      count: int | None = None,
                      attributes: Mapping[str, float] | None = None) -> tuple[dict[str, Any], bool]:
    """The profile spec for a CUDA device called ``name`` (matched exactly, surrounding spaces
    aside, against :data:`DEVICE_MODELS`), with ``memory_bytes`` and ``count`` read from the
    device. Returns (spec, known).

    A MIG slice (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``) of a known model is priced by its share:
    compute rates by its compute slices (of :data:`MIG_COMPUTE_SLICES`), memory bandwidth by its
    memory's share of the model's. An unknown model gets :data:`UNKNOWN_DEVICE_PRESET`'s
    figures, the slowest preset's, with the GPU rates its ``attributes`` give
    (:func:`gpu_figures_from_attributes`; CUDA device attributes by name, as
    :func:`eugo_dask.devices.cupy_device_attributes` reads them) where they are known, and
    ``known`` False, so the caller can say to calibrate."""
    name = name.strip()
    mig = _MIG_NAME.fullmatch(name)
    model = mig.group("parent") if mig else name
    preset, overrides = DEVICE_MODELS.get(model, (UNKNOWN_DEVICE_PRESET, None))
    gpu: dict[str, Any] = copy.deepcopy(dict((overrides or {}).get("gpu", {})))
    if overrides is None:
        estimated = gpu_figures_from_attributes(attributes or {})
        gpu.update(estimated)
        how = ("from its attributes over the slowest preset, " if estimated else "as the slowest preset, ")
        gpu["name"] = f"{name} (unknown model, priced {how}{preset})"
    elif mig:
        gpu.update(_mig_share(preset, gpu, int(mig.group("compute")), float(mig.group("memory")) * 1e9))
        gpu["name"] = f"{gpu.get('name', model)} MIG {mig.group('compute')}g.{mig.group('memory')}gb"
    if memory_bytes:
        gpu["memory_bytes"] = float(memory_bytes)
    if count:
        gpu["count"] = int(count)
    spec: dict[str, Any] = {"base": preset}
    if gpu:
        spec["gpu"] = gpu
    return spec, overrides is not None


def _mig_share(preset: str, model_gpu: Mapping[str, Any], compute_slices: int,
               slice_memory_bytes: float) -> dict[str, Any]:
    """A MIG slice's GPU figures: the model's (``model_gpu`` over the preset's) rates times its
    compute share, bandwidth times its memory share."""
    full = _merge(_parse_packaged(f"{preset}.yaml")["gpu"], model_gpu)
    compute = min(compute_slices / MIG_COMPUTE_SLICES, 1.0)
    memory = min(slice_memory_bytes / float(full["memory_bytes"]), 1.0)
    return {
        "memory_bandwidth_bytes_per_s": float(full["memory_bandwidth_bytes_per_s"]) * memory,
        "flops_per_s": {k: float(v) * compute for k, v in full["flops_per_s"].items()},
        "matmul_flops_per_s": {k: float(v) * compute for k, v in full["matmul_flops_per_s"].items()},
    }


#: FP32 lanes per SM by compute capability (CUDA programming guide's throughput table); an
#: unlisted one gets the smallest.
_FP32_LANES = {(6, 0): 64, (6, 1): 128, (7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128,
               (8, 7): 128, (8, 9): 128, (9, 0): 128, (10, 0): 128, (12, 0): 128}
#: Full-rate float64 (half of float32) where listed; else 1/64 of float32.
_FULL_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}
#: Dense float16 tensor-core flops per SM per clock (datasheet peak / SMs / boost clock:
#: V100, T4, A10, L4: 1024; A100: 2048; H100, H200, B200: 4096 or more); none before Volta.
_TENSOR_FP16 = {(7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 1024, (8, 7): 1024,
                (8, 9): 1024, (9, 0): 4096, (10, 0): 4096, (12, 0): 1024}


def gpu_figures_from_attributes(attributes: Mapping[str, float]) -> dict[str, Any]:
    """GPU rates estimated from CUDA device attributes: ``multiprocessors``, ``clock_khz``
    and ``compute_capability`` ((major, minor)) give the float32 rate (SMs x lanes x 2 x clock),
    float64 (half or 1/64 of it) and GEMM (tensor cores where the architecture has them);
    ``memory_clock_khz`` and ``memory_bus_bits`` give the bandwidth (double data rate). Peaks,
    as a datasheet's; only what the attributes give (empty where they give nothing)."""
    figures: dict[str, Any] = {}
    memory_clock, bus = attributes.get("memory_clock_khz"), attributes.get("memory_bus_bits")
    if memory_clock and bus:
        figures["memory_bandwidth_bytes_per_s"] = 2.0 * float(memory_clock) * 1e3 * float(bus) / 8
    sms, clock = attributes.get("multiprocessors"), attributes.get("clock_khz")
    capability = attributes.get("compute_capability")
    if not (sms and clock and capability):
        return figures
    major, minor = (int(v) for v in capability)  # type: ignore[attr-defined]
    arch = (major, minor)
    per_clock = float(sms) * float(clock) * 1e3
    fp32 = 2.0 * _FP32_LANES.get(arch, 64) * per_clock
    fp64 = fp32 / 2 if arch in _FULL_FP64 else fp32 / 64
    tensor = _TENSOR_FP16.get(arch, 1024 if major >= 7 else 0) * per_clock
    figures["flops_per_s"] = {"float16": fp32, "float32": fp32, "float64": fp64}
    figures["matmul_flops_per_s"] = {"float16": max(tensor, fp32), "float32": fp32, "float64": fp64}
    return figures
