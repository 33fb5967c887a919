"""Configuration: defaults under the ``eugo:`` key of Dask's config, and validated settings.

The only module that reads ``eugo.*``. Defaults live in ``eugo.yaml`` (documented there) with a
JSON-schema twin in ``eugo-schema.yaml``; both are registered with ``dask.config.update_defaults``
at import. Set values with ``dask.config.set({"eugo.min-speedup": 3})`` or the environment
(``DASK_EUGO__MIN_SPEEDUP=3``). Values are read when a graph is optimized or a task runs, never at
import:

- :func:`read_settings` -> :class:`Settings`, everything the pass needs, validated (errors name
  the key and what is allowed); :meth:`Settings.resolved` turns ``auto`` into a device and a
  profile;
- :func:`process_device` and :func:`emulated_memory_limit`: what a worker's own settings allow
  inside a task; :func:`worker_setting_problems` checks them where a worker starts;
- :func:`cluster_profile`: a scheduler's own profile for clients that ask for ``auto``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import dask
import yaml
from dask.utils import parse_bytes

from eugo_dask.devices import DEVICES, cupy_device_name, resolve_device_name
from eugo_dask.profile import PRESETS, check_profile_spec

_HERE = os.path.dirname(__file__)


def _load_yaml(name: str) -> dict[str, Any]:
    with open(os.path.join(_HERE, name)) as f:
        return yaml.safe_load(f)


def register_defaults() -> None:
    dask.config.update_defaults(_load_yaml("eugo.yaml"))


def schema() -> dict[str, Any]:
    """The JSON schema of the ``eugo`` config section."""
    return _load_yaml("eugo-schema.yaml")


@dataclass(frozen=True)
class Settings:
    """The ``eugo.*`` settings in force for one optimization, validated."""

    device: str
    profile: Any
    min_speedup: float
    resource: str
    device_memory_fraction: float
    emulated_memory_limit: int
    learn: bool = False
    history: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resolved(self, gpu_workers: bool | None = None) -> Settings:
        """These settings with ``device`` and ``profile`` resolved (``auto`` -> a device).

        ``gpu_workers`` says whether the cluster the graph runs on has workers advertising the
        GPU resource (None: no cluster, decide from this machine). With them, ``auto`` plans
        for CuPy: the workers' own devices run the GPU tasks."""
        if (self.device == "auto" and gpu_workers) or (self.device == "cupy" and gpu_workers is not None):
            device = "cupy"  # planned for the cluster's workers; this process needs no CuPy
        else:
            device = resolve_device_name(self.device) or "none"
        return Settings(**{**asdict(self), "device": device,
                           "profile": resolve_profile(self.profile, device)})


def _number(key: str, value: Any, *, minimum: float, maximum: float | None = None,
            exclusive_minimum: bool = False) -> float:
    allowed = (f"a number {'>' if exclusive_minimum else '>='} {minimum:g}"
               + (f" and <= {maximum:g}" if maximum is not None else ""))
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {allowed}; got {value!r}") from None
    low_ok = number > minimum if exclusive_minimum else number >= minimum
    if isinstance(value, bool) or not low_ok or (maximum is not None and number > maximum):
        raise ValueError(f"{key} must be {allowed}; got {value!r}")
    return number


def process_device() -> str:
    """This process's own ``eugo.device`` (a worker uses a device only where it allows)."""
    device = dask.config.get("eugo.device", "auto")
    if device is None:  # Dask reads DASK_EUGO__DEVICE=none from the environment as None
        device = "none"
    if device not in DEVICES:
        raise ValueError(f"eugo.device must be one of {list(DEVICES)}; got {device!r}")
    return device


def emulated_memory_limit() -> int:
    """Capacity of this process's emulated device in bytes (``eugo.emulated.memory-limit``)."""
    memory_limit = dask.config.get("eugo.emulated.memory-limit", "16 GiB")
    allowed = "a positive byte count or a size like '16 GiB'"
    try:
        limit = None if isinstance(memory_limit, bool) else parse_bytes(memory_limit)
    except (TypeError, ValueError, AttributeError):
        limit = None
    if limit is None or limit <= 0:
        raise ValueError(f"eugo.emulated.memory-limit must be {allowed}; got {memory_limit!r}")
    return limit


def worker_setting_problems() -> list[str]:
    """What is wrong with this process's own settings as a worker reads them at start
    (``eugo.device``, ``eugo.emulated.memory-limit``, ``eugo.resource``): one message per
    key, naming it and what is allowed; empty where all is well."""
    problems = []
    for reader in (process_device, emulated_memory_limit, read_resource):
        try:
            reader()
        except ValueError as e:
            problems.append(str(e))
    return problems


def read_resource() -> str:
    """``eugo.resource``: the worker resource GPU tasks request."""
    resource = dask.config.get("eugo.resource", "GPU")
    if not isinstance(resource, str) or not resource:
        raise ValueError(f"eugo.resource must be a non-empty worker resource name; got {resource!r}")
    return resource


def history_path() -> str | None:
    """``eugo.history``: where this process keeps learned durations (None: the default)."""
    history = dask.config.get("eugo.history", None)
    if history is not None and not isinstance(history, str):
        raise ValueError(f"eugo.history must be a file path or null; got {history!r}")
    return history


def read_settings() -> Settings:
    """Read and validate the ``eugo.*`` config now in force."""
    device = process_device()
    resource = read_resource()
    memory_limit_bytes = emulated_memory_limit()
    learn = dask.config.get("eugo.learn", False)
    if not isinstance(learn, bool):
        raise ValueError(f"eugo.learn must be true or false; got {learn!r}")
    history = history_path()
    return Settings(
        device=device,
        profile=check_profile_spec(dask.config.get("eugo.profile")),
        min_speedup=_number("eugo.min-speedup", dask.config.get("eugo.min-speedup"), minimum=0),
        resource=resource,
        device_memory_fraction=_number(
            "eugo.device-memory-fraction", dask.config.get("eugo.device-memory-fraction"),
            minimum=0, maximum=1, exclusive_minimum=True,
        ),
        emulated_memory_limit=memory_limit_bytes,
        learn=learn,
        history=history,
    )


# Substrings of CUDA device names -> presets, most specific first.
_DEVICE_PRESETS = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
                   ("A100", "a100"), ("L4", "l4"), ("T4", "t4"))


def cluster_profile() -> Any:
    """This process's ``eugo.cluster-profile``: the profile a scheduler plans with when a
    client asks for ``auto``. A profile spec or a list of them, the first usable one winning (a
    preset or a mapping always is; a path once the file exists). None where unset or where no
    candidate is usable yet."""
    value = dask.config.get("eugo.cluster-profile", None)
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


def resolve_profile(profile: Any, device: str) -> Any:
    """``auto`` -> the preset matching the local CUDA device (h200 for the emulated device or
    an unknown GPU); anything else is returned as given."""
    if profile != "auto":
        return profile
    try:
        name = cupy_device_name() if device == "cupy" else None
    except ImportError:  # planning on a scheduler without CuPy for GPU workers
        name = None
    for needle, preset in _DEVICE_PRESETS:
        if name and needle in name:
            return preset
    return "h200"


__all__ = ["PRESETS", "Settings", "read_settings", "register_defaults", "resolve_profile", "schema"]
