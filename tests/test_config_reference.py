"""The configuration reference: every key of the schema is described and has a default (a required key says so
instead), the loader gives a config exactly those defaults, ``llmrl validate --resolved`` shows them beside the values
a config sets, and the generated page (docs/generators/config.py) has a row for every key. In-process and cheap:
nothing loads a model or imports torch."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from llmrl.engine.config import load_config
from llmrl.engine.config.checks import strict_validator
from llmrl.engine.config.reference import PLUGIN_SECTION, TOP_LEVEL, load_schema, section_keys
from llmrl.launch.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = load_schema()
# what a minimal config must add to reach every section: quantization, lr_schedule and a plugin entry are null unless
# given, and each of them has one required key
REACH_EVERY_SECTION = {"quantization": {"bits": 4}, "updater": "ppo", "training": {"lr_schedule": {"type": "constant"}}}


def every_property(node, path=""):
    """(dotted path, key's schema node, whether its parent requires it) for every key anywhere in the schema."""
    if isinstance(node, dict):
        required = set(node.get("required", ()))
        for key, sub in (node.get("properties") or {}).items():
            yield f"{path}.{key}".lstrip("."), sub, key in required
        for key, sub in node.items():
            if key != "properties" or not isinstance(sub, dict):
                yield from every_property(sub, f"{path}.{key}".lstrip("."))
            else:
                for name, prop in sub.items():
                    yield from every_property(prop, f"{path}.{name}".lstrip("."))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from every_property(item, f"{path}.{index}")


def referenced(node: dict) -> dict:
    ref = node.get("$ref", "")
    return SCHEMA["$defs"][ref.rsplit("/", 1)[-1]] if ref else {}


def test_every_key_has_a_description_and_a_default_or_is_required():
    keys = list(every_property(SCHEMA))
    assert len(keys) > 80  # the walk reached every section
    missing = []
    for path, node, required in keys:
        description = node.get("description") or referenced(node).get("description") or ""
        if not description.strip():
            missing.append(f"{path}: no description")
        if required:
            if "default" in node or not description.startswith("Required."):
                missing.append(f"{path}: a required key has no default and its description starts 'Required.'")
        elif "default" not in node:
            missing.append(f"{path}: no default (only keys the schema requires may go without)")
    assert missing == []


def test_the_keys_users_asked_about_are_described():
    llm = SCHEMA["$defs"]["llm"]["properties"]
    for key in ("tokenizer", "max_length", "prefix_reuse", "revision"):
        assert len(llm[key]["description"]) > 40, key
    assert "MB" in SCHEMA["$defs"]["generation"]["properties"]["cache_mb"]["description"]


def test_every_default_is_a_value_its_key_accepts():
    validator = strict_validator()
    wrong = []
    for path, node, _ in every_property(SCHEMA):
        if "default" in node and not validator({"$defs": SCHEMA["$defs"], **node}).is_valid(node["default"]):
            wrong.append(f"{path}: default {node['default']!r}")
    assert wrong == []


def plain(value):
    """A built config value in JSON's terms (tuples as lists), to compare with a schema default."""
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def compare_with_defaults(section: str, built, where: str, given: dict, wrong: list) -> None:
    """Every key of ``section`` that ``given`` leaves out: the built object's value equals the schema's default
    (a nested section the config leaves out: each of its keys, recursively)."""
    for key in section_keys(section):
        value = getattr(built, key.name)
        inner = given.get(key.name)
        nested = key.subsection not in (None, PLUGIN_SECTION) and dataclasses.is_dataclass(value)
        if nested:
            compare_with_defaults(key.subsection, value, f"{where}.{key.name}", inner or {}, wrong)
        elif key.name == "updater" and value is not None:
            compare_with_defaults(PLUGIN_SECTION, value, f"{where}.updater", {"plugin": value.plugin}, wrong)
        elif key.name not in given and not key.required:
            if plain(value) != key.default or type(plain(value)) is not type(key.default):
                wrong.append(f"{where}.{key.name}: built {value!r}, documented {key.default!r}")


@pytest.mark.parametrize("llm", [{}, REACH_EVERY_SECTION], ids=["minimal", "every-section"])
def test_a_loaded_config_gets_the_documented_defaults(llm):
    given = {"model": "builtin:smollm2-135m-instruct", **llm}
    config = load_config(raw={"llms": {"main": given}}, check_environment=False, check_plugins=False)
    wrong: list[str] = []
    compare_with_defaults(TOP_LEVEL, config, "config", {"llms": None}, wrong)
    compare_with_defaults("llm", config.llms["main"], "llms.main", given, wrong)
    assert wrong == []


def resolved_rows(output: str) -> dict[str, list[str]]:
    """``llmrl validate --resolved``'s table as {key: [set by, value, default]}."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["set", "by"])
    start = lines[header].index("key")
    value_at, default_at = lines[header].index("value"), lines[header].index("default")
    return {line[start:value_at].strip(): [line[:start].strip(), line[value_at:default_at].strip(),
                                           line[default_at:].strip()] for line in lines[header + 1:]}


def test_validate_resolved_shows_values_defaults_and_who_set_them(capsys):
    assert main(["validate", "--resolved", "configs/cpu-single.yaml", "llms.main.training.zero_stage=2"]) == 0
    rows = resolved_rows(capsys.readouterr().out)
    llm = {key.name: key for key in section_keys("llm")}
    training = {key.name: key for key in section_keys("training")}
    assert rows["llms.main.token_budget"] == ["config", "8192", llm["token_budget"].default_text]
    assert rows["llms.main.model"] == ["config", "builtin:smollm2-135m-instruct", "required"]
    assert rows["timeouts.request"][:2] == ["config", "600"]
    assert rows["llms.main.training.zero_stage"] == ["override", "2", training["zero_stage"].default_text]
    unset = rows["llms.main.training.micro_batch_size"]
    assert unset == ["", training["micro_batch_size"].default_text, training["micro_batch_size"].default_text]
    assert rows["llms.main.generation.cache_mb"][0] == "" and rows["tracking.backends"][1] == "[]"
    every_llm_key = {f"llms.main.{key.name}" for key in section_keys("llm") if key.subsection is None
                     or key.subsection == PLUGIN_SECTION}
    assert every_llm_key <= set(rows)


def render_config_page() -> str:
    spec = importlib.util.spec_from_file_location("config_page", ROOT / "docs" / "generators" / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render()


def test_the_reference_page_has_a_row_for_every_key_with_its_default():
    page = render_config_page()
    assert page == render_config_page()  # deterministic
    sections = [TOP_LEVEL, *SCHEMA["$defs"]]
    for section in sections:
        for key in section_keys(section):
            default = "**required**" if key.required else f"`{key.default_text}`"
            assert f"| `{key.name}` | {key.type_text} | {default} |" in page, f"{section}.{key.name}"
