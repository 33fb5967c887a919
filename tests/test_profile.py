"""Profiles: presets, files, dicts, validation, and the cached local CPU measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
import pytest
import yaml

from eugo_dask import load_profile, measure
from eugo_dask import profile as profile_mod
from eugo_dask.profile import PRESETS, ProfileError, check_profile_spec, profile_dict

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
        ({"base": "h200", "link": {"latency_s": "fast"}}, r"link.latency_s must be a finite number; got 'fast'"),
        ({"base": "h200", "gpu": {"first_use_s": float("inf")}}, r"gpu.first_use_s must be a finite number; got inf"),
        ({"base": "h200", "gpu": {"thread_setup_s": -1}}, r"gpu.thread_setup_s must be zero or more; got -1"),
        ({"base": "h200", "gpu": {"flops_per_s": {"float32": float("nan")}}}, r"gpu.flops_per_s.float32 must be a finite number; got nan"),
        (42, r"eugo.profile must be a preset name"),
    ],
)
def test_bad_profiles_raise_clear_errors(spec, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(spec)


@pytest.mark.parametrize("number", [np.float32(5e9), np.int64(5_000_000_000), np.float64(5e9),
                                    np.longdouble(5e9)])
def test_numpy_numbers_are_numbers(number):
    # a rate worked out with NumPy is a number like any other, in the check and the cache key
    spec = {"base": "h200", "link": {"h2d_bytes_per_s": number}}
    check_profile_spec(spec)
    assert load_profile(spec).link.h2d_bytes_per_s == 5e9
    assert type(load_profile(spec).link.h2d_bytes_per_s) is float
    with pytest.raises(ProfileError, match=r"link.h2d_bytes_per_s must be a positive number; got -1.0"):
        load_profile({"base": "h200", "link": {"h2d_bytes_per_s": np.float32(-1)}})
    with pytest.raises(ProfileError, match=r"link.latency_s must be a finite number; got np.True_"):
        load_profile({"base": "h200", "link": {"latency_s": np.True_}})


def test_a_mapping_of_another_type_is_a_mapping():
    from types import MappingProxyType

    spec = {"base": "h200", "link": MappingProxyType({"h2d_bytes_per_s": 5e9})}
    check_profile_spec(spec)
    assert load_profile(spec).link.h2d_bytes_per_s == 5e9


def test_malformed_profile_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gpu: [unclosed\n")
    with pytest.raises(ProfileError, match="is not valid YAML/JSON"):
        load_profile(str(path))


def test_local_cpu_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = measure.measure_local_cpu

    def counting():  # a clean reading (one measured on a loaded machine is not cached: below)
        calls.append(1)
        data = real()
        data.pop("warnings", None)
        return data

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


def test_the_local_cpu_section_is_handed_in_not_measured_by_the_profile():
    """Loading a profile without a cpu section measures nothing itself: the caller hands in
    what gives the local CPU's figures (eugo_dask.load_profile hands in the cached measurement),
    asked to check a cached reading with the profile's own validation; without one it says so."""
    asked = []

    def local_cpu(*, accept):
        asked.append(accept)
        return CPU

    spec = {"base": "h200", "name": "no-cpu"}
    p = profile_mod.load_profile(spec, local_cpu=local_cpu)
    assert p.cpu.threads == CPU["threads"] and len(asked) == 1
    assert asked[0](CPU) and not asked[0]({"threads": "many"})
    with pytest.raises(ProfileError, match="no cpu section"):
        profile_mod.load_profile({**spec, "name": "no-cpu-2"})


def test_a_cpu_reading_with_warnings_serves_its_process_only(tmp_path, monkeypatch):
    """Measured while other processes took the core, a reading says so and is not cached: the
    next process measures again; one cached before this rule (with warnings) is measured again
    too. A bad minute priced every plan on the machine for good (float64 read at a tenth of
    float32)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    readings = iter([{"measured": 1, "warnings": ["this process had 30% of a core"]},
                     {"measured": 2, "warnings": ["load average 9.0 on 2 cores"]},
                     {"measured": 3}])
    monkeypatch.setattr(measure, "measure_local_cpu", lambda: next(readings))
    assert measure.cached_local_cpu()["measured"] == 1
    assert not measure.cpu_cache_path().exists()
    measure.cpu_cache_path().parent.mkdir(parents=True, exist_ok=True)
    measure.cpu_cache_path().write_text(json.dumps({"measured": 0, "warnings": ["unstable"]}))
    assert measure.cached_local_cpu()["measured"] == 2  # the cached bad reading measured again
    assert measure.cached_local_cpu()["measured"] == 3  # a clean one: cached, and read back
    assert measure.cached_local_cpu()["measured"] == 3


class Spinners:
    """Processes spinning on every core this process may use, three per core."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.procs += [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                       for _ in range(3 * (cores or 1))]
        time.sleep(0.5)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)


def test_a_core_shared_with_busy_processes_is_noticed():
    """Other processes spinning on every core this process may use: the share of a core the
    measuring thread gets drops, and a measurement then carries the warning."""
    spinners = Spinners()
    try:
        spinners.start()
        share = min(measure.cpu_share(0.3) for _ in range(3))
    finally:
        spinners.stop()
    assert share < measure.CONTENDED_SHARE
    assert "of a core while measuring" in measure.contention_warning(share)


def test_a_core_taken_only_while_the_rates_are_measured_is_noticed():
    """Other processes spin on every core from the first rate measured to the last (not
    during the two short share readings before and after): the probe's rates are low (float64
    matmul read at a tenth of its idle rate here) and the reading must say so, or
    cached_local_cpu keeps it for good. (Review of b45f44b: the share is read only at the
    probe's two ends, so contention between them goes unseen.)"""
    spinners = Spinners()

    def progress(message: str) -> None:
        if message == "cpu: matmul":  # after the share read before
            spinners.start()
        elif message.startswith("cpu: per-task overhead"):  # before the share read after
            spinners.stop()

    try:
        section = measure.measure_cpu(level="probe", progress=progress)
    finally:
        spinners.stop()
    assert spinners.procs  # the rates were measured while they spun
    assert section.get("warnings"), section["matmul_flops_per_s"]


def test_a_poisoned_cpu_cache_is_measured_again(tmp_path, monkeypatch):
    # nesting past Python's recursion limit raised RecursionError out of every profile load
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = measure.cpu_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("[" * 100_000 + "]" * 100_000)
    monkeypatch.setattr(measure, "measure_local_cpu", lambda: {"measured": True})
    assert measure.cached_local_cpu() == {"measured": True}
    assert json.loads(path.read_text()) == {"measured": True}  # and cached in its place


# ---------------------------------------------------------------------------------------------
# CUDA device models -> presets (exact names, memory from the device)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"), ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA L40", "l40s"), ("Tesla T4", "t4"),
    ("NVIDIA GH200 480GB", "gh200"), (" NVIDIA GH200 144G HBM3e ", "gh200"),
])
def test_device_models_match_exactly(name, preset):
    from eugo_dask.profile import preset_for_device

    spec, known = preset_for_device(name, memory_bytes=4.2e10, count=2)
    assert known and spec["base"] == preset
    p = load_profile({**spec, "cpu": "server-x86"})
    assert (p.gpu.memory_bytes, p.gpu.count) == (4.2e10, 2)  # read from the device


def test_look_alike_models_are_not_priced_as_each_other():
    from eugo_dask.profile import preset_for_device

    def gpu(name):
        spec, _ = preset_for_device(name, memory_bytes=4.8e10)
        return load_profile({**spec, "cpu": "server-x86"})

    l4, l40s, l40 = gpu("NVIDIA L4"), gpu("NVIDIA L40S"), gpu("NVIDIA L40")
    assert l40s.gpu.flops_per_s.float32 > 2.5 * l4.gpu.flops_per_s.float32
    assert l40.gpu.matmul_flops_per_s.float16 == pytest.approx(l40s.gpu.matmul_flops_per_s.float16 / 2)
    gh200, h200 = gpu("NVIDIA GH200 480GB"), gpu("NVIDIA H200")
    assert "NVLink-C2C" in gh200.link.name and gh200.link.pinned_h2d_bytes_per_s > 5 * h200.link.pinned_h2d_bytes_per_s
    a100_40 = load_profile({**preset_for_device("NVIDIA A100-SXM4-40GB", memory_bytes=4.0e10)[0],
                            "cpu": "server-x86"})
    assert a100_40.gpu.memory_bytes == 4.0e10 and a100_40.gpu.memory_bandwidth_bytes_per_s == 1.555e12
    spec, known = preset_for_device("NVIDIA RTX 6000 Ada Generation", memory_bytes=5.1e10)
    assert not known and spec["base"] == "t4"
    assert spec["gpu"] == {"name": "NVIDIA RTX 6000 Ada Generation (unknown model, priced as the "
                                   "slowest preset, t4)", "memory_bytes": 5.1e10}


def _preset_gpus():
    from eugo_dask.profile import PRESETS

    return {name: load_profile({"base": name, "cpu": "server-x86"}).gpu for name in PRESETS}


def test_an_unknown_model_is_priced_as_the_slowest_preset_never_a_faster_one():
    """Before, any model without a preset was priced as a full H200 (the fastest but two)."""
    from eugo_dask.profile import UNKNOWN_DEVICE_PRESET, preset_for_device

    gpus = _preset_gpus()
    slowest = gpus[UNKNOWN_DEVICE_PRESET]
    for rates in ("flops_per_s", "matmul_flops_per_s"):
        assert getattr(slowest, rates).float32 == min(getattr(g, rates).float32 for g in gpus.values())
    spec, known = preset_for_device("NVIDIA Some Future GPU", memory_bytes=1e10)
    unknown = load_profile({**spec, "cpu": "server-x86"})
    assert not known and unknown.gpu.flops_per_s == slowest.flops_per_s
    assert unknown.link == load_profile({"base": "t4", "cpu": "server-x86"}).link


def test_an_unknown_model_is_priced_from_its_attributes():
    from eugo_dask.profile import gpu_figures_from_attributes, preset_for_device

    # an A10G as CUDA describes it: 80 SMs at 1.71 GHz, GDDR6 at 6.25 GHz on a 384-bit bus, 8.6
    a10g = {"multiprocessors": 80, "clock_khz": 1_710_000, "memory_clock_khz": 6_251_000,
            "memory_bus_bits": 384, "compute_capability": (8, 6)}
    spec, known = preset_for_device("NVIDIA A10G-like", memory_bytes=2.4e10, attributes=a10g)
    gpu = load_profile({**spec, "cpu": "server-x86"}).gpu
    assert not known and "priced from its attributes" in gpu.name
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(600e9, rel=0.01)  # AWS: 600 GB/s
    assert gpu.flops_per_s.float32 == pytest.approx(80 * 128 * 2 * 1.71e9)  # 35 TFLOPS
    assert gpu.flops_per_s.float64 == pytest.approx(gpu.flops_per_s.float32 / 64)
    # the attributes of known models give about their datasheets' peaks
    h100 = gpu_figures_from_attributes({"multiprocessors": 132, "clock_khz": 1_980_000,
                                        "memory_clock_khz": 2_619_000, "memory_bus_bits": 5120,
                                        "compute_capability": (9, 0)})
    assert h100["memory_bandwidth_bytes_per_s"] == pytest.approx(3.35e12, rel=0.01)
    assert h100["flops_per_s"]["float64"] == pytest.approx(33.5e12, rel=0.01)
    assert h100["matmul_flops_per_s"]["float16"] == pytest.approx(1.07e15, rel=0.1)
    assert gpu_figures_from_attributes({}) == {}


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"), ("NVIDIA A10", "a10"), ("NVIDIA A10G", "a10"),
    ("Tesla V100-SXM2-32GB", "v100"), ("Tesla V100-PCIE-16GB", "v100"),
])
def test_new_presets_are_matched(name, preset):
    from eugo_dask.profile import preset_for_device

    spec, known = preset_for_device(name, memory_bytes=1.6e10)
    gpu = load_profile({**spec, "cpu": "server-x86"}).gpu
    assert known and spec["base"] == preset and gpu.memory_bytes == 1.6e10
    assert gpu.first_use_s and gpu.thread_setup_s  # presets charge a device's start


def test_new_presets_rank_as_their_datasheets():
    gpus = _preset_gpus()
    assert gpus["b200"].matmul_flops_per_s.float16 > gpus["h200"].matmul_flops_per_s.float16 > \
        gpus["a10"].matmul_flops_per_s.float16
    assert gpus["v100"].flops_per_s.float64 > gpus["a10"].flops_per_s.float64  # V100: full float64
    assert all(g.first_use_s and g.thread_setup_s for g in gpus.values())


def test_a_mig_slice_is_priced_by_its_share():
    from eugo_dask.profile import preset_for_device

    full = load_profile({"base": "a100", "cpu": "server-x86", "gpu": {"memory_bandwidth_bytes_per_s": 1.555e12}}).gpu
    spec, known = preset_for_device("NVIDIA A100-SXM4-40GB MIG 1g.5gb", memory_bytes=4.9e9)
    gpu = load_profile({**spec, "cpu": "server-x86"}).gpu
    assert known and spec["base"] == "a100" and "MIG 1g.5gb" in gpu.name
    assert gpu.flops_per_s.float32 == pytest.approx(full.flops_per_s.float32 / 7)
    assert gpu.matmul_flops_per_s.float16 == pytest.approx(full.matmul_flops_per_s.float16 / 7)
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(full.memory_bandwidth_bytes_per_s * 5 / 80)
    assert gpu.memory_bytes == 4.9e9
    three = load_profile({**preset_for_device("NVIDIA H200 MIG 3g.71gb")[0], "cpu": "server-x86"}).gpu
    h200 = load_profile({"base": "h200", "cpu": "server-x86"}).gpu
    assert three.flops_per_s.float64 == pytest.approx(h200.flops_per_s.float64 * 3 / 7)


def test_auto_profile_reads_the_local_device(monkeypatch, caplog):
    import logging

    from eugo_dask import config

    monkeypatch.setattr(config, "cupy_device_name", lambda: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(config, "cupy_device_memory", lambda: 42_505_273_344)
    monkeypatch.setattr(config, "cupy_device_count", lambda: 4)
    spec = config.resolve_profile("auto", "cupy")
    assert spec["base"] == "a100" and spec["gpu"]["memory_bytes"] == 42_505_273_344
    assert spec["gpu"]["count"] == 1  # a process drives one GPU
    with dask.config.set({"eugo.gpus-per-process": "all"}):
        assert config.resolve_profile("auto", "cupy")["gpu"]["count"] == 4
    assert config.resolve_profile("auto", "emulated") == "h200"
    assert config.resolve_profile("t4", "cupy") == "t4"
    monkeypatch.setattr(config, "cupy_device_name", lambda: "NVIDIA X999")
    monkeypatch.setattr(config, "cupy_device_attributes", lambda: {"multiprocessors": 10})
    with caplog.at_level(logging.WARNING, logger="eugo_dask.config"):
        assert config.resolve_profile("auto", "cupy")["base"] == "t4"
    assert "no preset for the CUDA device 'NVIDIA X999'" in caplog.text and "eugo-dask calibrate" in caplog.text
    monkeypatch.setattr(config, "cupy_device_attributes", lambda: {
        "multiprocessors": 10, "clock_khz": 1_000_000, "compute_capability": (8, 6)})
    gpu = config.resolve_profile("auto", "cupy")["gpu"]
    assert gpu["flops_per_s"]["float32"] == pytest.approx(10 * 128 * 2 * 1e9)


@pytest.mark.parametrize("name", PRESETS)
def test_float16_elementwise_is_not_priced_above_float32(name):
    # CuPy's elementwise kernels compute float16 math in float32 (no half2 packing)
    g = load_profile({"base": name, "cpu": "server-x86"}).gpu
    assert g.flops_per_s.float16 == g.flops_per_s.float32
    assert g.matmul_flops_per_s.float16 > g.matmul_flops_per_s.float32  # tensor cores do


def test_spec_sheet_figures_that_were_off():
    assert load_profile({"base": "l4", "cpu": "server-x86"}).gpu.flops_per_s.float16 == 3.03e13
    a100 = load_profile({"base": "a100", "cpu": "server-x86"}).gpu
    assert a100.matmul_flops_per_s.float16 == 3.12e14 and a100.memory_bandwidth_bytes_per_s == 2.039e12


def test_measured_gpu_figures_get_no_efficiency_factors():
    import numpy as np

    from eugo_dask.cost_model import Op, Step, estimate_step
    from eugo_dask.graph import ArraySpec
    from eugo_dask.ops import ELEMENTWISE, FFT, MATMUL

    spec = load_profile({"base": "h200", "cpu": "server-x86"})
    measured = load_profile({"base": "h200", "cpu": "server-x86",
                             "gpu": {"measured": True, "fft_flops_per_s": {"float32": 1e13, "float64": 5e12}}})
    big = ArraySpec((4096, 4096), np.dtype("float64"))
    for step in (Step(Op(ELEMENTWISE, "add", 2), (big, big), big),
                 Step(Op(MATMUL, "matmul", 2), (big, big), big, 2 * 4096**3)):
        _, _, spec_s = estimate_step(step, big.size, big.dtype, spec)
        _, _, measured_s = estimate_step(step, big.size, big.dtype, measured)
        assert measured_s < spec_s * 0.85
    fft = Step(Op(FFT, "fft", 1), (big,), ArraySpec(big.shape, np.dtype("complex128")), 5e9)
    _, _, fft_s = estimate_step(fft, big.size, big.dtype, measured)
    assert fft_s >= 5e9 / 5e12  # the measured FFT rate, not a share of the sin rate
    with pytest.raises(ProfileError, match=r"gpu.measured must be true or false; got 'yes'"):
        load_profile({"base": "h200", "cpu": "server-x86", "gpu": {"measured": "yes"}})


def test_presets_are_parsed_once_and_handed_out_as_copies(monkeypatch):
    parses = []
    real = profile_mod.yaml.safe_load
    monkeypatch.setattr(profile_mod.yaml, "safe_load", lambda text: parses.append(1) or real(text))
    profile_mod._parse_packaged.cache_clear()
    first = profile_dict("h200")
    first["gpu"]["name"] = "changed by a caller"
    first["link"]["h2d_bytes_per_s"] = 1.0
    again = profile_dict("h200")
    assert again["gpu"]["name"] == "NVIDIA H200 SXM 141GB" and again["link"]["h2d_bytes_per_s"] == 8.3e9
    profile_dict({"base": "h200", "name": "mine"})
    assert len(parses) == 1


def test_profile_file_edited_with_its_modification_time_kept_is_reloaded(tmp_path):
    """cp -p, rsync -t and tar x keep a file's modification time: the edit still counts."""
    import os

    full = {**profile_dict("h200"), "cpu": CPU}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(full))
    first = load_profile(str(path)).link.h2d_bytes_per_s
    kept = os.stat(path)
    full["link"]["h2d_bytes_per_s"] = first / 4
    path.write_text(yaml.safe_dump(full))
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == kept.st_mtime_ns
    assert load_profile(str(path)).link.h2d_bytes_per_s == first / 4


def test_a_profile_mapping_that_contains_itself_is_a_profile_error():
    spec: dict = {"base": "h200"}
    spec["link"] = spec
    with pytest.raises(ProfileError, match="must be plain data"):
        load_profile(spec)


def test_a_profiles_tables_are_read_only_and_still_pickle():
    # one Profile object serves every pass of the process: changing its table in place would
    # change every plan made after
    import copy
    import pickle

    table = {"float64": {"matmul": [[512, 1 / 20e9], [2048, 1 / 50e9]], "exp": 2e-9}}
    import eugo_dask

    server = yaml.safe_load((Path(eugo_dask.__file__).parent / "profiles" / "server-x86.cpu.yaml")
                            .read_text())
    spec = {"base": "h200", "cpu": {**server, "matmul_s_per_flop": table}}
    profile = load_profile(spec)
    loaded = profile.cpu.matmul_s_per_flop
    with pytest.raises(TypeError, match="read-only"):
        loaded["float64"]["matmul"] = ((1, 1.0),)
    with pytest.raises(TypeError, match="read-only"):
        loaded["float32"] = {}
    with pytest.raises(TypeError, match="read-only"):
        loaded["float64"].update(exp=1.0)
    assert load_profile(spec).cpu.matmul_s_per_flop == {
        "float64": {"matmul": ((512, 1 / 20e9), (2048, 1 / 50e9)), "exp": 2e-9}}
    again = pickle.loads(pickle.dumps(profile))
    assert again == profile and type(again.cpu.matmul_s_per_flop["float64"]) is type(loaded)
    assert copy.deepcopy(profile) == profile
    assert json.loads(json.dumps(loaded)) == {
        "float64": {"matmul": [[512, 1 / 20e9], [2048, 1 / 50e9]], "exp": 2e-9}}
    # its dict form is plain data of the caller's own: YAML writes it, the caller edits it
    mine = profile.to_dict()
    mine["cpu"]["matmul_s_per_flop"]["float64"] = {"matmul": 1e-12}
    assert yaml.safe_load(yaml.safe_dump(mine))["cpu"]["matmul_s_per_flop"] == {
        "float64": {"matmul": 1e-12}}
    assert load_profile(spec).cpu.matmul_s_per_flop["float64"]["exp"] == 2e-9


# ---------------------------------------------------------------------------------------------
# Per-size copy rates (link.copies_by_size)
# ---------------------------------------------------------------------------------------------
MiB = 1 << 20
COPIES = {
    "h2d": [{"bytes": MiB, "bytes_per_s": 4e9, "path": "direct"},
            {"bytes": 16 * MiB, "bytes_per_s": 2e10, "path": "staged", "threads": 8,
             "measured": {"staged-1": 9e9, "staged-8": 2e10, "registered": 1.5e10, "dma": 5e10}},
            {"bytes": 256 * MiB, "bytes_per_s": 3e10, "path": "registered"}],
    "d2h": [{"bytes": 16 * MiB, "bytes_per_s": 3.5e10, "path": "pinned"}],
}


def test_per_size_copy_rates_load_and_interpolate_in_log_size():
    p = load_profile({"base": "h200", "cpu": "server-x86", "link": {"copies_by_size": COPIES}})
    copies = p.link.copies_by_size
    assert [(c.bytes, c.path, c.threads) for c in copies.h2d] == [
        (MiB, "direct", None), (16 * MiB, "staged", 8), (256 * MiB, "registered", None)]
    assert copies.h2d[1].measured["dma"] == 5e10
    assert copies.bytes_per_s("h2d", 4 * MiB) == pytest.approx(1.2e10)  # half way in log size
    assert copies.bytes_per_s("h2d", 64 * MiB) == pytest.approx(2.5e10)
    assert copies.bytes_per_s("h2d", 1024) == 4e9 and copies.bytes_per_s("h2d", 1 << 40) == 3e10  # flat
    assert copies.bytes_per_s("d2h", 1) == copies.bytes_per_s("d2h", 1 << 40) == 3.5e10
    assert load_profile({"base": "h200", "cpu": "server-x86"}).link.copies_by_size is None
    assert all(profile_dict(name)["link"].get("copies_by_size") is None for name in PRESETS)
    # what calibration writes comes back as written; the profile still pickles and compares
    import pickle

    assert pickle.loads(pickle.dumps(p)) == p
    assert p.to_dict()["link"]["copies_by_size"]["h2d"][1] == {**COPIES["h2d"][1]}
    with pytest.raises(TypeError, match="read-only"):
        copies.h2d[1].measured["dma"] = 1.0


def _copies_with(direction, i, change, message):
    """A profile whose point ``i`` that way has ``change`` (None: the field removed), and the
    message that names it."""
    table = json.loads(json.dumps(COPIES))
    table[direction][i].update(change)
    for key in [k for k, v in change.items() if v is None]:
        del table[direction][i][key]
    where = rf"link.copies_by_size.{direction}\[{i}\]"
    return {"base": "h200", "link": {"copies_by_size": table}}, message.format(where=where)


_STAGED = "must be a whole number from 1 to 64 for a staged copy"


@pytest.mark.parametrize("spec, match", [
    ({"base": "h200", "link": {"copies_by_size": [1]}},
     r"eugo.profile: link.copies_by_size must be a mapping with fields \['d2h', 'h2d'\] \(either or both\); got \[1\]"),
    ({"base": "h200", "link": {"copies_by_size": {"up": []}}},
     r"link.copies_by_size has unknown field\(s\) \['up'\]; allowed: \['d2h', 'h2d'\]"),
    ({"base": "h200", "link": {"copies_by_size": {"h2d": {"bytes": 1}}}},
     r"link.copies_by_size.h2d must be a list of points \{bytes, bytes_per_s, path\[, threads\]\[, measured\]\}"),
    *(_copies_with(*case) for case in [
        ("h2d", 1, {"path": "pinned", "threads": None},
         r"{where}.path must be one of \['direct', 'registered', 'staged'\]; got 'pinned'"),
        ("d2h", 0, {"path": "registered"}, r"{where}.path must be one of \['direct', 'pinned', 'staged'\]; got 'registered'"),
        ("h2d", 1, {"threads": None}, rf"{{where}}.threads {_STAGED}; got None"),
        ("h2d", 1, {"threads": 65}, rf"{{where}}.threads {_STAGED}; got 65"),
        ("h2d", 2, {"threads": 4}, r"{where}.threads is a staged copy's; path 'registered' has none; got 4"),
        ("h2d", 1, {"bytes": MiB},
         r"{where}.bytes must be larger than the point's before \(1048576\): sizes increase; got 1048576"),
        ("h2d", 0, {"bytes": 0.5}, r"{where}.bytes must be a whole number >= 1; got 0.5"),
        ("d2h", 0, {"bytes_per_s": 0}, r"{where}.bytes_per_s must be a positive number; got 0"),
        ("d2h", 0, {"bytes_per_s": None}, r"'{where}.bytes_per_s' is missing"),
        ("d2h", 0, {"speed": 1}, r"{where} has unknown field\(s\) \['speed'\]"),
        ("h2d", 1, {"measured": {"dma": "fast"}}, r"{where}.measured.dma must be a finite number; got 'fast'"),
        ("h2d", 1, {"measured": [1]}, r"{where}.measured must map path names to rates; got \[1\]"),
    ]),
])
def test_bad_per_size_copies_name_the_field(spec, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(spec)
    with pytest.raises(ProfileError, match=match):  # as the runtime reads them, too
        profile_mod.copies_by_size(spec)


def test_per_size_copies_are_read_without_the_cpu_and_follow_the_file(tmp_path):
    """What the runtime reads of a profile: its per-size copies, the CPU section neither read nor
    measured (a profile without one is a worker's usual), the file read again once edited."""
    path = tmp_path / "calibrated.yaml"
    data = {**profile_dict("h200"), "link": {**profile_dict("h200")["link"], "copies_by_size": COPIES}}
    path.write_text(yaml.safe_dump(data))
    assert "cpu" not in data
    assert profile_mod.copies_by_size(str(path)).h2d[2].path == "registered"
    data["link"]["copies_by_size"] = {"h2d": [{"bytes": MiB, "bytes_per_s": 1e9, "path": "direct"}]}
    path.write_text(yaml.safe_dump(data))
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    again = profile_mod.copies_by_size(path)
    assert [p.path for p in again.h2d] == ["direct"] and again.d2h == ()
    assert profile_mod.copies_by_size("h200") is None
    assert profile_mod.copies_by_size({"base": "h200"}) is None
