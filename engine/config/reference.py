"""The config schema read as a reference: each key's description, default, type and allowed values.

``engine/config/schema.json`` is the one place where a key's default is written (its ``default``; a required key has
none and its description starts with "Required."). :func:`schema_field` turns a default into the dataclass field of
:mod:`llmrl.engine.config.types`; :func:`section_keys` lists a section's keys for ``llmrl validate --resolved`` and the
generated reference page (``docs/generators/config.py``); :func:`show` writes a value as a config would.

This module reads the schema with ``json`` only and imports nothing else from llmrl; it validates nothing (that is
:mod:`llmrl.engine.config.loading`'s job).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("schema.json")
TOP_LEVEL = ""  # the section name of the config's top level (every other section is a name under "$defs")
PLUGIN_SECTION = "plugin"  # the form of each updater, head and initializer entry


def load_schema() -> dict:
    """The schema, parsed afresh (callers may change their copy)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


_SCHEMA = load_schema()


def section_schema(section: str) -> dict:
    """The schema node of a section: the top level (``TOP_LEVEL``) or a name under ``$defs`` (llm, training, ...)."""
    return _SCHEMA if section == TOP_LEVEL else _SCHEMA["$defs"][section]


def schema_field(section: str, key: str, build: type | None = None) -> Any:
    """The dataclass field of ``key`` in ``section``, its default read from the schema: a JSON list becomes a tuple,
    a mapping a fresh copy per object, and with ``build`` (a nested section's dataclass) a mapping becomes
    ``build(**mapping)``. A required key (no default) gets a field without one."""
    node = section_schema(section)["properties"][key]
    if "default" not in node:
        return dataclasses.field()
    value = node["default"]
    if build is not None and isinstance(value, dict):
        return dataclasses.field(default_factory=lambda: build(**copy.deepcopy(value)))
    if isinstance(value, dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value))
    if isinstance(value, list):
        return dataclasses.field(default=tuple(value))
    return dataclasses.field(default=value)


def section_defaults(section: str) -> dict[str, Any]:
    """Every key of ``section`` that has a default, with it (for code that reads a raw mapping before it is built)."""
    return {key: node["default"] for key, node in section_schema(section)["properties"].items() if "default" in node}


@dataclass(frozen=True)
class Key:
    """One key of a section, as the reference shows it."""

    name: str
    node: dict  # the key's schema node (a "$ref" to a section is followed for its description)
    required: bool
    subsection: str | None  # the "$defs" section this key's value holds (a mapping, a plugin entry...), if any

    @property
    def description(self) -> str:
        return self.node.get("description") or _target(self.node).get("description", "")

    @property
    def default(self) -> Any:
        """The default (None for null); a required key has none: see :attr:`required`."""
        return self.node.get("default")

    @property
    def default_text(self) -> str:
        return "required" if self.required else show(self.default)

    @property
    def type_text(self) -> str:
        return _type_text(self.node)

    @property
    def allowed_text(self) -> str:
        return _allowed_text(self.node)


def section_keys(section: str) -> list[Key]:
    """The keys of ``section`` in the schema's order."""
    node = section_schema(section)
    required = set(node.get("required", ()))
    return [Key(name, sub, name in required, _subsection(sub)) for name, sub in node["properties"].items()]


def _ref_name(node: dict) -> str | None:
    ref = node.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def _target(node: dict) -> dict:
    name = _ref_name(node)
    return _SCHEMA["$defs"][name] if name else {}


def _subsection(node: dict) -> str | None:
    """The section a key's value holds, directly, as one of its alternatives, its list's items or its mapping's
    values."""
    for candidate in (node, *node.get("anyOf", ()), node.get("items") or {}, node.get("additionalProperties") or {}):
        if isinstance(candidate, dict) and _ref_name(candidate):
            return _ref_name(candidate)
    return None


def show(value: Any) -> str:
    """A value written as in a YAML config: null, true, 1.0e-04, [a, b], {key: value}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {show(item)}" for key, item in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return show({field.name: getattr(value, field.name) for field in dataclasses.fields(value)})
    text = str(value)
    return repr(text) if text == "" else text


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def _type_text(node: dict) -> str:
    if "$ref" in node:
        target = _target(node).get("type")
        nullable = isinstance(target, list) and "null" in target
        return "plugin" if _ref_name(node) == PLUGIN_SECTION else "mapping or null" if nullable else "mapping"
    if "type" not in node and "anyOf" in node:
        return " or ".join(dict.fromkeys(_type_text(alternative) for alternative in node["anyOf"]))
    if "type" not in node and ("enum" in node or "const" in node):
        values = node.get("enum", [node.get("const")])
        return " or ".join(dict.fromkeys(_JSON_TYPES[type(value)] for value in values))
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    words = []
    for kind in kinds:
        if kind == "array":
            words.append(f"list of {_plural(_type_text(node.get('items') or {}))}")
        elif kind == "object":
            words.append(f"mapping of {_plural(_type_text(node['additionalProperties']))}"
                         if isinstance(node.get("additionalProperties"), dict) else "mapping")
        else:
            words.append(kind)
    return " or ".join(words)


def _plural(text: str) -> str:
    return " or ".join(word if word.endswith("s") else word + "s" for word in text.split(" or "))


def _allowed_text(node: dict) -> str:
    """Allowed values or ranges, as short as the schema allows: one of a, b; >= 1; 0 or >= 16; non-empty."""
    if "anyOf" in node and "x-hint" in node:
        return node["x-hint"].removeprefix("write ")
    parts = []
    if "enum" in node:
        parts.append(", ".join(show(value) for value in node["enum"]))
    for alternative in node.get("anyOf", ()):
        text = "null" if alternative.get("type") == "null" else _allowed_text(alternative)
        if text:
            parts.append(text)
    if "const" in node:
        parts.append(show(node["const"]))
    bounds = [f"{sign} {show(node[word])}" for word, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                               ("maximum", "<="), ("exclusiveMaximum", "<"))
              if word in node]
    if bounds:
        parts.append(", ".join(bounds))
    if node.get("minLength") == 1:
        parts.append("non-empty")
    items = node.get("items")
    if isinstance(items, dict) and "$ref" not in items and _allowed_text(items):
        parts.append(f"items: {_allowed_text(items)}")
    if node.get("minItems") and node.get("minItems") == node.get("maxItems"):
        parts.append(f"{node['minItems']} items")
    elif node.get("minItems"):
        parts.append(f"at least {node['minItems']} item(s)")
    if node.get("uniqueItems"):
        parts.append("no repeats")
    if "propertyNames" in node:
        parts.append("names: letters, digits, _ and -, not starting with a digit or -")
    return "; ".join(dict.fromkeys(parts)) if "anyOf" not in node else " or ".join(dict.fromkeys(parts))


def given_or_default(mapping: dict | None, section: str, key: str) -> Any:
    """``key`` of a raw config mapping (of ``section``), or its schema default where the mapping leaves it out (for
    checks that read the mapping before it is built)."""
    mapping = mapping or {}
    return mapping[key] if key in mapping else section_schema(section)["properties"][key]["default"]
