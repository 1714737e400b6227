"""``llmrl validate --resolved``: every key of a loaded config, with its value, its default, and who set it.

Each row is one key by its dotted path (``llms.main.training.zero_stage``, the path an override takes), the value
the run gets, the schema's default (``required`` for a key without one), and whether the config file or a
command-line override set the value (blank: the default applies). Keys are walked in the schema's order
(:func:`llmrl.engine.config.reference.section_keys`); a plugin entry (updater, heads, initializers) is one value,
its ``args`` included. This module only formats a config that :func:`llmrl.engine.config.load_config` built; it
checks nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llmrl.engine.config.reference import PLUGIN_SECTION, TOP_LEVEL, section_keys, show
from llmrl.engine.config.types import Config, PluginSpec

VALUE_WIDTH_CAP = 40  # wider values push their row's default to the right instead of widening every row


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    value: str
    default: str
    set_by: str  # "config", "override", or "" where the default applies


def resolved_rows(config: Config, file_data: dict, overrides: list[str]) -> list[Row]:
    """One row per key of ``config`` (built from ``file_data`` with ``overrides`` applied)."""
    override_paths = [text.partition("=")[0].split(".") for text in overrides]
    rows: list[Row] = []

    def walk(section: str, holder: Any, path: list[str]) -> None:
        for key in section_keys(section):
            value, here = getattr(holder, key.name), [*path, key.name]
            opens_section = key.subsection not in (None, PLUGIN_SECTION)
            if opens_section and isinstance(value, dict) and isinstance(key.node.get("additionalProperties"), dict):
                for name, item in value.items():  # llms: one section per LLM
                    walk(key.subsection, item, [*here, name])
            elif opens_section and dataclasses.is_dataclass(value):
                walk(key.subsection, value, here)
            else:
                rows.append(Row(".".join(here), show(_plain(value)), key.default_text,
                                _set_by(here, file_data, override_paths)))

    walk(TOP_LEVEL, config, [])
    return rows


def resolved_table(config: Config, file_data: dict, overrides: list[str]) -> str:
    """The rows as aligned text, with a heading that says what the columns mean."""
    rows = resolved_rows(config, file_data, overrides)
    key_width = max(len(row.path) for row in rows)
    value_width = min(VALUE_WIDTH_CAP, max(len(row.value) for row in rows))
    lines = ["resolved config: every key, the value the run gets and its default (set by: the config file or an "
             "override on the command line; blank: the default applies)",
             f"  {'set by':<8}  {'key':<{key_width}}  {'value':<{value_width}}  default"]
    lines += [f"  {row.set_by:<8}  {row.path:<{key_width}}  {row.value:<{value_width}}  {row.default}".rstrip()
              for row in rows]
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    """A built config value back in the form a config writes it: a plugin as its name (or {plugin, args}), tuples
    as lists."""
    if isinstance(value, PluginSpec):
        return value.plugin if not value.args else {"plugin": value.plugin, "args": value.args}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _set_by(path: list[str], file_data: dict, override_paths: list[list[str]]) -> str:
    """"override" where an override sets this key, a key above it or a key inside its value; "config" where the
    file gives it; "" otherwise."""
    for override in override_paths:
        shorter = min(len(override), len(path))
        if override[:shorter] == path[:shorter]:
            return "override"
    node: Any = file_data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return ""
        node = node[part]
    return "config"
