"""The example and the benchmarks run (quick mode) and print what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_quickstart():
    out = run("examples/quickstart.py", "--quick")
    assert "eugo plan:" in out and "matmul" in out
    assert "results identical to plain Dask: True" in out
    assert "0 fallbacks" in out


@pytest.mark.slow
def test_pass_overhead_benchmark():
    out = run("benchmarks/pass_overhead.py", "--quick")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert len(rows) == 2 and all(float(r[3]) > 0 for r in rows)


@pytest.mark.slow
def test_enabled_overhead_benchmark():
    out = run("benchmarks/enabled_overhead.py", "--quick")
    assert "geometric mean on/off:" in out


@pytest.mark.slow
def test_plugin_throughput_benchmark():
    out = run("benchmarks/plugin_throughput.py", "--quick")
    tasks = int(out.split("tasks per graph: ")[1].split()[0])
    assert tasks >= 20_000
    assert "ratio" in out


def test_seed_table_quick(tmp_path):
    png = tmp_path / "seed.png"
    out = run("benchmarks/seed_table.py", "--quick", "--plot", str(png))
    rows = [line for line in out.splitlines() if line.startswith(("Matmul", "Elementwise", "FFT", "Sum"))
            and "  " in line]
    assert len(rows) == 6
    choices = [line.split()[5 if line.startswith(("Matmul", "FFT")) else 4] for line in rows]
    assert "gpu" in out and "cpu" in out
    from eugo_dask.devices import cupy_device_count

    if not cupy_device_count():  # never invented: GPU columns say so
        assert all(line.count("not measured") == 3 for line in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(choices) == 6


def test_mixed_pipelines_quick():
    out = run("benchmarks/mixed_pipelines.py", "--quick")
    for name in ("(a) zarr", "(b) FFT", "(c) many small chunks"):
        assert name in out


@pytest.mark.slow
def test_prediction_accuracy_runs():
    out = run("benchmarks/prediction_accuracy.py")
    assert "median absolute percentage error per family" in out
    families = [line.split()[0] for line in out.splitlines()[-4:]]
    assert families == ["matmul", "elementwise", "fft", "reduction"]


@pytest.mark.slow
def test_heterogeneous_cluster_example():
    out = run("examples/heterogeneous_cluster.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and len(line.split()) == 3]
    placed = {(role, worker) for role, worker, _ in rows}
    assert ("gpu", "gpu") in placed and not any(r == "gpu" and w != "gpu" for r, w in placed)
    assert not any(r == "host" and w == "gpu" for r, w in placed)
    assert "gpu: 0 device tasks" not in out and "cpu-1: 0 device tasks" in out
    assert "results match plain Dask" in out and "/eugo" in out


@pytest.mark.slow
def test_connect_to_chart_example():
    out = run("examples/connect_to_chart.py", "--quick")
    assert "eugo plan:" in out and "'eugo-gpu-chunk-sum'" in out


def test_zarr_field_pipeline_example():
    out = run("examples/zarr_field_pipeline.py", "--quick")
    assert "I/O (getter) stays on the CPU" in out and "results match plain Dask" in out
