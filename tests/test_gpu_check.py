"""The GPU check (scripts/gpu-check.sh) fits one device command and says what it skipped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu-check.sh").read_text()


def test_steps_fit_one_device_command_with_room_for_a_rerun():
    budget = int(re.search(r"budget=\$\{GPU_CHECK_BUDGET:-(\d+)\}", SCRIPT).group(1))
    limits = {name: int(limit) for name, limit in re.findall(r"^step ([\w-]+) (\d+) ", SCRIPT, re.M)}
    assert {"install", "env", "copies", "engine", "timing", "waits", "pytest-gpu", "memory",
            "threads", "throughput", "distributed", "calibrate", "paths", "seed-table", "dual"} == set(limits)
    # the per-size paths are checked right after the calibration that chose them
    steps = re.findall(r"^step ([\w-]+) ", SCRIPT, re.M)
    assert steps.index("paths") == steps.index("calibrate") + 1
    assert budget <= 450 < 600  # the steps stop at the budget, whatever their own limits
    assert all(limit <= 150 for limit in limits.values())
    # at most 8 files come back from the device tool
    assert len(set(re.findall(r'"\$out/([\w.-]+)"', SCRIPT)) | {"seed_table.png", "dual-cupy.json"}) <= 8
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu-check.sh")], check=True)


@pytest.mark.parametrize("check", ["copies", "engine", "timing", "waits", "memory", "threads",
                                   "throughput", "paths"])
def test_gpu_checks_say_why_they_skip(check, tmp_path):
    from eugo_dask.devices import cupy_device_count

    if cupy_device_count():  # pragma: no cover - a GPU machine runs them for real
        pytest.skip("a CUDA device is here")
    results = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), check,
                           "--json", str(results)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["status"] == "skipped" and record["reason"].startswith("no usable CUDA device: ")
    assert f"{check}: skipped: no usable CUDA device" in done.stdout


@pytest.mark.slow
def test_distributed_check_on_the_emulated_device(tmp_path):
    results = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "distributed",
                           "--json", str(results)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    result = record["result"]
    assert result["ok"], result
    assert result["workers"]["gpu"]["device_stats"]["tasks"] > 0
    assert result["workers"]["cpu"]["device_stats"]["tasks"] == 0


def test_engine_check_measures_every_column_and_keeps_a_failing_ones_error(monkeypatch, tmp_path):
    """The engine step on the stand-in CuPy (sizes cut to 1 and 2 MiB): staged, pinned-result,
    registered and default columns against DMA and registration alone; a column that raises
    is recorded with its error and the others are still measured and written."""
    from eugo_dask.devices import CupyDevice

    device_check = _device_check_on_the_stand_in(monkeypatch)
    monkeypatch.setattr(device_check, "ENGINE_SIZES_MIB", (1, 2))
    monkeypatch.setattr(CupyDevice, "_pinned_dma", lambda *args: 1 / 0)  # registered copies fail
    code, record = _run_check(device_check, monkeypatch, tmp_path / "results.jsonl", "engine")
    assert code == 0
    result = record["result"]
    assert record["status"] == "ok" and [row["MiB"] for row in result["rows"]] == [1, 2]
    two = result["rows"][1]["GBps"]
    assert {"dma_h2d", "dma_d2h", "register_h2d", "threads1_h2d", "threads8_d2h", "defaults_h2d",
            "defaults_d2h"} <= set(two)
    assert "threads4_registered_h2d" not in two and "threads4_pinned_d2h" in two
    assert "threads4_registered_h2d" in result["rows"][0]["GBps"]  # 1 MiB: copied straight, no registration
    assert result["errors"] == {"threads4_registered_h2d": "2 MiB: ZeroDivisionError: division by zero"}
    assert result["paths"]["d2h_pinned"] > 0 and result["paths"]["h2d_registered"] == 0


def _device_check_on_the_stand_in(monkeypatch, device_count=1):
    """scripts/device_check.py loaded as a module, its GPU the stand-in CuPy."""
    import importlib.util

    from . import fake_cupy

    module = fake_cupy.module(device_count=device_count)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupy.fft", module.fft)
    monkeypatch.setitem(sys.modules, "cupy.fft.config", module.fft.config)
    fake_cupy.reset()
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    device_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_check)
    monkeypatch.setattr(device_check, "gpu", lambda: module)
    return device_check


def _run_check(device_check, monkeypatch, results, *argv):
    monkeypatch.setattr(sys, "argv", ["device_check.py", *argv, "--json", str(results)])
    with pytest.raises(SystemExit) as done:
        device_check.main()
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    return done.value.code, record


def test_paths_check_copies_with_the_calibrated_profile_and_says_which_path_ran(monkeypatch, tmp_path):
    """The paths step on the stand-in CuPy (sizes cut to 1, 2 and 8 MiB): with the calibrated
    profile in force, each way the path its nearest point chose, the path the counters say the
    copy took, the rate against DMA and the rate the planner prices; a path that did not run as
    chosen (a pool too small for a pinned result) is named, not hidden."""
    import yaml

    from eugo_dask.profile import profile_dict

    device_check = _device_check_on_the_stand_in(monkeypatch)
    monkeypatch.setattr(device_check, "ENGINE_SIZES_MIB", (1, 2, 8))
    mib = 1 << 20
    profile = profile_dict("h200")
    profile["link"]["copies_by_size"] = {
        "h2d": [{"bytes": mib, "bytes_per_s": 5e9, "path": "direct"},
                {"bytes": 2 * mib, "bytes_per_s": 2e10, "path": "registered"},
                {"bytes": 8 * mib, "bytes_per_s": 3e10, "path": "staged", "threads": 2}],
        "d2h": [{"bytes": 2 * mib, "bytes_per_s": 3e10, "path": "pinned"},
                {"bytes": 8 * mib, "bytes_per_s": 2e10, "path": "staged", "threads": 1}]}
    path = tmp_path / "calibrated.yaml"
    path.write_text(yaml.safe_dump(profile))
    code, record = _run_check(device_check, monkeypatch, tmp_path / "results.jsonl", "paths", "--profile", str(path))
    assert code == 0 and record["status"] == "ok", record
    rows = record["result"]["rows"]
    assert [(r["MiB"], r["h2d"]["chosen"], r["h2d"]["taken"], r["d2h"]["chosen"], r["d2h"]["taken"]) for r in rows] == [
        (1, "direct", "direct", "direct", "direct"), (2, "registered", "registered", "pinned", "pinned"),
        (8, "staged-2", "staged", "staged-1", "staged")]
    assert rows[1]["h2d"]["priced_GBps"] == pytest.approx(20) and rows[2]["d2h"]["of_dma"] > 0
    assert record["result"]["taken_as_chosen"] and record["result"]["mismatches"] == []
    # a pool too small for the 2 MiB result: it was staged, and the check says so
    (tmp_path / "results.jsonl").unlink()
    with __import__("dask").config.set({"eugo.pinned-results": "1 MiB"}):
        code, record = _run_check(device_check, monkeypatch, tmp_path / "results.jsonl", "paths",
                                  "--profile", str(path))
    assert record["result"]["mismatches"] == ["2 MiB d2h: chose pinned, took staged"]
    (tmp_path / "results.jsonl").unlink()
    code, record = _run_check(device_check, monkeypatch, tmp_path / "results.jsonl", "paths",
                              "--profile", str(tmp_path / "missing.yaml"))
    assert record["status"] == "skipped" and record["reason"].startswith("no calibrated profile at ")
