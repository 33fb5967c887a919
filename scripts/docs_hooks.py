"""MkDocs hook: the configuration reference, rendered from the package's own schema and defaults.

``docs/configuration.md`` holds the marker ``<!-- eugo-config-reference -->``; at build time it is
replaced by a table of every key of ``eugo_dask/eugo-schema.yaml`` (type, default from
``eugo_dask/eugo.yaml``, what the schema allows, its description) and the comment that stands above
the key in ``eugo.yaml``. Nothing here imports eugo_dask: the two YAML files are read as files, so
the reference is the one the installed package validates against.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "eugo_dask" / "eugo-schema.yaml"
DEFAULTS = ROOT / "eugo_dask" / "eugo.yaml"
MARKER = "<!-- eugo-config-reference -->"


def _type(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return "string"
    if "oneOf" in spec:
        return " or ".join(dict.fromkeys(_type(option) for option in spec["oneOf"]))
    kind = spec.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"list of ({_type(spec.get('items', {}))})"
    return str(kind)


def _allowed(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return ", ".join(f"`{value}`" for value in spec["enum"])
    bounds = []
    if "minimum" in spec:
        bounds.append(f"≥ {spec['minimum']}")
    if "exclusiveMinimum" in spec:
        bounds.append(f"> {spec['exclusiveMinimum']}")
    if "maximum" in spec:
        bounds.append(f"≤ {spec['maximum']}")
    if "exclusiveMaximum" in spec:
        bounds.append(f"< {spec['exclusiveMaximum']}")
    if "minLength" in spec:
        bounds.append(f"at least {spec['minLength']} character(s)")
    if spec.get("type") == "boolean":
        bounds.append("`true`, `false`")
    return ", ".join(bounds) or "—"


def _default(defaults: dict[str, Any], path: list[str]) -> str:
    value: Any = defaults
    for part in path:
        value = value[part]
    return f"`{json.dumps(value) if value is None or isinstance(value, bool) else value}`"


def _comments(text: str) -> dict[str, str]:
    """The comment block right above each key of eugo.yaml, by dotted key."""
    found, block, parents = {}, [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"( *)([\w-]+):", line)
        if match:
            depth = len(match.group(1)) // 2
            parents = parents[:depth] + [match.group(2)]
            if block:
                found[".".join(parents)] = " ".join(block)
        block = []
    return found


def _text(text: str) -> str:
    """Plain text as Markdown table-cell content: no HTML, no column breaks."""
    return html.escape(text, quote=False).replace("|", "&#124;")


def keys(properties: dict[str, Any], path: tuple[str, ...] = ("eugo",)):
    """(dotted path, schema) of every leaf key, in the schema's order."""
    for key, spec in properties.items():
        if spec.get("type") == "object" and "properties" in spec:
            yield from keys(spec["properties"], (*path, key))
        else:
            yield (*path, key), spec


def render_reference() -> str:
    """The reference (Markdown) of every eugo.* key: a table, then eugo.yaml's comment on each."""
    schema = yaml.safe_load(SCHEMA.read_text())
    defaults_text = DEFAULTS.read_text()
    defaults = yaml.safe_load(defaults_text)
    comments = _comments(defaults_text)
    table = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    details = []
    for path, spec in keys(schema["properties"]["eugo"]["properties"]):
        dotted = ".".join(path)
        table.append(f"| `{dotted}` | {_type(spec)} | {_default(defaults, list(path))} | "
                     f"{_allowed(spec)} | {_text(spec.get('description', ''))} |")
        if dotted in comments:
            details.append(f"- `{dotted}`: {html.escape(comments[dotted], quote=False)}")
    return ("\n".join(table) + "\n\nWhat `eugo_dask/eugo.yaml` says above each key:\n\n"
            + "\n".join(details) + "\n")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: fill the marker of the configuration page."""
    if MARKER in markdown:
        return markdown.replace(MARKER, render_reference())
    return markdown
