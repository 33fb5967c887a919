"""Profiles: presets, files, dicts, validation, and the cached local CPU measurement."""

from __future__ import annotations

import json

import pytest
import yaml

from eugo_dask import measure
from eugo_dask import profile as profile_mod
from eugo_dask.profile import PRESETS, ProfileError, load_profile, profile_dict

CPU = yaml.safe_load(
    (profile_mod.resources.files("eugo_dask") / "profiles" / "server-x86.cpu.yaml").read_text()
)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_spec_sheet_data(name):
    data = profile_dict(name)
    assert data["source"] == "spec-sheet"
    p = load_profile({"base": name, "cpu": "server-x86"})
    assert p.gpu.memory_bytes > 1e10
    assert p.gpu.matmul_flops_per_s.float32 >= p.gpu.flops_per_s.float32 * 0.99
    assert p.link.h2d_bytes_per_s < p.link.pinned_h2d_bytes_per_s


def test_required_presets_present():
    assert {"h100-pcie", "h100-sxm", "h200", "a100", "l4", "t4"} <= set(PRESETS)


def test_consumer_gpus_are_slow_at_float64():
    for name in ("l4", "t4"):
        g = load_profile({"base": name, "cpu": "server-x86"}).gpu
        assert g.flops_per_s.float64 * 16 < g.flops_per_s.float32


def test_profile_from_dict_path_and_base(tmp_path):
    full = {**profile_dict("h200"), "cpu": CPU, "name": "mine"}
    assert load_profile(full).name == "mine"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(full))
    assert load_profile(str(path)).cpu.threads == CPU["threads"]
    jpath = tmp_path / "p.json"
    jpath.write_text(json.dumps(full))
    assert load_profile(jpath).gpu.name == full["gpu"]["name"]
    override = load_profile({"base": "h200", "cpu": "server-x86", "link": {"h2d_bytes_per_s": 1e9}})
    assert override.link.h2d_bytes_per_s == 1e9
    assert override.link.d2h_bytes_per_s == load_profile({"base": "h200", "cpu": "server-x86"}).link.d2h_bytes_per_s


def test_edited_profile_file_is_reloaded(tmp_path):
    full = {**profile_dict("h200"), "cpu": CPU}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(full))
    first = load_profile(str(path)).link.h2d_bytes_per_s
    full["link"]["h2d_bytes_per_s"] = first / 2
    path.write_text(yaml.safe_dump(full))
    import os
    import time
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert load_profile(str(path)).link.h2d_bytes_per_s == first / 2


@pytest.mark.parametrize(
    "spec, match",
    [
        ("h300", r"eugo.profile must be one of the presets \[.*'h200'.*\], a path to a .yaml/.json profile, or a mapping; got 'h300'"),
        ("missing.yaml", r"cannot read profile file 'missing.yaml'"),
        ({"base": "h300"}, r"eugo.profile: base must be one of \["),
        ({"base": "h200", "cpu": "laptop"}, r"cpu must be a mapping or one of the CPU presets \['server-x86'\]"),
        ({"base": "h200", "link": {"h2d_bytes_per_s": -5}}, r"eugo.profile: link.h2d_bytes_per_s must be a positive number; got -5"),
        ({"base": "h200", "gpu": {"flops_per_s": {"float32": 0}}}, r"gpu.flops_per_s.float32 must be a positive number; got 0"),
        ({"base": "h200", "gpu": {"flops_per_s": {"bfloat16": 1e12}}}, r"unknown dtype\(s\) \['bfloat16'\]; allowed: \['float16', 'float32', 'float64'\]"),
        ({"base": "h200", "gpu": {"count": 0}}, r"gpu.count must be a whole number >= 1; got 0"),
        ({"base": "h200", "wings": 2}, r"unknown field\(s\) \['wings'\]"),
        ({"gpu": {}}, r"'gpu.name' is missing"),
        ({"base": "h200", "cpu": {"threads": 4}}, r"'cpu.name' is missing"),
        ({"base": "h200", "link": {"latency_s": "fast"}}, r"link.latency_s must be a number; got 'fast'"),
        (42, r"eugo.profile must be a preset name"),
    ],
)
def test_bad_profiles_raise_clear_errors(spec, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(spec)


def test_malformed_profile_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gpu: [unclosed\n")
    with pytest.raises(ProfileError, match="is not valid YAML/JSON"):
        load_profile(str(path))


def test_local_cpu_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = measure.measure_local_cpu

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(measure, "measure_local_cpu", counting)
    first = measure.cached_local_cpu()
    assert len(calls) == 1
    assert list(tmp_path.glob("eugo-dask/cpu-*.json"))
    second = measure.cached_local_cpu()
    assert len(calls) == 1 and second == first  # read back from the per-machine cache
    # a cache the caller does not accept (an older format, say) is measured again
    measure.cached_local_cpu(accept=lambda data: False)
    assert len(calls) == 2
    # the measurement is a valid cpu section, and a preset without cpu uses it
    p = profile_mod._build(profile_dict("h200"), first)
    assert p.cpu.matmul_flops_per_s.float64 > 1e8
    assert p.cpu.memory_bandwidth_bytes_per_s > 1e8
    assert p.cpu.threads >= 1
