"""The configuration reference page (``docs/reference/config.md``), rendered from the config schema.

:func:`render` walks ``engine/config/schema.json`` through :mod:`llmrl.engine.config.reference` (the schema holds
every key's description and default; nothing is restated here) and returns one markdown section per part of a config:
the top level, ``llms.<name>``, each nested section, and the plugin entries, each a table of key, type, default,
allowed values and description. The output depends on the schema only. This module imports no torch and writes no
file (``docs/generate.py`` writes and checks the page).
"""

from __future__ import annotations

import re

from llmrl.engine.config.reference import PLUGIN_SECTION, TOP_LEVEL, Key, section_keys, section_schema

INTRODUCTION = """\
# Configuration reference

One YAML file configures a run: the LLMs it serves, how their ranks are laid out, how they are trained and how they
decode. This page lists every key, generated from the JSON Schema each config is checked against
(`engine/config/schema.json`, which is also where every default is written). A key you leave out takes its default;
a key marked **required** must be given. Give any key on the command line by its dotted path, e.g.
`llmrl run --config c.yaml llms.main.replicas=2 script.py`. To see every key of your own config with the value the
run gets and its default, run `llmrl validate --resolved c.yaml`.
"""


def render() -> str:
    """The whole page as markdown."""
    sections = _sections()
    parts = [INTRODUCTION, "Sections:\n"]
    parts += [f"- [{_heading(section, paths)}](#{_anchor(section)})" for section, paths in sections]
    parts.append("")
    for section, paths in sections:
        parts.append(_section_text(section, paths))
    return "\n".join(parts).rstrip("\n") + "\n"


def _sections() -> list[tuple[str, list[str]]]:
    """Every section in the order a reader meets it (depth first, in the schema's key order), each with the dotted
    paths of the keys that hold it (a plugin entry is held by several)."""
    found: dict[str, list[str]] = {}

    def visit(section: str, prefix: str) -> None:
        found.setdefault(section, [])
        for key in section_keys(section):
            if key.subsection is None:
                continue
            path = _held_path(prefix, key)
            if key.subsection in found:
                found[key.subsection].append(path)
                continue
            found[key.subsection] = [path]
            visit(key.subsection, path)

    visit(TOP_LEVEL, "")
    return list(found.items())


def _held_path(prefix: str, key: Key) -> str:
    """The dotted path of the value a key's section describes: ``llms.<name>``, ``initializers[i]``, ``updater``."""
    path = f"{prefix}.{key.name}" if prefix else key.name
    if isinstance(key.node.get("additionalProperties"), dict):
        return f"{path}.<name>" if not prefix else f"{path}.<key>"  # llms.<name>, heads.<key>
    if isinstance(key.node.get("items"), dict):
        return f"{path}[i]"
    return path


def _heading(section: str, paths: list[str]) -> str:
    if section == TOP_LEVEL:
        return "Top level"
    if section == PLUGIN_SECTION:
        return "Plugin entries"
    return f"`{paths[0]}`"


def _anchor(section: str) -> str:
    return "top-level" if section == TOP_LEVEL else f"section-{section.replace('_', '-')}"


def _section_text(section: str, paths: list[str]) -> str:
    lines = [f'<a id="{_anchor(section)}"></a>', "", f"## {_heading(section, paths)}", ""]
    if len(paths) > 1:
        lines += ["Written at " + ", ".join(f"`{path}`" for path in paths) + ".", ""]
    description = section_schema(section).get("description")
    if description:
        lines += [_escape(description), ""]
    if section == PLUGIN_SECTION:
        lines += ["An entry is the plugin's name alone (`ppo`), or a mapping of the keys below "
                  "(`{plugin: ppo, args: {epochs: 2}}`).", ""]
    lines += ["| Key | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
    for key in section_keys(section):
        lines.append(_row(key, paths))
    lines.append("")
    return "\n".join(lines)


def _row(key: Key, paths: list[str]) -> str:
    default = "**required**" if key.required else f"`{key.default_text}`"
    description = _escape(key.description)
    if key.subsection is not None:
        description += f" See [its keys](#{_anchor(key.subsection)})."
    cells = [f"`{key.name}`", _escape(key.type_text), default, _escape(key.allowed_text), description]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _escape(text: str) -> str:
    """Text shown as written: no HTML tags from ``<dir>``, no emphasis from ``__main__`` or ``stage3_*``, no link
    from ``server_memory()["decoding"]``."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace("*", "\\*")
    text = text.replace("[", "\\[").replace("]", "\\]")
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", text)
