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
