"""The Python snippets of README.md and docs/*.md, as tests/test_docs.py runs them.

A ```` ```python ```` block is a snippet. An HTML comment ``<!-- skip: WHY -->`` on the line
above it (blank lines between allowed) marks one that cannot run here (it needs a cluster, a GPU):
it is compiled, not run, and counted with its reason. A ```` ```text ```` block right after the
comment ``<!-- output -->`` is what the snippet before it prints, to the letter.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"<!-- skip: (.+?) -->")
OUTPUT = "<!-- output -->"


@dataclass
class Snippet:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None = None  # why it is not run
    output: str | None = None  # what it prints, where the page says

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Snippet]:
    """The snippets of one Markdown file, with their skip reasons and expected outputs."""
    lines = path.read_text().splitlines(keepends=True)
    found: list[Snippet] = []
    marker: str | None = None  # the last comment line outside a fence, until a fence or text
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"```(\w*)", line)
        if not fence:
            stripped = line.strip()
            if stripped:
                marker = stripped if stripped.startswith("<!--") else None
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body = "".join(lines[i + 1:end])
        language = fence.group(1)
        if language == "python":
            skip = SKIP.fullmatch(marker) if marker else None
            found.append(Snippet(str(path.relative_to(ROOT)), i + 1, body, skip and skip.group(1)))
        elif marker == OUTPUT:
            assert language == "text", f"{path.name}:{i + 1}: an output block is ```text"
            assert found and found[-1].output is None, f"{path.name}:{i + 1}: output of no snippet"
            found[-1].output = body
        marker = None
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [snippet for path in documents() for snippet in parse(path)]


def skipped_summary() -> str:
    """One line: how many snippets were not run, by reason."""
    snippets = all_snippets()
    reasons = Counter(s.skip for s in snippets if s.skip)
    run = len(snippets) - sum(reasons.values())
    said = "; ".join(f"{count} {why} ({', '.join(s.name for s in snippets if s.skip == why)})"
                     for why, count in sorted(reasons.items()))
    return f"docs snippets: {run} run, {sum(reasons.values())} compiled but not run: {said or 'none'}"
