"""Every Python snippet of README.md and docs/*.md runs as written (tests/snippets.py says how a
page marks one it cannot run here, and what a snippet prints).

Each runs in a fresh interpreter from the repository root, with PYTHONHASHSEED=0 (a plan's rows
follow Dask's order, which breaks ties by string hashing) and an empty cache (nothing measured
before). The run's summary counts the snippets not run and why (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.snippets import ROOT, all_snippets, parse

SNIPPETS = all_snippets()
#: A snippet that has not ended by then hangs (the longest, a LocalCluster, takes seconds).
HANG_S = 600


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONHASHSEED": "0", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=HANG_S, cwd=ROOT, env=env)


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.skip], ids=lambda s: s.name)
def test_snippet_runs_and_prints_what_the_page_says(snippet, tmp_path):
    out = run(snippet.code, tmp_path)
    assert out.returncode == 0, out.stderr
    if snippet.output is not None:
        assert out.stdout == snippet.output


def test_every_snippet_compiles_and_every_skip_says_why():
    assert SNIPPETS, "no snippet found: the parser or the pages changed"
    for snippet in SNIPPETS:
        compile(snippet.code, snippet.name, "exec")
        assert snippet.skip is None or snippet.skip.strip(), snippet.name
    # what may be left out is what cannot run on a machine without a GPU or a cluster
    assert all(re.search(r"\b(cluster|GPU)\b", s.skip) for s in SNIPPETS if s.skip)


def test_the_five_minute_path_runs_on_the_emulated_device():
    """The README's first snippet is run (not skipped), asks for the emulated device, and what it
    is shown to print counts tasks that ran on the device."""
    five = parse(ROOT / "README.md")[0]
    above = (ROOT / "README.md").read_text().splitlines()[:five.line]
    assert [line for line in above if line.startswith("## ")][-1].startswith("## Five minutes")
    assert five.skip is None and '"eugo.device": "emulated"' in five.code
    assert five.output is not None and "eugo plan:" in five.output
    tasks = int(re.search(r"^device: (\d+) tasks", five.output, re.M).group(1))
    assert tasks > 0 and "same as plain Dask: True" in five.output


def test_the_parser_reads_marks_and_outputs(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("text\n\n<!-- skip: needs a GPU -->\n```python\nimport cupy\n```\n\n"
                    "```python\nprint(1)\n```\n\nIt prints:\n\n<!-- output -->\n```text\n1\n```\n"
                    "```text\nnot an output\n```\n")
    monkeypatch.setattr("tests.snippets.ROOT", tmp_path)
    first, second = parse(page)
    assert (first.skip, first.output, first.line) == ("needs a GPU", None, 4)
    assert (second.skip, second.output, second.code) == (None, "1\n", "print(1)\n")


def _docs_hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_the_schema_s_keys_with_their_defaults():
    """docs/configuration.md's table is rendered from eugo-schema.yaml and eugo.yaml at build
    time: every key of the schema, with the default eugo.yaml sets, and no key eugo.yaml lacks."""
    import yaml

    hooks = _docs_hooks()
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.count(hooks.MARKER) == 1
    rendered = hooks.on_page_markdown(page, None, None, None)
    assert hooks.MARKER not in rendered
    schema = yaml.safe_load((ROOT / "eugo_dask" / "eugo-schema.yaml").read_text())
    defaults = yaml.safe_load((ROOT / "eugo_dask" / "eugo.yaml").read_text())
    leaves = dict(hooks.keys(schema["properties"]["eugo"]["properties"]))
    assert {".".join(path) for path in leaves} >= {"eugo.device", "eugo.min-speedup", "eugo.emulated.devices"}
    rows = {line.split("|")[1].strip(" `"): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in rendered.splitlines() if line.startswith("| `eugo.")}
    assert set(rows) == {".".join(path) for path in leaves}
    for path in leaves:
        value = defaults
        for part in path:
            value = value[part]
        shown = rows[".".join(path)][1].strip("`")
        assert shown == (yaml.safe_dump(value).splitlines()[0] if value is None or isinstance(value, bool)
                         else str(value)), path
    assert rows["eugo.device"][2] == "`auto`, `cupy`, `emulated`, `none`"


def test_the_documented_profile_format_is_a_valid_profile():
    """The YAML example of docs/profiles.md is a profile eugo accepts."""
    import yaml

    from eugo_dask.profile import validate_profile_dict

    (block,) = re.findall(r"^```yaml\n(name: .*?)^```", (ROOT / "docs" / "profiles.md").read_text(),
                          re.M | re.S)
    validate_profile_dict(yaml.safe_load(block))
