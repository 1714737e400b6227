"""Load an llmrl config: YAML file -> command-line overrides -> JSON Schema -> checks -> frozen objects.

Every problem is collected and reported at once (:class:`~llmrl.engine.errors.ConfigError`), each
with its dotted path and a hint; a problem of an LLM that only an override created (a misspelt name) also
suggests the config's closest LLM name. The checks that look across keys or at the machine live in
:mod:`llmrl.engine.config.checks`; the typed objects in :mod:`llmrl.engine.config.types` (their defaults are the
schema's).

This module does not start processes, build DeepSpeed configs or load models.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

from llmrl.engine.config.checks import (
    environment_problems,
    semantic_problems,
    strict_validator,
)
from llmrl.engine.config.reference import load_schema
from llmrl.engine.config.types import (
    Config,
    GenerationSettings,
    LLMConfig,
    LRSchedule,
    OptimizerConfig,
    PluginSpec,
    QuantizationConfig,
    Timeouts,
    TrackingConfig,
    TrainingConfig,
)
from llmrl.engine.config.yaml12 import yaml_load
from llmrl.engine.errors import ConfigError, did_you_mean

Problem = tuple[str, str]

def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                raw: dict | None = None, check_environment: bool = True, check_plugins: bool = True,
                check_devices: bool = True, single_node: bool | None = None) -> Config:
    """Load and validate a config; raise :class:`ConfigError` listing every problem.

    Args:
        path: the YAML file (or pass ``raw``, an already-parsed mapping).
        overrides: ``dotted.key=value`` strings; values are parsed as YAML (``replicas=2`` is an int).
        check_environment: also check the machine (model paths, GPUs, bitsandbytes, head divisibility).
        check_plugins: also resolve the named plugins and check their arguments against their schemas.
        check_devices: with ``check_environment``, also require the GPUs the config names on this machine
            (``llmrl validate`` on a login node without GPUs turns it off).
        single_node: with ``check_devices``, whether every rank runs on this machine, for the check of ``devices:
            auto`` against its GPUs; None: known inside a launched rank only (the launcher says), else not checked.
    """
    source = str(path) if path is not None else None
    data = load_yaml(path) if raw is None else copy.deepcopy(raw)
    problems: list[Problem] = []
    given_llms = list(data.get("llms") or {}) if isinstance(data.get("llms"), dict) else []
    data = apply_overrides(data, list(overrides), problems)
    problems += schema_problems(data)
    if not problems:
        problems += semantic_problems(data)
    if not problems and check_environment:
        problems += environment_problems(data, check_devices=check_devices, single_node=single_node)
    if not problems and check_plugins:
        from llmrl.plugins.registry import plugin_problems

        problems += plugin_problems(data)
    if problems:
        raise ConfigError(created_llm_hints(problems, data, given_llms), source)
    return build_config(data, source)


def created_llm_hints(problems: list[Problem], data: dict, given: list[str]) -> list[Problem]:
    """``problems`` with a "did you mean" hint added to those of an LLM that only the overrides created, against the
    names the config itself gives (``llms.polcy.replicas=2`` creates an LLM ``polcy`` beside ``policy``)."""
    llms = data.get("llms") if isinstance(data.get("llms"), dict) else {}
    created = [name for name in llms if name not in given]
    if not created or not given:
        return problems
    out = []
    for path, message in problems:
        for name in created:
            if path == f"llms.{name}" or path.startswith(f"llms.{name}."):
                close = difflib.get_close_matches(name, given, n=1)
                if close:
                    message = (f"{message}; an override created this new LLM {name!r}: did you mean {close[0]!r}? "
                               f"(the config defines {', '.join(given)})")
                break
        out.append((path, message))
    return out


def load_yaml(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError([("", f"config file {str(p)!r} does not exist")], str(p))
    try:
        data = yaml_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError([("", f"not valid YAML: {err}")], str(p)) from None
    except UnicodeDecodeError as err:
        raise ConfigError([("", f"not UTF-8 text (byte {err.start}): save the file as UTF-8")], str(p)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the top level must be a mapping, got {type(data).__name__}")], str(p))
    return data


def apply_overrides(data: dict, overrides: list[str], problems: list[Problem]) -> dict:
    """Apply ``a.b.c=value`` overrides to a copy of ``data``; malformed ones are added to ``problems``. A part that
    meets a list is an index into it (``initializers.0.args.adapters.default.r=16``); values are YAML (1.2 numbers:
    ``optimizer.lr=1e-2`` is a float)."""
    import yaml

    data = copy.deepcopy(data)
    for text in overrides:
        key, sep, value_text = text.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append((key or text, f"override {text!r} is not of the form dotted.key=value"))
            continue
        try:
            value = yaml_load(value_text) if value_text != "" else ""
        except yaml.YAMLError as err:
            problems.append((key, f"override value {value_text!r} is not valid YAML: {err}"))
            continue
        parts = key.split(".")
        node, problem = data, None
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    problem = (f"cannot set {key}: {'.'.join(parts[:i]) or 'the config'} is a list of {len(node)} "
                               f"item(s); index it with 0..{len(node) - 1}")
                    break
                part = int(part)
            elif not isinstance(node, dict):
                problem = (f"cannot set {key}: {'.'.join(parts[:i])} holds a {type(node).__name__}, not a mapping or "
                           "a list")
                break
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
        if problem:
            problems.append((key, problem))
    return data


# ----------------------------------------------------------------------------- schema


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _plugin_object_problem(path: list, value: Any) -> str | None:
    """A class, instance or function in a plugin entry of a config built in Python: how a config names it."""
    import inspect

    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = value[0]  # Caller(...)'s (class, args)
    python_object = inspect.isclass(value) or inspect.isroutine(value) or type(value).__module__ != "builtins"
    entry = len(path) == 3 and path[2] == "updater" or len(path) == 4 and path[2] in ("heads", "initializers")
    if not (python_object and entry):  # llms.<name>.updater, llms.<name>.heads.<key>, llms.<name>.initializers.<i>
        return None
    from llmrl.plugins.checks import accepted_form

    kind = {"heads": "head", "initializers": "initializer", "updater": "updater"}[path[2]]
    key = str(path[3]) if kind == "head" and len(path) > 3 else "value"
    if inspect.isroutine(value):
        return (f"the function {getattr(value, '__name__', value)!r}: a config names plugin classes, written "
                "'module:Class' (each contract is a class: see llmrl.plugins.contracts)")
    cls = value if inspect.isclass(value) else type(value)
    what = f"the class {cls.__name__}" if cls is value else f"an instance of {cls.__name__}"
    name = f"{cls.__module__}:{cls.__qualname__}"
    return (f"{what}: a config names its plugins and holds no Python objects (each server rank builds its own): "
            f"write {name!r}, or {{plugin: {name!r}, args: {{...}}}} for its constructor's arguments; or give the "
            f"class from your script to Caller(...): {accepted_form(kind, cls.__name__, key)}")


_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "gpu": "auto", "cuda": "auto", "decoder": "causal", "encoder-decoder": "seq2seq", "adam_w": "adamw"}


def schema_problems(data: dict, section: str | None = None) -> list[Problem]:
    """Validate against the JSON Schema (or, with ``section``, the value of that top-level key against its
    definition); one readable problem per schema error. The names of ``tracking.backends`` are checked here too,
    against :mod:`llmrl.engine.client.tracking.registry` (installed packages add back ends: the schema cannot list
    them)."""
    schema = load_schema()
    if section is not None:
        schema = {"$defs": schema["$defs"], **schema["properties"][section]}
    validator = strict_validator()(schema)  # 2.0 is no integer: replicas: 2.0 would break later
    problems: list[Problem] = []
    for error in sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]):
        problems.extend(_explain(error))
    problems.extend(non_finite_problems(data))
    tracking = data if section == "tracking" else data.get("tracking") if section is None else None
    if isinstance(tracking, dict) and tracking.get("backends"):
        from llmrl.engine.client.tracking.registry import name_problems

        problems.extend(name_problems(tracking["backends"], "backends" if section else "tracking.backends"))
    if section is not None:
        problems = [(".".join(p for p in (section, path) if p), message) for path, message in problems]
    return problems


def non_finite_problems(value, path: str = "") -> list[Problem]:
    """NaN or an infinity anywhere in a config (``.nan``, ``.inf``, ``lr=.nan`` on the command line), also under a
    plugin's ``args``: JSON Schema's bounds let NaN through (every comparison with it is false), and one NaN
    learning rate or clipping threshold turns every weight into NaN without an error."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(path, f"{value} is not a finite number; give a number (or null where the field allows none)")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite_problems(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in non_finite_problems(v, f"{path}.{i}")]
    return []


def tracking_config(base: TrackingConfig, given) -> TrackingConfig:
    """The tracking settings of a Caller: ``base`` (the config's) with the keys ``given`` names replaced. ``given`` is
    None (``base``), False (no back end), a back end's name or a list of names, or a mapping of ``tracking`` keys.

    Raises:
        ValueError: ``given`` breaks the ``tracking`` section's schema (every problem, with its dotted path).
    """
    if given is None:
        return base
    if given is False:
        given = {"backends": []}
    elif isinstance(given, str):
        given = {"backends": [given]}
    elif isinstance(given, (list, tuple)):
        given = {"backends": list(given)}
    elif not isinstance(given, dict):
        raise ValueError(f"tracking: expected a mapping of tracking keys, a back end's name, a list of them or False, "
                         f"got {type(given).__name__}")
    problems = schema_problems(given, "tracking")
    if problems:
        raise ValueError("; ".join(f"{path}: {message}" for path, message in problems))
    fields = {**base.__dict__, **given}
    return TrackingConfig(**{**fields, "backends": tuple(fields["backends"])})


def _explain(error) -> list[Problem]:
    path = _dotted(error.absolute_path)
    plugin_object = _plugin_object_problem(list(error.absolute_path), error.instance)
    if plugin_object:
        return [(path, plugin_object)]
    kind = error.validator
    schema = error.schema
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        out = []
        for key in extra:
            hint = did_you_mean(key, allowed) or (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            out.append((_dotted([*error.absolute_path, key]), f"unknown key {key!r}{hint}"))
        return out or [(path, error.message)]
    if kind == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return [(path, f"missing required key {missing!r}")]
    if kind == "type":
        expected = schema.get("type")
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        hint = f"; write {schema['x-hint']}" if "x-hint" in schema else ""
        return [(path, f"expected {expected}, got {_describe(error.instance)}{hint}")]
    if kind == "enum":
        options = ", ".join(json.dumps(o) for o in schema["enum"])
        alias = _ALIASES.get(str(error.instance).lower())
        hint = (f" (did you mean {alias!r}?)" if alias in schema["enum"]
                else did_you_mean(error.instance, schema["enum"]))
        return [(path, f"{json.dumps(error.instance)} is not one of {options}{hint}")]
    if kind in ("anyOf", "oneOf"):
        hint = schema.get("x-hint", "see the schema's description")
        return [(path, f"{_describe(error.instance)} is not accepted here: {hint}")]
    if kind == "pattern" and "propertyNames" in error.schema_path:
        return [(path, f"name {error.instance!r} is not allowed: use letters, digits, '_' and '-', starting with a "
                       "letter or '_'")]
    if kind == "pattern" and "x-hint" in schema:
        return [(path, f"{error.instance!r} is not allowed here: write {schema['x-hint']}")]
    if kind == "propertyNames":
        return [(path,
                 f"name {error.instance!r} is not allowed: use letters, digits, '_' and '-', starting with a letter")]
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        return [(path, f"must be {sign} {error.validator_value}, got {error.instance}")]
    if kind == "minProperties":
        return [(path, "must name at least one entry")]
    return [(path, error.message)]


# ----------------------------------------------------------------------------- building


def build_config(data: dict, source: str | None = None) -> Config:
    """Turn a validated mapping into frozen, typed objects. Only the keys present are passed on: every default
    comes from the schema, through :mod:`llmrl.engine.config.types`."""
    llms = {name: _llm_config(name, raw) for name, raw in data["llms"].items()}
    top = {key: data[key] for key in ("seed", "threads_per_rank", "host_malloc", "cpu_matmul", "log_level",
                                        "max_message_bytes")
           if key in data}
    tracking = dict(data.get("tracking") or {})
    if "backends" in tracking:
        tracking["backends"] = tuple(tracking["backends"])
    return Config(llms=llms, timeouts=Timeouts(**(data.get("timeouts") or {})), tracking=TrackingConfig(**tracking),
                  source=source, **top)


def _llm_config(name: str, raw: dict) -> LLMConfig:
    fields = dict(raw)
    training = dict(fields.pop("training", None) or {})
    optimizer = dict(training.pop("optimizer", None) or {})
    if "betas" in optimizer:
        optimizer["betas"] = tuple(optimizer["betas"])
    if training.get("lr_schedule") is not None:
        training["lr_schedule"] = LRSchedule(**training["lr_schedule"])
    fields["training"] = TrainingConfig(optimizer=OptimizerConfig(**optimizer), **training)
    fields["generation"] = GenerationSettings(**(fields.get("generation") or {}))
    quantization = fields.pop("quantization", None)
    if quantization:
        fields["quantization"] = QuantizationConfig(**quantization)
    if isinstance(fields.get("devices"), list):
        fields["devices"] = tuple(fields["devices"])
    fields["initializers"] = tuple(PluginSpec.coerce(p) for p in fields.get("initializers") or ())
    fields["heads"] = {key: PluginSpec.coerce(p) for key, p in (fields.get("heads") or {}).items()}
    fields["updater"] = PluginSpec.coerce(fields["updater"]) if fields.get("updater") else None
    fields["model_kwargs"] = dict(fields.get("model_kwargs") or {})
    return LLMConfig(name=name, **fields)
