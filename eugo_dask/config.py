"""Configuration: defaults under the ``eugo:`` key of Dask's config, and validated settings.

The only module that reads ``eugo.*``. Defaults live in ``eugo.yaml`` (documented there) with a
JSON-schema twin in ``eugo-schema.yaml``; both are registered with ``dask.config.update_defaults``
at import. Set values with ``dask.config.set({"eugo.min-speedup": 3})`` or the environment
(``DASK_EUGO__MIN_SPEEDUP=3``). Values are read when a graph is optimized or a task runs, never at
import:

- :func:`read_settings` -> :class:`Settings`, everything the pass needs, validated (errors name
  the key and what is allowed; a key the schema does not name is one, :func:`check_keys`);
  :meth:`Settings.resolved` turns ``auto`` into a device and a profile;
  :func:`keyword_settings`: the settings ``explain()`` takes as keywords, names checked;
- :func:`process_device`, :func:`emulated_memory_limit`, :func:`emulated_device_count` and
  :func:`device_settings` (a :class:`~eugo_dask.devices.DeviceSettings`: pool limit, FFT plan
  caches, idle release, staging buffers): what a worker's own settings allow inside a task;
  :func:`worker_setting_problems` checks them where a worker starts;
- :func:`resolve_profile`: ``auto`` -> the preset for the local CUDA device's exact model;
- :func:`cluster_profile`: a scheduler's own profile for clients that ask for ``auto``;
- :func:`gpu_workers_on_demand`: whether a scheduler's GPU workers start when GPU work waits;
- :func:`load_profile`: a profile loaded, the local CPU measured where it has no ``cpu`` section.
"""

from __future__ import annotations

import copy
import decimal
import difflib
import functools
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar, cast

import dask
import numpy as np
import yaml
from dask.utils import parse_bytes, parse_timedelta

from eugo_dask.devices import (
    DEVICES,
    CopyRule,
    DeviceSettings,
    cupy_device_attributes,
    cupy_device_count,
    cupy_device_memory,
    cupy_device_name,
    resolve_device_name,
)
from eugo_dask.measure import cached_local_cpu
from eugo_dask.ops import DeviceSetting
from eugo_dask.profile import (
    PRESETS,
    CopiesBySize,
    CopyPoint,
    Profile,
    ProfileError,
    check_profile_spec,
    copies_by_size,
    preset_for_device,
)
from eugo_dask.profile import load_profile as _load_profile

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HERE = os.path.dirname(__file__)


def _load_yaml(name: str) -> dict[str, Any]:
    with open(os.path.join(_HERE, name)) as f:
        return yaml.safe_load(f)


#: eugo.yaml: the one place the defaults are written.
_DEFAULTS: dict[str, Any] = _load_yaml("eugo.yaml")


def register_defaults() -> None:
    dask.config.update_defaults(copy.deepcopy(_DEFAULTS))


def _setting(key: str) -> Any:
    """``key`` (``eugo.…``) as Dask's config holds it, or its eugo.yaml default where the config
    has none: one restored from a copy taken before ``import eugo_dask`` (as
    ``distributed.utils_test`` takes on import, and ``gen_cluster`` restores) lacks eugo's keys."""
    default: Any = _DEFAULTS
    for part in key.split("."):
        default = default[part]
    return dask.config.get(key, default)


def schema() -> dict[str, Any]:
    """The JSON schema of the ``eugo`` config section."""
    return _load_yaml("eugo-schema.yaml")


@functools.cache
def _known_keys() -> dict[str, Any]:
    """The keys the schema names (the one list of them): a section's name (``emulated``) ->
    its own keys, a setting's -> None (its value may be a mapping, as ``eugo.profile``'s)."""
    def known(node: dict[str, Any]) -> dict[str, Any]:
        return {name: known(sub) if "properties" in sub else None
                for name, sub in node["properties"].items()}

    return known(schema()["properties"]["eugo"])


def _dotted(known: dict[str, Any], prefix: str) -> list[str]:
    """Every key of ``known`` in full (``eugo.emulated.devices``), sections' keys after theirs."""
    out = []
    for name, sub in known.items():
        out.append(prefix + name)
        if sub is not None:
            out.extend(_dotted(sub, f"{prefix}{name}."))
    return out


def _unknown_key(key: str, allowed: list[str], what: str) -> str:
    """The message for an unknown ``key``: the closest of the ``allowed`` ones, and them all."""
    closest = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {closest[0]}?)" if closest else ""
    return f"unknown {what} {key}{hint}; allowed: {', '.join(allowed)}"


def check_keys() -> None:
    """Raise where Dask's config holds an ``eugo.*`` key that eugo does not know (a misspelt
    one would otherwise be ignored, its setting silently left at the default). Keys are
    compared as Dask's config reads them: ``min_speedup`` is ``min-speedup`` (the environment
    gives ``DASK_EUGO__MIN_SPEEDUP`` as the former); a setting's own value is not looked into
    (``eugo.profile: {base: h200}``)."""
    problem = _key_problem(dask.config.get("eugo", {}), _known_keys(), "eugo.")
    if problem is not None:
        raise ValueError(problem)


def _key_problem(values: Any, known: dict[str, Any], prefix: str) -> str | None:
    if not isinstance(values, dict):
        return (f"{prefix[:-1]} must be a mapping of {', '.join(_dotted(known, prefix))}; "
                f"got {values!r}")
    for name, value in values.items():
        canonical = name.replace("_", "-") if isinstance(name, str) else name
        if canonical not in known:
            return _unknown_key(f"{prefix}{name}", _dotted(_known_keys(), "eugo."), "setting")
        if known[canonical] is not None:
            problem = _key_problem(value, known[canonical], f"{prefix}{canonical}.")
            if problem is not None:
                return problem
    return None


def keyword_settings(settings: dict[str, Any], caller: str) -> dict[str, Any]:
    """``eugo.*`` config for the settings ``caller`` (``explain()``) took as keywords, their
    names with underscores (``min_speedup=0`` -> ``{"eugo.min-speedup": 0}``); an unknown name
    raises a ``TypeError`` naming the closest one and those allowed."""
    names = [name.replace("-", "_") for name in _known_keys()]
    for name in settings:
        if name not in names:
            raise TypeError(_unknown_key(name, names, f"{caller} setting"))
    return {f"eugo.{name.replace('_', '-')}": value for name, value in settings.items()}


@dataclass(frozen=True)
class Settings:
    """The ``eugo.*`` settings in force for one optimization, validated."""

    device: DeviceSetting
    profile: Any
    min_speedup: float
    resource: str
    device_memory_fraction: float
    emulated_memory_limit: int
    learn: bool = False
    history: str | None = None
    #: ``eugo.dispatch`` and ``eugo.dual-from`` (see eugo.yaml)
    dispatch: str = "static"
    dual_from: float = 0.05
    #: blocks read ahead per GPU slot where reads feed the device on a cluster; None: not paced
    read_ahead: int | None = 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resolved(self, gpu_workers: bool | None = None) -> Settings:
        """These settings with ``device`` and ``profile`` resolved (``auto`` -> a device).

        ``gpu_workers`` says whether the cluster the graph runs on has workers advertising the
        GPU resource (None: no cluster, decide from this machine). With them, ``auto`` plans
        for CuPy: the workers' own devices run the GPU tasks."""
        device: DeviceSetting
        if (self.device == "auto" and gpu_workers) or (self.device == "cupy" and gpu_workers is not None):
            device = "cupy"  # planned for the cluster's workers; this process needs no CuPy
        else:  # this machine's device; an explicit "cupy" here says why it cannot be honoured
            # (cupy, emulated or None: devices.py types it str until the types reach it)
            device = cast(DeviceSetting,
                          resolve_device_name(self.device, explicit_error=True) or "none")
        return replace(self, device=device, profile=resolve_profile(self.profile, device))


def _number(key: str, value: Any, *, minimum: float, maximum: float | None = None,
            exclusive_minimum: bool = False) -> float:
    allowed = (f"a number {'>' if exclusive_minimum else '>='} {minimum:g}"
               + (f" and <= {maximum:g}" if maximum is not None else ""))
    # a number, not text that reads as one: the whole-number settings refuse '2' as well (Dask
    # parses DASK_EUGO__MIN_SPEEDUP=2 from the environment as the number 2). Infinity is the
    # one number the environment cannot spell as a literal, so 'inf' and 'infinity' are read
    refused = ValueError(f"{key} must be {allowed}; got {value!r}")
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity", "+infinity"):
        value = math.inf
    if (not isinstance(value, (numbers.Real, decimal.Decimal))
            or isinstance(value, (bool, np.bool_))):
        raise refused
    try:
        number = float(value)
    except (ValueError, ArithmeticError):  # a signalling Decimal NaN
        raise refused from None
    low_ok = number > minimum if exclusive_minimum else number >= minimum
    if not low_ok or (maximum is not None and number > maximum):
        raise refused
    return number


def process_device() -> DeviceSetting:
    """This process's own ``eugo.device`` (a worker uses a device only where it allows)."""
    device = _setting("eugo.device")
    if device is None:  # Dask reads DASK_EUGO__DEVICE=none from the environment as None
        device = "none"
    if device not in DEVICES:
        raise ValueError(f"eugo.device must be one of {list(DEVICES)}; got {device!r}")
    return device


def emulated_memory_limit() -> int:
    """Capacity of this process's emulated device in bytes (``eugo.emulated.memory-limit``)."""
    memory_limit = _setting("eugo.emulated.memory-limit")
    allowed = "a positive byte count or a size like '16 GiB'"
    try:
        limit = None if isinstance(memory_limit, bool) else parse_bytes(memory_limit)
    except (TypeError, ValueError, AttributeError):
        limit = None
    if limit is None or limit <= 0:
        raise ValueError(f"eugo.emulated.memory-limit must be {allowed}; got {memory_limit!r}")
    return limit


def worker_setting_problems() -> list[str]:
    """What is wrong with this process's own settings as a worker reads them at start (those of
    :func:`device_setting_problems`, ``eugo.resource``, and a key eugo does not know): one
    message per key, naming it and what is allowed; empty where all is well."""
    problems = list(device_setting_problems())
    for check in (read_resource, check_keys):
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems


def _per_distinct_values(keys: tuple[str, ...]) -> Callable[[Callable[..., T]], Callable[[], T]]:
    """Make ``fn(*values of keys)`` a reader of the config now in force that works its answer out
    once per distinct set of values (GPU tasks call these readers). Values that cannot be hashed
    (a list or a mapping where a value belongs: invalid) are worked out each time."""
    def wrap(fn: Callable[..., T]) -> Callable[[], T]:
        cached = functools.lru_cache(maxsize=64)(fn)

        @functools.wraps(fn)
        def read() -> T:
            raw = tuple(map(_setting, keys))
            try:
                hash(raw)
            except TypeError:
                return fn(*raw)
            return cached(*raw)

        return read

    return wrap


def _is_whole(value: Any, minimum: int, maximum: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) from ``minimum`` to ``maximum``."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            and (maximum is None or value <= maximum))


def emulated_device_count() -> int:
    """Emulated devices per process (``eugo.emulated.devices``)."""
    value = _setting("eugo.emulated.devices")
    if not _is_whole(value, 1):
        raise ValueError(f"eugo.emulated.devices must be a whole number >= 1; got {value!r}")
    return value


def _size(key: str, value: Any, *, allow_none: bool = False, allow_auto: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    try:
        size = parse_bytes(value)
    except (TypeError, ValueError, AttributeError):  # AttributeError: a list, a mapping
        size = -1
    if isinstance(value, bool) or size < 0:
        allowed = (("auto, " if allow_auto else "") + "a byte count or size like '1 GiB'"
                   + (", or null" if allow_none else ""))
        raise ValueError(f"{key} must be {allowed}; got {value!r}")
    return size


#: The device settings' keys, in :class:`~eugo_dask.devices.DeviceSettings` order.
_DEVICE_KEYS = ("eugo.device-memory-fraction", "eugo.fft-plan-cache-size",
                "eugo.fft-plan-cache-memory", "eugo.device-idle-release", "eugo.staging-buffer",
                "eugo.copy-threads", "eugo.copy-piece", "eugo.pinned-results",
                "eugo.pinned-results-min", "eugo.register-in-place", "eugo.gpus-per-process")
#: The values of ``eugo.dispatch``: the plan fixes every task by the margin; or tasks where
#: neither device dominates are placed at run time; or each layer goes where the split that
#: reaches the makespan's lower bound on the machine the graph runs on puts it.
DISPATCH = ("static", "dual", "balanced")
#: The values of ``eugo.gpus-per-process``.
GPUS_PER_PROCESS = ("one", "all")
#: Every key the device path reads (:func:`device_setting_problems` depends on these only).
_DEVICE_PATH_KEYS = ("eugo.device", "eugo.emulated.memory-limit", "eugo.emulated.devices",
                     *_DEVICE_KEYS)


#: The copy engine's keys whose ``auto`` leaves a choice to the profile's per-size copy paths
#: (:attr:`~eugo_dask.devices.DeviceSettings.per_size`), and that choice.
_PER_SIZE_KEYS = {"eugo.copy-threads": "threads", "eugo.register-in-place": "h2d",
                  "eugo.pinned-results-min": "d2h"}


@_per_distinct_values(_DEVICE_KEYS)
def configured_device_settings(fraction: Any, plans: Any, plan_memory: Any, idle: Any,
                               staging_size: Any, copy_threads: Any, copy_piece: Any,
                               pinned_results: Any, pinned_results_min: Any,
                               register_in_place: Any, gpus: Any) -> DeviceSettings:
    """The device settings the config keys give, validated: ``eugo.device-memory-fraction``
    (the pool limit), ``eugo.fft-plan-cache-size``, ``eugo.fft-plan-cache-memory``,
    ``eugo.device-idle-release``, ``eugo.staging-buffer``, the copy engine's
    ``eugo.copy-threads``, ``eugo.copy-piece`` and ``eugo.pinned-results`` (the pinned result
    pool's cap), ``eugo.pinned-results-min`` and ``eugo.register-in-place``, and
    ``eugo.gpus-per-process``. A copy key at ``auto`` keeps its field's default and names its
    choice in ``per_size`` (:func:`device_settings` fills it from the profile). Called without
    arguments: the values in force."""
    fraction = _number("eugo.device-memory-fraction", fraction, minimum=0, maximum=1,
                       exclusive_minimum=True)
    if not _is_whole(plans, 0):
        raise ValueError(f"eugo.fft-plan-cache-size must be a whole number >= 0; got {plans!r}")
    plan_bytes = _size("eugo.fft-plan-cache-memory", plan_memory, allow_none=True)
    try:
        idle_s = None if idle is None else parse_timedelta(idle, default="seconds")
    except (TypeError, ValueError, KeyError, AttributeError):
        idle_s = -1
    if isinstance(idle, bool) or (idle_s is not None and idle_s <= 0):
        raise ValueError(f"eugo.device-idle-release must be a duration like '60s' (> 0) or null; "
                         f"got {idle!r}")
    staging = _size("eugo.staging-buffer", staging_size)
    assert staging is not None
    if 0 < staging < 64 * 1024:
        raise ValueError(f"eugo.staging-buffer must be 0 or at least 64 KiB; got {staging!r}")
    values = {"eugo.copy-threads": copy_threads, "eugo.register-in-place": register_in_place,
              "eugo.pinned-results-min": pinned_results_min}
    per_size = frozenset(choice for key, choice in _PER_SIZE_KEYS.items() if values[key] == "auto")
    defaults = DeviceSettings()
    if copy_threads == "auto":
        copy_threads = defaults.copy_threads
    elif not _is_whole(copy_threads, 1, 64):
        raise ValueError(f"eugo.copy-threads must be auto or a whole number from 1 to 64; "
                         f"got {copy_threads!r}")
    piece = _size("eugo.copy-piece", copy_piece)
    assert piece is not None
    if piece < 64 * 1024:
        raise ValueError(f"eugo.copy-piece must be at least 64 KiB; got {copy_piece!r}")
    results = _size("eugo.pinned-results", pinned_results)
    results_min = (defaults.pinned_results_min_bytes if pinned_results_min == "auto" else
                   _size("eugo.pinned-results-min", pinned_results_min, allow_auto=True))
    register = (defaults.register_min_bytes if register_in_place == "auto" else
                _size("eugo.register-in-place", register_in_place, allow_none=True, allow_auto=True))
    assert results is not None and results_min is not None
    if not isinstance(gpus, str) or gpus not in GPUS_PER_PROCESS:
        raise ValueError(f"eugo.gpus-per-process must be one of {list(GPUS_PER_PROCESS)}; got {gpus!r}")
    return DeviceSettings(memory_fraction=fraction, fft_plan_cache_size=plans,
                          fft_plan_cache_bytes=plan_bytes, idle_release_s=idle_s,
                          staging_bytes=staging, copy_threads=copy_threads, copy_piece_bytes=piece,
                          pinned_results_bytes=results, pinned_results_min_bytes=results_min,
                          register_min_bytes=register, gpus=gpus, per_size=per_size)


def device_settings() -> DeviceSettings:
    """How this process builds its device: :func:`configured_device_settings`, and for the
    copy choices left at ``auto`` (``per_size``) the per-size copy paths of this process's
    profile (``link.copies_by_size`` of ``eugo.profile``, or where that is ``auto`` of
    ``eugo.cluster-profile``), each size's path and threads as calibration measured them
    best. Explicit config wins: a copy key that is set keeps its rule at every size. A profile
    without per-size copies (every preset) leaves the defaults; one that cannot be read here
    is logged once and leaves them too (the planner, which reads the same profile, names what
    is wrong where the graph is planned)."""
    settings = configured_device_settings()
    if not settings.per_size:
        return settings
    copies = _process_copies()
    return settings if copies is None else _with_copies(settings, copies)


def _process_copies() -> CopiesBySize | None:
    spec = _setting("eugo.profile")
    try:
        if spec == "auto":
            spec = cluster_profile()
            if spec is None or spec == "auto":
                return None
        return copies_by_size(spec)
    except ProfileError as e:
        _warn_unreadable_copies(str(e))
        return None


@functools.lru_cache(maxsize=64)
def _with_copies(settings: DeviceSettings, copies: CopiesBySize) -> DeviceSettings:
    def rules(points: tuple[CopyPoint, ...]) -> tuple[CopyRule, ...]:
        return tuple((p.bytes, p.path, p.threads) for p in points)

    return replace(settings, h2d_by_size=rules(copies.h2d), d2h_by_size=rules(copies.d2h))


@functools.cache
def _warn_unreadable_copies(problem: str) -> None:
    logger.warning("eugo: the copy engine keeps its default copy paths: this process's profile "
                   "cannot be read for its per-size copies (%s)", problem)


@_per_distinct_values(_DEVICE_PATH_KEYS)
def device_setting_problems(*_: Any) -> tuple[str, ...]:
    """What is wrong with the settings this process's device path reads (``eugo.device``,
    ``eugo.emulated.*``, the device settings): one message per key; empty where all is well. A
    worker with any of them invalid uses no device. Called without arguments: the values in
    force (the readers below read them)."""
    problems = []
    for reader in (process_device, emulated_memory_limit, emulated_device_count, device_settings):
        try:
            reader()
        except ValueError as e:
            problems.append(str(e))
    return tuple(problems)


def read_resource() -> str:
    """``eugo.resource``: the worker resource GPU tasks request."""
    resource = _setting("eugo.resource")
    if not isinstance(resource, str) or not resource:
        raise ValueError(f"eugo.resource must be a non-empty worker resource name; got {resource!r}")
    return resource


def history_path() -> str | None:
    """``eugo.history``: where this process keeps learned durations (None: the default)."""
    history = _setting("eugo.history")
    if history is not None and not isinstance(history, str):
        raise ValueError(f"eugo.history must be a file path or null; got {history!r}")
    return history


def read_ahead() -> int | None:
    """``eugo.read-ahead``: the blocks a read may run ahead of the device per GPU slot where
    reads feed it on a cluster (None: reads are not paced)."""
    value = _setting("eugo.read-ahead")
    if value is not None and not _is_whole(value, 0):
        raise ValueError("eugo.read-ahead must be a whole number >= 0 (blocks per GPU slot) or "
                         f"null (reads not paced); got {value!r}")
    return value


def read_settings() -> Settings:
    """Read and validate the ``eugo.*`` config now in force."""
    check_keys()
    device = process_device()
    resource = read_resource()
    memory_limit_bytes = emulated_memory_limit()
    configured_device_settings()  # validated here too, so a bad value fails on the client
    emulated_device_count()
    learn = _setting("eugo.learn")
    if not isinstance(learn, bool):
        raise ValueError(f"eugo.learn must be true or false; got {learn!r}")
    history = history_path()
    dispatch = _setting("eugo.dispatch")
    if dispatch not in DISPATCH:
        raise ValueError(f"eugo.dispatch must be one of {list(DISPATCH)}; got {dispatch!r}")
    return Settings(
        device=device,
        profile=check_profile_spec(_setting("eugo.profile")),
        min_speedup=_number("eugo.min-speedup", _setting("eugo.min-speedup"), minimum=0),
        resource=resource,
        device_memory_fraction=_number(
            "eugo.device-memory-fraction", _setting("eugo.device-memory-fraction"),
            minimum=0, maximum=1, exclusive_minimum=True,
        ),
        emulated_memory_limit=memory_limit_bytes,
        learn=learn,
        history=history,
        dispatch=dispatch,
        dual_from=_number("eugo.dual-from", _setting("eugo.dual-from"), minimum=0),
        read_ahead=read_ahead(),
    )


def gpu_workers_on_demand() -> bool:
    """This process's ``eugo.gpu-workers-on-demand``: on a scheduler, that GPU workers start when
    GPU work waits for them (an autoscaled GPU group that may be at zero), so a graph is planned
    for them, and its GPU tasks wait, even while no worker advertises the resource."""
    value = _setting("eugo.gpu-workers-on-demand")
    if not isinstance(value, bool):
        raise ValueError(f"eugo.gpu-workers-on-demand: expected true or false, got {value!r}")
    return value


def cluster_profile() -> Any:
    """This process's ``eugo.cluster-profile``: the profile a scheduler plans with when a
    client asks for ``auto``. A profile spec or a list of them, the first usable one winning (a
    preset or a mapping always is; a path once the file exists). None where unset or where no
    candidate is usable yet."""
    value = _setting("eugo.cluster-profile")
    if value is None:
        return None
    candidates = value if isinstance(value, (list, tuple)) else [value]
    for candidate in candidates:
        if isinstance(candidate, str) and candidate not in PRESETS and candidate != "auto":
            if os.path.exists(candidate):
                return candidate
            continue
        if candidate == "auto":
            continue
        return candidate
    return None


def resolve_profile(profile: Any, device: DeviceSetting) -> Any:
    """``auto`` -> the profile for the local CUDA device: the preset of its exact model name with
    its memory read from the device and the devices a process drives (one, or every one with
    ``eugo.gpus-per-process: all``) (:func:`eugo_dask.profile.preset_for_device`); a MIG slice
    priced by its share; an unknown model from its attributes over the slowest preset, with a
    warning that says to calibrate; the h200 preset for the emulated device or where there is
    no CUDA device here. Anything else is returned as given."""
    if profile != "auto":
        return profile
    try:
        name = cupy_device_name() if device == "cupy" else None
    except ImportError:  # planning on a scheduler without CuPy for GPU workers
        name = None
    if name is None:
        return "h200"
    try:
        every_gpu = device_settings().gpus == "all"
    except ValueError:  # the device path says what is wrong
        every_gpu = False
    spec, known = preset_for_device(name, memory_bytes=cupy_device_memory(),
                                    count=cupy_device_count() if every_gpu else 1,
                                    attributes=cupy_device_attributes())
    if not known:
        _warn_unknown_device(name, spec["base"])
    return spec


def load_profile(spec: str | os.PathLike[str] | Mapping[str, Any]) -> Profile:
    """Load the profile ``spec`` (:func:`eugo_dask.profile.load_profile`), the local CPU measured
    once and cached per machine (:func:`eugo_dask.measure.cached_local_cpu`) where it has no
    ``cpu`` section."""
    return _load_profile(spec, local_cpu=cached_local_cpu)


@functools.cache
def _warn_unknown_device(name: str, preset: str) -> None:
    logger.warning("eugo: no preset for the CUDA device %r: planning with the slowest preset's "
                   "(%s) link and overheads, GPU rates estimated from the device's attributes "
                   "where it gives them (memory from the device); run `eugo-dask calibrate` on "
                   "this machine and set eugo.profile to its profile", name, preset)


__all__ = ["PRESETS", "Settings", "device_settings", "emulated_device_count", "load_profile",
           "read_settings", "register_defaults", "resolve_profile", "schema"]
