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
            "threads", "throughput", "distributed", "calibrate", "seed-table", "dual"} == set(limits)
    assert budget <= 450 < 600  # the steps stop at the budget, whatever their own limits
    assert all(limit <= 150 for limit in limits.values())
    # at most 8 files come back from the device tool
    assert len(set(re.findall(r'"\$out/([\w.-]+)"', SCRIPT)) | {"seed_table.png", "dual-cupy.json"}) <= 8
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu-check.sh")], check=True)


@pytest.mark.parametrize("check", ["copies", "engine", "timing", "waits", "memory", "threads",
                                   "throughput"])
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
    import importlib.util

    from eugo_dask.devices import CupyDevice

    from . import fake_cupy

    module = fake_cupy.module(device_count=1)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupy.fft", module.fft)
    monkeypatch.setitem(sys.modules, "cupy.fft.config", module.fft.config)
    fake_cupy.reset()
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    device_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_check)
    monkeypatch.setattr(device_check, "gpu", lambda: module)
    monkeypatch.setattr(device_check, "ENGINE_SIZES_MIB", (1, 2))
    monkeypatch.setattr(CupyDevice, "_pinned_dma", lambda *args: 1 / 0)  # registered copies fail
    results = tmp_path / "results.jsonl"
    monkeypatch.setattr(sys, "argv", ["device_check.py", "engine", "--json", str(results)])
    with pytest.raises(SystemExit) as done:
        device_check.main()
    assert done.value.code == 0
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    result = record["result"]
    assert record["status"] == "ok" and [row["MiB"] for row in result["rows"]] == [1, 2]
    two = result["rows"][1]["GBps"]
    assert {"dma_h2d", "dma_d2h", "register_h2d", "threads1_h2d", "threads8_d2h", "defaults_h2d",
            "defaults_d2h"} <= set(two)
    assert "threads4_registered_h2d" not in two and "threads4_pinned_d2h" in two
    assert "threads4_registered_h2d" in result["rows"][0]["GBps"]  # 1 MiB: copied straight, no registration
    assert result["errors"] == {"threads4_registered_h2d": "2 MiB: ZeroDivisionError: division by zero"}
    assert result["paths"]["d2h_pinned"] > 0 and result["paths"]["h2d_registered"] == 0
