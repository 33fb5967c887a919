"""``eugo-dask explain``: a wrong TARGET or setting is one line saying what is wrong and what
TARGET must be, with a non-zero exit and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from eugo_dask.cli import TARGET_FORM, load_collection

EUGO_CLI = str(Path(sys.executable).with_name("eugo-dask"))
FORM = re.escape(TARGET_FORM)


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
    """As a user runs it: exit status 1 and one line on stderr, ``Error: ...``."""
    argv = [str(script) + a[len("pipeline.py"):] if a.startswith("pipeline.py") else a for a in args]
    result = subprocess.run([EUGO_CLI, "explain", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and re.search(match, line), result.stderr
