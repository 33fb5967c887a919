"""Calibration writes a profile the planner accepts; the CLI and Dask's CLI both reach it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
import yaml

import eugo_dask
from eugo_dask import load_profile
from eugo_dask.calibrate import calibrate
from eugo_dask.devices import cupy_device_count
from eugo_dask.measure import _fit_inverse
from eugo_dask.profile import validate_profile_dict

DASK_CLI = str(Path(sys.executable).with_name("dask"))
EUGO_CLI = str(Path(sys.executable).with_name("eugo-dask"))


@pytest.fixture(scope="module")
def quick_profile():
    messages = []
    profile = calibrate(quick=True, progress=messages.append)
    return profile, messages


def test_quick_calibration_is_a_valid_profile(quick_profile):
    profile, messages = quick_profile
    validate_profile_dict(profile)  # raises on anything malformed
    cpu = profile["cpu"]
    assert cpu["threads"] >= 1 and cpu["task_overhead_s"] > 0
    assert cpu["matmul_flops_per_s"]["float32"] > cpu["flops_per_s"]["float32"] / 100
    assert set(cpu["elementwise_s_per_element"]["float64"]) == {"add", "divide", "sqrt", "exp", "sin", "power"}
    # the chunk sizes that matter: matmul up to 2048², elementwise up to 2^23 elements
    assert [n for n, _ in cpu["matmul_s_per_flop"]["float64"]["matmul"]][-1] == 2048
    assert cpu["elementwise_s_per_element"]["float64"]["add"][-1][0] == 1 << 23
    if cupy_device_count():  # the GPU and its link measured here, under the device's name
        assert profile["name"] == "calibrated" and "not measured" not in profile["source"]
        assert profile["link"]["h2d_bytes_per_s"] > 0
    else:  # no CUDA device here: the GPU side comes from the preset and says so
        assert profile["name"] == "h200-calibrated-cpu" and "not measured" in profile["source"]
        assert profile["gpu"]["name"].startswith("NVIDIA H200")
    assert any("matmul" in m for m in messages) and messages[-1].startswith("done in")


def test_calibration_measures_the_configured_copy_path(quick_profile, monkeypatch):
    """Where a GPU is measured, its copies run with the device settings in force (pinned
    results, registration and threads as set, per size where auto), as the runtime's do; the
    link's name says which path."""
    from eugo_dask import calibrate as calibrate_module
    from eugo_dask.devices import DeviceSettings
    from eugo_dask.measure import _copy_path

    profile, _ = quick_profile
    seen = []
    monkeypatch.setattr(calibrate_module, "cupy_device_count", lambda: 1)
    monkeypatch.setattr(calibrate_module, "measure_cpu", lambda **_: profile["cpu"])
    monkeypatch.setattr(calibrate_module, "measure_gpu",
                        lambda **kw: seen.append(kw.get("settings")) or (profile["gpu"], profile["link"]))
    with dask.config.set({"eugo.pinned-results-min": "16 MiB", "eugo.register-in-place": "256 MiB"}):
        assert calibrate(quick=True, progress=lambda _: None)["name"] == "calibrated"
    assert (seen[0].pinned_results_min_bytes, seen[0].register_min_bytes) == (16 << 20, 256 << 20)
    assert _copy_path(seen[0]) == ("eugo's copies: 8 MiB pinned staging buffers, results of 16 MiB or "
                                   "more into pinned blocks, chunks of 256 MiB or more page-locked in place, "
                                   "staging threads measured best per size")
    assert _copy_path(DeviceSettings(pinned_results_bytes=0)) == (
        "eugo's copies: 8 MiB pinned staging buffers, 4 staging threads")
    with dask.config.set({"eugo.copy-threads": 2}):
        calibrate(quick=True, progress=lambda _: None)
    assert _copy_path(seen[1]) == ("eugo's copies: 8 MiB pinned staging buffers, results back by the path "
                                   "measured best per size, chunks to the device by the path measured best "
                                   "per size, 2 staging threads")


def test_calibrated_profile_prices_tasks(quick_profile, tmp_path):
    profile, _ = quick_profile
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    loaded = load_profile(str(path))
    assert loaded.cpu.elementwise_seconds("cos", np.float64, 10**6) > 0  # sin's class
    assert loaded.cpu.elementwise_seconds("sin", np.float64, 10**6) > loaded.cpu.elementwise_seconds(
        "add", np.float64, 10**6)
    x = da.ones((2000, 2000), chunks=1000)
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": str(path)}):
        plan = eugo_dask.explain(np.sin(x) @ x)
    assert plan.profile_name == profile["name"] and len(plan) > 0


def test_fit_recovers_peak_and_half():
    points = [(n, 100.0 * n / (n + 64)) for n in (32, 64, 128, 512, 2048)]
    peak, half = _fit_inverse(points)
    assert peak == pytest.approx(100.0, rel=1e-6) and half == pytest.approx(64, rel=1e-6)


@pytest.mark.parametrize("cli", [[EUGO_CLI], [DASK_CLI, "eugo"]], ids=["eugo-dask", "dask-eugo"])
def test_cli_calibrate_writes_profile(cli, tmp_path):
    out = tmp_path / "profile.json"
    result = subprocess.run([*cli, "calibrate", "--quick", "-o", str(out)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cpu: matmul" in result.stderr  # progress
    validate_profile_dict(json.loads(out.read_text()))
    assert load_profile(str(out)).cpu.threads >= 1


def test_cli_rejects_unknown_gpu_preset(tmp_path):
    result = subprocess.run([EUGO_CLI, "calibrate", "--quick", "--gpu-preset", "h300", "-o",
                             str(tmp_path / "p.yaml")], capture_output=True, text=True)
    assert result.returncode != 0
    assert "must be one of" in result.stderr and "h300" in result.stderr


def test_cli_explain(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text("import dask.array as da\nx = (da.ones((400, 400), chunks=200) @ da.ones((400, 400), chunks=200)).sum()\n")
    result = subprocess.run([EUGO_CLI, "explain", f"{script}:x", "--json", "--profile", "h200"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["profile"] == "h200" and plan["tasks"]


def test_one_cpu_measurer_at_three_levels():
    from eugo_dask.measure import SIZES, measure_cpu, measure_local_cpu

    probe = measure_local_cpu()
    assert "(probe)" in probe["source"]
    assert [n for n, _ in probe["matmul_s_per_flop"]["float64"]["matmul"]] == list(SIZES["probe"]["matmul"])
    assert SIZES["full"]["matmul"][-1] == 4096
    with pytest.raises(ValueError, match=r"level must be one of \['probe', 'quick', 'full'\]; got 'fast'"):
        measure_cpu(level="fast")


def test_unstable_rounds_are_measured_again_then_reported():
    from eugo_dask.measure import Stability

    messages = []
    steady = Stability(messages.append, rounds=2, pause_s=0)
    assert steady.rate("steady", iter([100.0, 110.0]).__next__) == 110.0
    assert steady.warnings == [] and steady.summary() is None
    noisy = Stability(messages.append, rounds=2, pause_s=0)
    values = iter([1.0, 260.0, 274.0])  # one round while another process was busy
    assert noisy.rate("matmul", values.__next__) == 274.0  # an extra round, and it agrees
    assert noisy.warnings == []
    flaky = Stability(messages.append, rounds=2, pause_s=0)
    values = iter([1.38, 274.0, 3.0, 250.0])
    flaky.rate("matmul 2048² float64", values.__next__)
    assert flaky.warnings == ["matmul 2048² float64 unstable: 4 rounds ranged 1.38 to 274/s (198.6x), took the best"]
    assert "calibrate again on an idle machine" in flaky.summary()
    assert messages[-1].startswith("warning: matmul 2048² float64 unstable")
    spent = Stability(messages.append, rounds=2, pause_s=0, retry_budget_s=0)
    values = iter([1.0, 100.0])
    assert spent.rate("no time left", values.__next__) == 100.0  # no extra round past the budget
    assert spent.warnings[-1].startswith("no time left unstable: 2 rounds")


def test_calibrated_matmul_table_prices_large_chunks():
    from eugo_dask.cost_model import Op, Step, estimate_step
    from eugo_dask.graph import ArraySpec
    from eugo_dask.ops import MATMUL

    table = {"float64": {"matmul": [[512, 1 / 20e9], [1024, 1 / 40e9], [2048, 1 / 50e9]]},
             "float32": {"matmul": [[512, 1 / 40e9], [2048, 1 / 100e9]]}}
    profile = load_profile({"base": "h200", "cpu": {**_SERVER, "matmul_s_per_flop": table}})
    for n, rate in ((1024, 40e9), (4096, 50e9)):  # measured; past the largest size: held flat
        spec = ArraySpec((n, n), np.dtype("float64"))
        flops, cpu_s, _ = estimate_step(Step(Op(MATMUL, "matmul", 2), (spec, spec), spec, 2.0 * n**3),
                                        n * n, spec.dtype, profile)
        assert cpu_s == pytest.approx(flops / rate, rel=0.01)


_SERVER = yaml.safe_load((Path(eugo_dask.__file__).parent / "profiles" / "server-x86.cpu.yaml").read_text())


# ---------------------------------------------------------------------------------------------
# The copy paths, measured by size (on the stand-in CuPy: sizes cut to kilobytes)
# ---------------------------------------------------------------------------------------------
KB = 1024


@pytest.fixture
def stand_in(monkeypatch):
    import os

    from eugo_dask.devices import CupyDevice

    from . import fake_cupy

    module = fake_cupy.module(device_count=1)
    for name, value in (("cupy", module), ("cupy.fft", module.fft), ("cupy.fft.config", module.fft.config)):
        monkeypatch.setitem(sys.modules, name, value)
    fake_cupy.reset()
    monkeypatch.setattr(CupyDevice, "direct_copy_bytes", 16 * KB)  # straight up to 16 kB
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    return module, fake_cupy


def _measure(module, settings, sizes=(16 * KB, 256 * KB, 1024 * KB)):
    from eugo_dask.measure import measure_link

    messages = []
    return measure_link(module, settings, sizes=sizes, repeat=1, progress=messages.append), messages


def test_calibration_measures_every_path_at_every_size_and_keeps_the_best(stand_in):
    """Copy keys at auto: at each size each way every path the runtime can take (straight,
    staged on 1, 2, 4 and 8 threads, registered in place / pinned results) and raw DMA; the
    point is the fastest's, a valid link.copies_by_size; up to the direct size only the
    direct copy (the runtime takes nothing else there)."""
    from eugo_dask.config import configured_device_settings
    from eugo_dask.devices import DeviceSettings

    module, _ = stand_in
    settings = replace(configured_device_settings(), staging_bytes=64 * KB, copy_piece_bytes=16 * KB)
    assert settings.per_size == {"threads", "h2d", "d2h"}
    link, messages = _measure(module, settings)
    copies = link["copies_by_size"]
    assert [p["bytes"] for p in copies["h2d"]] == [16 * KB, 256 * KB, 1024 * KB]
    assert set(copies["h2d"][0]["measured"]) == {"direct", "dma"} == set(copies["d2h"][0]["measured"])
    staged = {"staged-1", "staged-2", "staged-4", "staged-8"}
    assert set(copies["h2d"][1]["measured"]) == {"direct", "registered", "dma"} | staged
    assert set(copies["d2h"][2]["measured"]) == {"direct", "pinned", "dma"} | staged
    for way in ("h2d", "d2h"):
        for point in copies[way]:
            rates = {k: v for k, v in point["measured"].items() if k != "dma"}
            best = max(rates, key=rates.get)
            assert point["bytes_per_s"] == rates[best]
            assert best == (f"staged-{point['threads']}" if point["path"] == "staged" else point["path"])
            assert ("threads" in point) == (point["path"] == "staged")
    assert link["latency_s"] > 0 and len(link["dma"]["h2d"]) == 3
    validate_profile_dict({"name": "c", "gpu": _H200["gpu"], "link": {**_H200["link"], "copies_by_size": copies},
                           "cpu": _SERVER})
    assert len(messages) == 3 and "of DMA" in messages[-1]
    # explicit keys are measured as set: the runtime takes them whatever the profile says
    fixed = replace(settings, per_size=frozenset(), copy_threads=2, register_min_bytes=512 * KB,
                    pinned_results_min_bytes=2048 * KB)
    link, _ = _measure(module, fixed)
    assert [set(p["measured"]) - {"dma"} for p in link["copies_by_size"]["h2d"]] == [
        {"direct"}, {"staged-2"}, {"registered"}]
    assert [p["path"] for p in link["copies_by_size"]["d2h"]] == ["direct", "staged", "staged"]
    no_pool = replace(settings, pinned_results_bytes=0)
    link, _ = _measure(module, no_pool, sizes=(256 * KB,))
    assert "pinned" not in link["copies_by_size"]["d2h"][0]["measured"]
    assert DeviceSettings().per_size == frozenset()  # a device made without config: as configured


def test_a_path_that_was_not_taken_is_not_recorded(stand_in):
    """Where CUDA refuses to page-lock the chunk, the registered copy is staged: its time is
    not registration's, and it is left out rather than recorded under that name."""
    from eugo_dask.config import configured_device_settings

    module, fake_cupy = stand_in
    settings = replace(configured_device_settings(), staging_bytes=64 * KB, copy_piece_bytes=16 * KB)
    fake_cupy.refuse_registration[0] = 1  # cudaErrorInvalidValue on every registration
    link, _ = _measure(module, settings, sizes=(256 * KB,))
    (point,) = link["copies_by_size"]["h2d"]
    assert "registered" not in point["measured"] and point["path"] != "registered"
    assert "direct" in point["measured"] and "staged-4" in point["measured"]


def test_what_calibration_found_best_is_the_path_the_runtime_takes(stand_in, tmp_path):
    """The calibrated profile, loaded as eugo.profile: at each measured size the device the
    runtime makes copies by the path calibration recorded (read back from the counters)."""
    from eugo_dask import device_stats, reset_device_stats
    from eugo_dask.config import configured_device_settings, device_settings
    from eugo_dask.devices import CupyDevice

    module, _ = stand_in
    settings = replace(configured_device_settings(), staging_bytes=64 * KB, copy_piece_bytes=16 * KB)
    link, _ = _measure(module, settings)
    path = tmp_path / "calibrated.yaml"
    path.write_text(yaml.safe_dump({"name": "c", "gpu": _H200["gpu"], "cpu": _SERVER,
                                    "link": {**_H200["link"], "copies_by_size": link["copies_by_size"]}}))
    with dask.config.set({"eugo.profile": str(path)}):
        device = CupyDevice(module, replace(device_settings(), staging_bytes=64 * KB, copy_piece_bytes=16 * KB),
                            count=1)
    for i, nbytes in enumerate((16 * KB, 256 * KB, 1024 * KB)):
        host = np.ones(nbytes, dtype=np.uint8)
        for way in ("h2d", "d2h"):
            reset_device_stats()
            on_device = device.to_device(host)
            if way == "d2h":
                reset_device_stats()
                device.to_host(on_device)
            stats = device_stats()
            taken = {"h2d": "registered" if stats["h2d_registered"] else "staged" if stats["h2d_staged"] else "direct",
                     "d2h": "pinned" if stats["d2h_pinned"] else "staged" if stats["d2h_staged"] else "direct"}[way]
            point = link["copies_by_size"][way][i]
            assert taken == point["path"], (way, nbytes, point)
            if taken == "staged":
                assert stats["staged_threads"] == {min(point["threads"], nbytes // (16 * KB)): 1}


_H200 = yaml.safe_load((Path(eugo_dask.__file__).parent / "profiles" / "h200.yaml").read_text())
