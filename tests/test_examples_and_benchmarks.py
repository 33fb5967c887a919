"""The commands of the README and the docs run as written, in quick mode, and print what they promise.

The commands are read from the code blocks of README.md (install and test, the quickstart) and of
docs/getting-started.md (the quickstart's sample, the examples) and docs/benchmarks.md, so the
pages and the scripts cannot drift apart: a script the docs do not list, a line naming a script
that is gone, a quickstart sample that is not what a real run prints, or a ``--quick`` that hangs
fails here (none asserts how long a run takes: a loaded machine must not fail the suite).
``.ci/run`` installs from a clean checkout with the README's install command and runs these with
the README's test command (checked below too).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GETTING_STARTED = "docs/getting-started.md"
BENCHMARKS_PAGE = "docs/benchmarks.md"
#: A run that has not ended by then hangs (``--quick`` takes seconds, at most about 30 s on a
#: 2-core machine). How long a run takes is the README's to say, not a test's to assert: a busy
#: machine made a quick run take 124 s and failed the suite when this bound was 120 s.
HANG_S = 600
BLAS_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def section(heading: str, doc: str = "README.md") -> str:
    """The text of ``doc`` (README.md or a docs page) under the heading that starts with
    ``heading``, to the next heading (a ``#`` line inside a code block is a comment, not a heading)."""
    lines, inside, fenced = [], False, False
    for line in (ROOT / doc).read_text().splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            if inside:
                break
            inside = re.match(rf"#+ {re.escape(heading)}", line) is not None
            continue
        if inside:
            lines.append(line)
    assert lines, f"{doc} has no section {heading!r}"
    return "".join(lines)


def code_blocks(heading: str, language: str, doc: str = "README.md") -> list[str]:
    """The fenced ``language`` blocks of a section of ``doc``."""
    return re.findall(rf"^```{language}\n(.*?)^```", section(heading, doc), re.M | re.S)


def commands(heading: str, doc: str = "README.md") -> list[list[str]]:
    """Each command line of the section's bash blocks, split as a shell would, comments dropped."""
    return [argv for block in code_blocks(heading, "bash", doc) for line in block.splitlines()
            if (argv := shlex.split(line, comments=True))]


def script_commands(heading: str, doc: str) -> dict[str, list[str]]:
    """``python SCRIPT ARGS`` lines of a section of ``doc``, by script."""
    found = {}
    for argv in commands(heading, doc):
        assert argv[0] == "python", f"{heading}: {shlex.join(argv)} does not start with python"
        found[argv[1]] = argv[1:]
    return found


def run(argv: list[str], tmp_path: Path) -> str:
    """Run a documented command from the repository root, as written, and return stdout.

    The BLAS thread variables are removed from the environment, so that what the benchmarks
    print about their threads is what their own pinning did."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARIABLES}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a first run: nothing measured before
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                         timeout=HANG_S, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


BENCHMARKS = script_commands("Benchmarks", BENCHMARKS_PAGE)
EXAMPLES = script_commands("Examples", GETTING_STARTED)
SLOW = {"benchmarks/pass_overhead.py", "benchmarks/enabled_overhead.py",
        "benchmarks/plugin_throughput.py", "benchmarks/prediction_accuracy.py",
        "examples/heterogeneous_cluster.py", "examples/connect_to_chart.py"}


def params(scripts: dict[str, list[str]]) -> list:
    return [pytest.param(argv, id=Path(script).stem,
                         marks=[pytest.mark.slow] if script in SLOW else [])
            for script, argv in scripts.items()]


def test_docs_list_every_script_and_only_those():
    assert set(BENCHMARKS) == {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")
                               if not p.name.startswith("_")}
    assert set(EXAMPLES) == {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}


def test_readme_install_and_test_commands_are_what_ci_runs():
    install, browser, test = commands("Install and test")
    # the getting-started page repeats the README's set-up: the same commands
    assert commands("Install and test", GETTING_STARTED) == [install, browser, test]
    assert install[:3] == ["pip", "install", "-e"] and test == ["pytest"]
    # the browser test's prerequisite, beside the commands, and what CI installs
    assert browser == ["sudo", "apt-get", "install", "chromium"]
    ci = (ROOT / ".ci" / "run").read_text()
    (ci_target,) = re.findall(r"^python -m pip install --quiet -e '(\.\[[^\]]*\])'$", ci, re.M)

    def extras(target: str) -> set[str]:
        return set(re.fullmatch(r"\.\[(.*)\]", target).group(1).split(","))

    assert extras(install[3]) <= extras(ci_target)
    assert "\npytest\n" in ci
    assert "apt-get install -y -q chromium" in ci


def test_quickstart_prints_the_documented_sample(tmp_path):
    """The README's quickstart command, as written, prints the sample docs/getting-started.md shows
    for it, to the letter: the plan is priced with presets only, so no figure depends on this
    machine."""
    (argv,) = commands("Quickstart")
    assert argv[0] == "python" and "--quick" in argv
    assert commands("Quickstart", GETTING_STARTED) == [argv]
    (sample,) = code_blocks("Quickstart", "text", GETTING_STARTED)
    out = run(argv[1:], tmp_path)
    assert out == sample
    assert "results identical to plain Dask: True" in out and "0 fallbacks" in out


def check_pass_overhead(out: str) -> None:
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    # --quick: blocks 1, 2, 8, 16 (a one-chunk graph's fixed costs up to ~6,000 tasks)
    assert len(rows) == 4 and all(float(r[3]) > 0 for r in rows)
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows) and int(rows[-1][0]) > 5000
    # other shapes of graph: a row each (--quick: one size), with both ratios; the chains, the
    # tree and the stencil at ~6,000 tasks
    names = ("reads", "random", "chain", "chain-sum", "matmul-sum", "stencil")
    shapes = [line.split() for line in out.splitlines() if line.startswith(tuple(
        f"{name} " for name in names))]
    assert [r[0] for r in shapes] == list(names)
    assert all(int(r[1]) > 500 and float(r[4]) > 0 and float(r[6]) > 0 for r in shapes)
    assert all(int(r[1]) > 4500 for r in shapes[2:])
    # the scheduler submission: both graphs, a row per mode, the graph taken (tasks held), eugo's
    # loop blocking, update-graph time and memory as ratios to plain's
    submitted = {(line.split()[0], line.split()[1]): line.split() for line in out.splitlines()
                 if line.startswith(("pipeline ", "random-chain "))}
    assert set(submitted) == {(shape, mode) for shape in ("pipeline", "random-chain")
                              for mode in ("plain", "plan", "rewrite")}
    for shape, low in (("pipeline", 5000), ("random-chain", 3000)):
        plain, plan, rewrite = (submitted[shape, mode] for mode in ("plain", "plan", "rewrite"))
        assert all(len(r) == 11 for r in (plain, plan, rewrite))
        # a few thousand tasks, the same graph planned; the rewrite adds copy tasks
        assert low < int(plain[2]) == int(plan[2]) < int(rewrite[2])
        assert all(float(v) >= 0 for r in (plain, plan, rewrite) for v in r[3:8])
        # update-graph time and memory growth: finite positive ratios, plain's own 1.00
        assert plain[9] == plain[10] == "1.00"
        assert all(0 < float(r[i]) < float("inf") for r in (plan, rewrite) for i in (9, 10))
        # loop blocking: a ratio where plain's loop stalled at all ("-" where it never did)
        assert plain[8] in ("1.00", "-")
        assert all(r[8] == "-" if plain[8] == "-" else 0 <= float(r[8]) < float("inf")
                   for r in (plan, rewrite))


def check_enabled_overhead(out: str) -> None:
    assert [line.split()[0] for line in out.splitlines()[2:5]] == ["matmul+sum", "elementwise", "many"]
    assert float(out.split("geometric mean on/off: ")[1]) > 0


def check_plugin_throughput(out: str) -> None:
    assert int(out.split("tasks per graph: ")[1].split()[0]) >= 2000
    assert re.search(r"ratio \d+\.\d{3} \(median of 3 runs each, alternating\)", out)
    assert re.search(r"time in plugin hooks: \d+\.\d+ s of \d+\.\d+ s", out)


def check_seed_table(out: str) -> None:
    rows = [line for line in out.splitlines() if line.startswith(("Matmul", "Elementwise", "FFT", "Sum"))
            and "  " in line]
    assert len(rows) == 6
    assert "gpu" in out and "cpu" in out
    from eugo_dask.devices import cupy_device_count

    if not cupy_device_count():  # never invented: GPU columns say so
        assert all(line.count("not measured") == 3 for line in rows)


def check_mixed_pipelines(out: str) -> None:
    for name in ("(a) zarr", "(b) FFT", "(c) many small chunks"):
        assert name in out


def check_prediction_accuracy(out: str) -> None:
    assert "median absolute percentage error per family" in out
    families = [line.split()[0] for line in out.splitlines()[-4:]]
    assert families == ["matmul", "elementwise", "fft", "reduction"]


def check_root_tasks(out: str) -> None:
    peaks: dict[str, list[int]] = {}  # run -> each round's peak tasks processing
    for line in out.splitlines():
        cells = line.split()
        if len(cells) == 8 and cells[0] in ("plain", "unpaced", "eugo") and cells[1].isdigit():
            peaks.setdefault(cells[0], []).append(int(cells[1]))
    assert set(peaks) == {"plain", "unpaced", "eugo"}
    # plain Dask queues the reads: at most about worker-saturation x threads processing at once
    assert all(0 < p <= 16 for p in peaks["plain"])
    # unpaced, the reads run ahead of the device; paced, fewer tasks wait for it
    assert max(peaks["eugo"]) < max(peaks["unpaced"])
    assert "peak processing eugo/plain: " in out and "best wall eugo/unpaced: " in out
    assert re.search(r"eugo ran [1-9]\d* tasks on the GPU worker's device; results agree: True", out)


@pytest.mark.parametrize("argv", params(BENCHMARKS))
def test_benchmark_quick(argv, tmp_path):
    """Each benchmark line of docs/benchmarks.md with ``--quick``: one convention, BLAS pinned and reported."""
    extra = ["--plot", str(tmp_path / "seed.png")] if argv[0].endswith("seed_table.py") else []
    out = run([*argv, "--quick", *extra], tmp_path)
    first = out.splitlines()[0]
    assert re.fullmatch(r"mode: quick; BLAS: .+, (1|\?) thread\(s\) \(OMP_NUM_THREADS=1, "
                        r"OPENBLAS_NUM_THREADS=1, MKL_NUM_THREADS=1\).*; Dask threads: \d+", first), first
    CHECKS[Path(argv[0]).stem](out)
    if extra:
        assert (tmp_path / "seed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_device_memory(out: str) -> None:
    high: dict[str, list[float]] = {}  # run -> each round's device high water, MiB
    for line in out.splitlines():
        cells = line.split()
        if len(cells) == 4 and cells[0] in ("ungated", "gated") and cells[1].isdigit():
            high.setdefault(cells[0], []).append(float(cells[1]))
    assert set(high) == {"ungated", "gated"} and len(high["gated"]) == 3
    # every copy ready at once: ungated, the device holds far more than gated
    assert max(high["gated"]) < min(high["ungated"])
    assert re.search(r"gates made [1-9]\d*, released by the watchdog 0", out)
    assert "results agree: True" in out


def check_joint_plans(out: str) -> None:
    planned, counted = out.split("\ncounted (device_stats)\n")
    assert "\nplanned (explain)\n" in planned

    def rows(text: str) -> list[list[str]]:  # [GPU tasks, H2D, H2D MB, D2H, D2H MB(, ratio)]
        return [line.split()[line.split().index(side) + 1:] for line in text.splitlines()
                for side in ("separate", "joint") if side in line.split()]

    plan, ran = rows(planned), rows(counted)
    assert len(plan) == len(ran) == 8  # 2 workloads x 2 min-speedups x (separate, joint)
    # the plan's tasks on the device and copies to it are what running counts
    assert [r[:3] for r in plan] == [r[:3] for r in ran]
    assert any(int(r[0]) > 0 for r in plan)
    # together, never more bytes over the link than one by one
    assert all(float(r[5]) <= 1.0 for r in plan + ran if len(r) == 6)


def check_makespan(out: str) -> None:
    """Every graph on both machines under every policy, none below the bound."""
    rows = [line.split() for line in out.splitlines() if re.search(r" (32c\+1g|8c\+4g) ", line)]
    assert len(rows) == 8 * 2
    for row in rows:
        ratios = [float(cell[:-1]) for cell in row if re.fullmatch(r"\d+\.\d+x", cell)]
        assert len(ratios) == 8 and min(ratios) >= 1.0, row
    assert "worst makespan / bound, by policy: static" in out
    # where the bound uses both kinds of device, dual and eugo (balanced) are never slower
    # than the static plan
    for policy in ("dual", "eugo"):
        gains = re.search(rf"static / {policy} on \d+ graph x machine \(mixed\): ([\d.]+)x to",
                          out)
        assert gains and float(gains.group(1)) >= 1.0, out[-400:]
    # and eugo is never 5% slower than the better of all-CPU and all-GPU
    worst = re.search(r"eugo / the better of all-cpu and all-gpu: [\d.]+x to ([\d.]+)x", out)
    assert worst and float(worst.group(1)) <= 1.05, out[-400:]


def check_copy_engine(out: str) -> None:
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()[3:]}
    cases = [f"{case}, {n} thread(s)" for case in ("to device", "back new", "back touched")
             for n in (1, 2, 4, 8)]
    assert list(rows) == ["one memcpy", *cases]
    assert rows["one memcpy"][1] == "1.00"
    assert all(float(gbs) > 0 and float(ratio) > 0 for gbs, ratio in rows.values())


CHECKS = {"pass_overhead": check_pass_overhead, "enabled_overhead": check_enabled_overhead,
          "plugin_throughput": check_plugin_throughput, "seed_table": check_seed_table,
          "mixed_pipelines": check_mixed_pipelines, "prediction_accuracy": check_prediction_accuracy,
          "root_tasks": check_root_tasks, "device_memory": check_device_memory,
          "joint_plans": check_joint_plans,
          "makespan": check_makespan, "copy_engine": check_copy_engine}


def test_benchmark_helpers_refuse_to_come_after_numpy():
    """Pinning BLAS threads through the environment works only before NumPy loads BLAS."""
    code = "import numpy, sys; sys.path.insert(0, 'benchmarks'); import _common"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode != 0
    assert "RuntimeError: import _common before NumPy" in out.stderr


def check_quickstart(out: str) -> None:
    assert "eugo plan:" in out and "results identical to plain Dask: True" in out


def check_heterogeneous_cluster(out: str) -> None:
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and len(line.split()) == 3]
    placed = {(role, worker) for role, worker, _ in rows}
    assert ("gpu", "gpu") in placed and not any(r == "gpu" and w != "gpu" for r, w in placed)
    assert not any(r == "host" and w == "gpu" for r, w in placed)
    assert "gpu: 0 device tasks" not in out and "cpu-1: 0 device tasks" in out
    assert "results match plain Dask" in out and "/eugo" in out


def check_connect_to_chart(out: str) -> None:
    assert "eugo plan:" in out and "'eugo-gpu-chunk-sum'" in out


def check_zarr_field_pipeline(out: str) -> None:
    assert "I/O (getter) stays on the CPU" in out and "results match plain Dask" in out


CHECKS.update(quickstart=check_quickstart, heterogeneous_cluster=check_heterogeneous_cluster,
              connect_to_chart=check_connect_to_chart, zarr_field_pipeline=check_zarr_field_pipeline)


@pytest.mark.parametrize("argv", params(EXAMPLES))
def test_example_quick(argv, tmp_path):
    """Each example line of docs/getting-started.md with ``--quick`` (connect_to_chart: a local stand-in cluster)."""
    out = run([*argv, "--quick"] if "--quick" not in argv else argv, tmp_path)
    CHECKS[Path(argv[0]).stem](out)
