"""``eugo-dask``: every mistake in a command (a wrong TARGET, setting, option value or path) is
one line on stderr saying what is wrong and what is allowed, exit status 2 and no traceback,
found before anything is measured or run; a user's script that raises shows its own traceback
and exits with 1; ``explain --json`` keeps stdout for the JSON alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from eugo_dask._version import __version__
from eugo_dask.cli import TARGET_FORM, load_collection

EUGO_CLI = str(Path(sys.executable).with_name("eugo-dask"))
FORM = re.escape(TARGET_FORM)
WRITABLE = re.escape("it must be a file path in an existing directory you can write to")


def run_cli(*args, env=None, cwd=None):
    """``eugo-dask ARGS`` as a user runs it, with a timeout."""
    return subprocess.run([EUGO_CLI, *args], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env}, cwd=cwd)


def one_line_error(result, match):
    """Exit status 2, nothing on stdout, exactly one line on stderr (``Error: ...``, no
    traceback) that matches ``match``; the line."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "", result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and re.search(match, line), line
    return line


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "pipeline.py"
    path.write_text("import dask.array as da\n"
                    "x = da.ones((4, 4), chunks=2) + 1\n"
                    "n = 3\n"
                    "def make():\n"
                    "    return x\n")
    return path


@pytest.mark.parametrize(
    "target, match",
    [
        ("dask.array:ones", r"^dask.array:ones: 'ones' is of type function, not a Dask collection "
                            r"\(call it in a script and name the result\)\. " + FORM + "$"),
        ("dask.array:Array", r"'Array' is of type type, not a Dask collection \(call it in a script"),
        ("dask.array", r"^dask.array: no ':NAME' after the script or module\. " + FORM + "$"),
        ("dask.array:", r"^dask.array:: no NAME after ':'\. " + FORM),
        ("no_such_module_x:y", r"^no_such_module_x:y: no module named 'no_such_module_x'\. " + FORM),
        ("dask.no_such:y", r"no module named 'dask.no_such'\. "),
        ("os.path.inner:y", r"no module named 'os.path.inner'\. "),  # a parent that is no package
        ("some/dir/pipeline:x", r"no module named 'some/dir/pipeline' \(a script must end in \.py\)"),
        ("missing.py:x", r"^missing.py:x: no such script 'missing.py'\. " + FORM),
        ("dask.array:no_such_name", r"'dask.array' has no name 'no_such_name'\. " + FORM),
    ],
)
def test_wrong_targets_say_what_target_must_be(target, match):
    with pytest.raises(click.ClickException, match=match):
        load_collection(target)


@pytest.mark.parametrize(
    "name, match",
    [
        ("n", r":n: 'n' is of type int, not a Dask collection\. " + FORM + "$"),
        ("make", r":make: 'make' is of type function, not a Dask collection \(call it"),
        ("nope", r"pipeline.py' has no name 'nope'\. "),
    ],
)
def test_wrong_names_in_a_script(script, name, match):
    with pytest.raises(click.ClickException, match=match):
        load_collection(f"{script}:{name}")


def test_a_collection_in_a_script_or_module(script, monkeypatch):
    assert load_collection(f"{script}:x").shape == (4, 4)
    (script.parent / "eugo_cli_target.py").write_text(script.read_text())
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        assert load_collection("eugo_cli_target:x").shape == (4, 4)
    finally:
        sys.modules.pop("eugo_cli_target", None)


@pytest.mark.parametrize(
    "args, match",
    [
        (["dask.array:ones"], r"dask.array:ones: 'ones' is of type function, not a Dask collection"),
        (["pipeline.py:x", "--profile", "h300"], r"eugo.profile must be auto, one of the presets \[.*\]"
                                                  r", a path to a \.yaml/\.json profile, or a mapping; got 'h300'"),
        (["pipeline.py:x", "--profile", "gone.yaml"], r"cannot read profile file 'gone.yaml'"),
        (["pipeline.py:x", "--min-speedup", "-1"], r"eugo.min-speedup must be a number >= 0; got -1"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(script, args, match):
    """As a user runs it: exit status 2 and one line on stderr, ``Error: ...``."""
    argv = [str(script) + a[len("pipeline.py"):] if a.startswith("pipeline.py") else a for a in args]
    one_line_error(run_cli("explain", *argv), match)


@pytest.fixture
def chatty(tmp_path):
    """A script that prints, from Python and from a child process, while it builds ``x``."""
    path = tmp_path / "chatty.py"
    path.write_text("import subprocess, sys\n"
                    "import dask.array as da\n"
                    "print('loading data...')\n"
                    "subprocess.run([sys.executable, '-c', 'print(42)'], check=True)\n"
                    "x = da.ones((4, 4), chunks=2) + 1\n")
    return path


def test_explain_json_is_alone_on_stdout(chatty):
    """``explain --json | jq``: the script's own prints (Python's and a child process's) go to
    stderr, so stdout parses as JSON."""
    result = run_cli("explain", f"{chatty}:x", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["tasks"] and "loading data..." in result.stderr and "42" in result.stderr
    text = run_cli("explain", f"{chatty}:x")  # the text plan: stdout is the plan alone too
    assert text.returncode == 0 and text.stdout.startswith("eugo plan: "), text.stdout


def test_explain_html_is_written(script, tmp_path):
    page = tmp_path / "plan.html"
    result = run_cli("explain", f"{script}:x", "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert "<table" in page.read_text()


def test_explain_wrong_html_paths(script, tmp_path):
    """A page that cannot be written is refused before the script runs (it prints nothing)."""
    (tmp_path / "a_file").write_text("")
    script.write_text("print('ran')\n" + script.read_text())
    for path, match in [
        ("/nonexistent/dir/p.html", r"^Error: --html '/nonexistent/dir/p\.html': no directory "
                                    r"'/nonexistent/dir'; " + WRITABLE + "$"),
        (str(tmp_path), r"--html '.*': is a directory; " + WRITABLE),
        (str(tmp_path / "a_file" / "p.html"), r"'.*a_file' is not a directory; " + WRITABLE),
    ]:
        one_line_error(run_cli("explain", f"{script}:x", "--html", path), match)


def test_explain_wrong_scripts(tmp_path):
    (tmp_path / "dir.py").mkdir()
    one_line_error(run_cli("explain", f"{tmp_path / 'dir.py'}:x"),
                   r"dir\.py' is a directory, not a script\. " + FORM)
    one_line_error(run_cli("explain", f"{tmp_path / 'absent.py'}:x"),
                   r"no such script '.*absent\.py'\. " + FORM)
    one_line_error(run_cli("explain", "--profile", "", f"{tmp_path / 'absent.py'}:x"),
                   r"--profile must be auto, one of the presets .*h200.*; got ''$")


def test_a_script_that_raises_shows_its_own_traceback(tmp_path):
    """The user's code failing is not a mistake in the command: its traceback (from the
    script's frame on, none of the CLI's), then one line; exit status 1."""
    bad = tmp_path / "bad.py"
    bad.write_text("import dask.array as da\n"
                   "def load():\n"
                   "    raise RuntimeError('no data here')\n"
                   "x = load()\n")
    result = run_cli("explain", f"{bad}:x")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == f'  File "{bad}", line 4, in <module>', lines
    assert "cli.py" not in result.stderr and "importlib" not in result.stderr
    assert lines[-2] == "RuntimeError: no data here"
    assert lines[-1] == (f"Error: {bad} raised an exception while it ran (its traceback is "
                         "above): RuntimeError: no data here")
    bad.write_text("import sys\nsys.exit(3)\n")
    result = run_cli("explain", f"{bad}:x")
    assert result.returncode == 1 and result.stderr == (
        f"Error: {bad} called sys.exit(3) while it ran; explain needs it to run to its end "
        "(it runs as a module, not as __main__)\n")


@pytest.mark.parametrize(
    "env, match",
    [
        ({"DASK_EUGO__MIN_SPEEDUP": "-3"}, r"^Error: eugo\.min-speedup must be a number >= 0; got -3$"),
        ({"DASK_EUGO__DEVICE": "tpu"}, r"eugo\.device must be one of \['auto', 'cupy', 'emulated', "
                                       r"'none'\]; got 'tpu'"),
        ({"DASK_EUGO__PROFILE": "h300"}, r"eugo\.profile must be auto, one of the presets"),
        ({"DASK_EUGO__EMULATED__DEVICES": "two"}, r"eugo\.emulated\.devices must be a whole number "
                                                  r">= 1; got 'two'"),
        ({"DASK_EUGO__MIN_SPEDUP": "1"}, r"unknown setting eugo\.min_spedup \(did you mean "
                                         r"eugo\.min-speedup\?\); allowed: eugo\.device, "),
    ],
)
def test_explain_wrong_settings_from_the_environment(script, env, match):
    script.write_text("print('ran')\n" + script.read_text())
    one_line_error(run_cli("explain", f"{script}:x", env=env), match)


@pytest.mark.parametrize(
    "args, match",
    [
        (["calibrate", "--threads", "-3"], r"^Error: --threads must be a whole number >= 1 \(worker "
                                           r"threads; leave it out for all \d+ cores here\); got -3$"),
        (["calibrate", "--threads", "0"], r"--threads must be a whole number >= 1 .*; got 0$"),
        (["calibrate", "--threads", "two"], r"^Error: Invalid value for '--threads': 'two' is not a "
                                            r"valid integer\. Try 'eugo-dask calibrate --help'\.$"),
        (["calibrate", "--gpu-preset", "h300"], r"^Error: --gpu-preset must be one of a10, a100, .*h200.*; "
                                                r"got 'h300'$"),
        (["calibrate", "--quick", "-o", "/nonexistent/dir/x.yaml"],
         r"^Error: --output '/nonexistent/dir/x\.yaml': no directory '/nonexistent/dir'; "
         + WRITABLE + "$"),
        (["calibrate", "--quick", "-o", "."], r"^Error: --output '\.': is a directory; " + WRITABLE),
        (["calibrate", "--bogus"], r"^Error: No such option '--bogus'\. Try 'eugo-dask calibrate --help'"),
        (["explain"], r"^Error: Missing argument 'TARGET'\. Try 'eugo-dask explain --help'\.$"),
        (["explain", "x.py:x", "--min-speedup", "fast"], r"Invalid value for '--min-speedup': 'fast' "
                                                          r"is not a valid float\."),
        (["calibrte"], r"^Error: No such command 'calibrte'\. Did you mean 'calibrate'\? "
                        r"Try 'eugo-dask --help'\.$"),
        (["--bogus"], r"^Error: No such option '--bogus'\. Try 'eugo-dask --help'\.$"),
    ],
)
def test_command_mistakes_fail_fast_in_one_line(tmp_path, args, match):
    """Each refused before anything is measured: no progress line (calibrate prints one, ``cpu:
    matmul``, as it starts measuring), no profile written."""
    line = one_line_error(run_cli(*args, cwd=tmp_path), match)
    assert "cpu:" not in line and not (tmp_path / "eugo-profile.yaml").exists()


def test_version():
    for command in ([EUGO_CLI, "--version"], [sys.executable, "-m", "eugo_dask.cli", "--version"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout == f"eugo-dask {__version__}\n", result


def test_a_module_in_the_current_directory_with_an_inline_profile(script):
    """``package.module:NAME`` finds a module in the directory the command runs in (as
    ``python -m`` does), and ``--profile`` takes the inline mapping the docs' examples use."""
    result = run_cli("explain", "pipeline:x", "--profile", "{base: h200, cpu: server-x86}",
                     "--json", cwd=script.parent)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["profile"] == "h200"
    one_line_error(run_cli("explain", "pipeline:x", "--profile", "{base: h200",
                           cwd=script.parent), r"^Error: --profile: '\{base: h200' is not a "
                                                r"YAML/JSON mapping")
