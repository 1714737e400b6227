"""Load an llmrl config: YAML file -> command-line overrides -> JSON Schema -> checks -> frozen objects.

Every problem is collected and reported at once (:class:`~llmrl.engine.errors.ConfigError`), each
with its dotted path and a hint. Checks that need the machine (does the model folder exist, is there
a GPU, is bitsandbytes installed, do the attention heads divide by the tensor-parallel size, do the
named plugins exist and accept their arguments) run after the schema, still before any model loads.

This module does not start processes, build DeepSpeed configs or load models.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmrl.engine.errors import ConfigError

SCHEMA_PATH = Path(__file__).with_name("config_schema.json")
BUILTIN_MODEL_PREFIX = "builtin:"

Problem = tuple[str, str]


# ----------------------------------------------------------------------------- typed config


@dataclass(frozen=True)
class PluginSpec:
    """A plugin named in the config: an entry-point name, ``module:attr`` or ``__main__:Name``."""

    plugin: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizationConfig:
    bits: int = 4
    quant_type: str = "nf4"
    compute_dtype: str = "float32"
    double_quant: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adam"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0


@dataclass(frozen=True)
class TrainingConfig:
    zero_stage: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    deepspeed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LLMConfig:
    name: str
    model: str
    tokenizer: str | None = None
    type: str = "causal"
    from_pretrained: bool = True
    dtype: str = "float32"
    replicas: int = 1
    tensor_parallel: int = 1
    devices: str | tuple[int, ...] = "cpu"
    minibatch_size: int = 64
    token_budget: int = 8192
    max_length: int | None = None
    prefix_reuse: bool = True
    trust_remote_code: bool = False
    revision: str | None = None
    quantization: QuantizationConfig | None = None
    initializers: tuple[PluginSpec, ...] = ()
    heads: dict[str, PluginSpec] = field(default_factory=dict)
    updater: PluginSpec | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: str | None = None

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.tensor_parallel

    @property
    def on_gpu(self) -> bool:
        return self.devices != "cpu"


@dataclass(frozen=True)
class Timeouts:
    startup: float = 600.0
    request: float | None = 3600.0
    heartbeat: float = 1.0
    dead_after: float = 20.0
    collective: float = 1800.0


@dataclass(frozen=True)
class Config:
    llms: dict[str, LLMConfig]
    seed: int = 0
    threads_per_rank: int | None = None
    log_level: str = "info"
    timeouts: Timeouts = field(default_factory=Timeouts)
    source: str | None = None

    @property
    def default_llm(self) -> str:
        return next(iter(self.llms))

    @property
    def num_server_ranks(self) -> int:
        return sum(llm.num_ranks for llm in self.llms.values())

    @property
    def world_size(self) -> int:
        """Ranks the launcher must start: the client (rank 0) plus every server rank."""
        return 1 + self.num_server_ranks


# ----------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                raw: dict | None = None, check_environment: bool = True, check_plugins: bool = True,
                check_devices: bool = True) -> Config:
    """Load and validate a config; raise :class:`ConfigError` listing every problem.

    Args:
        path: the YAML file (or pass ``raw``, an already-parsed mapping).
        overrides: ``dotted.key=value`` strings; values are parsed as YAML (``replicas=2`` is an int).
        check_environment: also check the machine (model paths, GPUs, bitsandbytes, head divisibility).
        check_plugins: also resolve the named plugins and check their arguments against their schemas.
        check_devices: with ``check_environment``, also require the GPUs the config names on this machine
            (``llmrl validate`` on a login node without GPUs turns it off).
    """
    source = str(path) if path is not None else None
    data = load_yaml(path) if raw is None else copy.deepcopy(raw)
    problems: list[Problem] = []
    data = apply_overrides(data, list(overrides), problems)
    problems += schema_problems(data)
    if not problems:
        problems += semantic_problems(data)
    if not problems and check_environment:
        problems += environment_problems(data, check_devices=check_devices)
    if not problems and check_plugins:
        from llmrl.plugins.registry import plugin_problems

        problems += plugin_problems(data)
    if problems:
        raise ConfigError(problems, source)
    return build_config(data, source)


def load_yaml(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError([("", f"config file {str(p)!r} does not exist")], str(p))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError([("", f"not valid YAML: {err}")], str(p)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the top level must be a mapping, got {type(data).__name__}")], str(p))
    return data


def apply_overrides(data: dict, overrides: list[str], problems: list[Problem]) -> dict:
    """Apply ``a.b.c=value`` overrides to a copy of ``data``; malformed ones are added to ``problems``."""
    import yaml

    data = copy.deepcopy(data)
    for text in overrides:
        key, sep, value_text = text.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append((key or text, f"override {text!r} is not of the form dotted.key=value"))
            continue
        try:
            value = yaml.safe_load(value_text) if value_text != "" else ""
        except yaml.YAMLError as err:
            problems.append((key, f"override value {value_text!r} is not valid YAML: {err}"))
            continue
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append((".".join(parts[: i + 1]), f"cannot set {key}: this key holds a {type(child).__name__}"))
                break
            node = child
        else:
            node[parts[-1]] = value
    return data


# ----------------------------------------------------------------------------- schema


def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "gpu": "auto", "cuda": "auto", "decoder": "causal", "encoder-decoder": "seq2seq", "adam_w": "adamw"}


def schema_problems(data: dict) -> list[Problem]:
    """Validate against the JSON Schema; one readable problem per schema error."""
    import jsonschema

    schema = load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    problems: list[Problem] = []
    for error in sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]):
        problems.extend(_explain(error))
    return problems


def _explain(error) -> list[Problem]:
    path = _dotted(error.absolute_path)
    kind = error.validator
    schema = error.schema
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        out = []
        for key in extra:
            hint = _suggest(key, allowed) or (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            out.append((_dotted([*error.absolute_path, key]), f"unknown key {key!r}{hint}"))
        return out or [(path, error.message)]
    if kind == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return [(path, f"missing required key {missing!r}")]
    if kind == "type":
        expected = schema.get("type")
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return [(path, f"expected {expected}, got {_describe(error.instance)}")]
    if kind == "enum":
        options = ", ".join(json.dumps(o) for o in schema["enum"])
        alias = _ALIASES.get(str(error.instance).lower())
        hint = f"; did you mean {alias!r}?" if alias in schema["enum"] else _suggest(error.instance, schema["enum"])
        return [(path, f"{json.dumps(error.instance)} is not one of {options}{hint}")]
    if kind in ("anyOf", "oneOf"):
        hint = schema.get("x-hint", "see the schema's description")
        return [(path, f"{_describe(error.instance)} is not accepted here: {hint}")]
    if kind == "pattern" and "propertyNames" in error.schema_path:
        return [(path, f"name {error.instance!r} is not allowed: use letters, digits, '_' and '-', starting with a "
                       "letter or '_'")]
    if kind == "propertyNames":
        return [(path, f"name {error.instance!r} is not allowed: use letters, digits, '_' and '-', starting with a letter")]
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        return [(path, f"must be {sign} {error.validator_value}, got {error.instance}")]
    if kind == "minProperties":
        return [(path, "must name at least one entry")]
    return [(path, error.message)]


# ----------------------------------------------------------------------------- checks


def semantic_problems(data: dict) -> list[Problem]:
    """Checks across keys that the schema cannot express; pure (no environment)."""
    problems: list[Problem] = []
    for name, llm in data["llms"].items():
        at = f"llms.{name}"
        replicas, tp = llm.get("replicas", 1), llm.get("tensor_parallel", 1)
        devices = llm.get("devices", "cpu")
        if isinstance(devices, list):
            if len(devices) != replicas * tp:
                problems.append((f"{at}.devices", f"lists {len(devices)} GPU id(s) but the LLM has replicas x "
                                 f"tensor_parallel = {replicas} x {tp} = {replicas * tp} ranks; give one id per rank"))
        dtype = llm.get("dtype", "float32")
        if dtype == "float16" and devices == "cpu":
            problems.append((f"{at}.dtype", "float16 is not supported on CPU; use float32 (bfloat16 is very slow on CPU)"))
        quant = llm.get("quantization")
        if quant:
            if tp > 1:
                problems.append((f"{at}.quantization", "quantized models cannot be tensor-parallel; set tensor_parallel: 1"))
            if llm.get("training", {}).get("zero_stage", 0) == 3:
                problems.append((f"{at}.quantization", "quantized models cannot be trained with ZeRO-3; use zero_stage 0-2"))
            if not llm.get("from_pretrained", True):
                problems.append((f"{at}.quantization", "quantization needs from_pretrained: true (weights to quantize)"))
        if llm.get("checkpoint") and not Path(os.path.expanduser(llm["checkpoint"])).exists():
            problems.append((f"{at}.checkpoint", f"checkpoint {llm['checkpoint']!r} does not exist; "
                             "give a folder written by Caller.save(path)"))
    return problems


def looks_like_local_path(model: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that names a folder is a local path."""
    return model.startswith(("/", ".", "~")) or model.rstrip("/").count("/") > 1


def environment_problems(data: dict, check_devices: bool = True) -> list[Problem]:
    """Checks that look at this machine: model folders, GPUs (unless ``check_devices`` is false), bitsandbytes,
    tensor-parallel divisibility."""
    problems: list[Problem] = []
    cuda_available: bool | None = None
    for name, llm in data["llms"].items():
        at = f"llms.{name}"
        model = llm["model"]
        if model.startswith(BUILTIN_MODEL_PREFIX):
            from llmrl.engine.builtin_models import BUILTIN_MODELS

            builtin = model[len(BUILTIN_MODEL_PREFIX):]
            if builtin not in BUILTIN_MODELS:
                problems.append((f"{at}.model", f"unknown builtin model {builtin!r}{_suggest(builtin, BUILTIN_MODELS)}; "
                                 f"available: {', '.join(sorted(BUILTIN_MODELS))}"))
        else:
            local = Path(os.path.expanduser(model))
            if not local.exists() and looks_like_local_path(model):
                problems.append((f"{at}.model", f"model path {model!r} does not exist (a hub id looks like 'org/name')"))
        if check_devices and llm.get("devices", "cpu") != "cpu":
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
            if not cuda_available:
                problems.append((f"{at}.devices", f"{llm['devices']!r} asks for GPUs but CUDA is not available on this "
                                 "machine; use devices: cpu"))
        if llm.get("quantization") and importlib.util.find_spec("bitsandbytes") is None:
            problems.append((f"{at}.quantization", "needs the bitsandbytes package: pip install bitsandbytes"))
        tp = llm.get("tensor_parallel", 1)
        if tp > 1:
            problems += _tensor_parallel_problems(at, llm, tp)
    return problems


def _tensor_parallel_problems(at: str, llm: dict, tp: int) -> list[Problem]:
    model = llm["model"]
    if model.startswith(BUILTIN_MODEL_PREFIX):
        from llmrl.engine.builtin_models import builtin_model_config

        hf_config = builtin_model_config(model[len(BUILTIN_MODEL_PREFIX):])
    elif Path(os.path.expanduser(model)).is_dir():
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(os.path.expanduser(model),
                                                   trust_remote_code=llm.get("trust_remote_code", False))
        except Exception as err:  # noqa: BLE001 - reported as a config problem
            return [(f"{at}.model", f"cannot read the model config: {err}")]
    else:
        return []  # a hub id: checked when the model loads
    if hf_config is None:
        return []
    problems = []
    model_type = getattr(hf_config, "model_type", "?")
    if model_type in ("gpt2", "gpt_bigcode"):
        problems.append((f"{at}.tensor_parallel", f"DeepSpeed AutoTP does not support {model_type} models; "
                         "use tensor_parallel: 1 (replicas work) or a Llama/Qwen/Mistral/OPT/T5-family model"))
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text_config, "num_attention_heads", None) or getattr(text_config, "num_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    for label, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count is not None and count % tp != 0:
            problems.append((f"{at}.tensor_parallel", f"{tp} does not divide the model's {count} {label}; "
                             f"choose a divisor of {count}"))
    return problems


# ----------------------------------------------------------------------------- building


def _plugin_spec(value) -> PluginSpec:
    if isinstance(value, str):
        return PluginSpec(plugin=value, args={})
    return PluginSpec(plugin=value["plugin"], args=dict(value.get("args") or {}))


def build_config(data: dict, source: str | None = None) -> Config:
    """Turn a validated mapping into frozen, typed objects with every default filled in."""
    llms = {}
    for name, raw in data["llms"].items():
        training_raw = dict(raw.get("training") or {})
        optimizer = OptimizerConfig(**{**training_raw.pop("optimizer", {})})
        if isinstance(optimizer.betas, list):
            optimizer = OptimizerConfig(**{**optimizer.__dict__, "betas": tuple(optimizer.betas)})
        training = TrainingConfig(optimizer=optimizer, **training_raw)
        quant = raw.get("quantization")
        devices = raw.get("devices", "cpu")
        llms[name] = LLMConfig(
            name=name,
            model=raw["model"],
            tokenizer=raw.get("tokenizer"),
            type=raw.get("type", "causal"),
            from_pretrained=raw.get("from_pretrained", True),
            dtype=raw.get("dtype", "float32"),
            replicas=raw.get("replicas", 1),
            tensor_parallel=raw.get("tensor_parallel", 1),
            devices=tuple(devices) if isinstance(devices, list) else devices,
            minibatch_size=raw.get("minibatch_size", 64),
            token_budget=raw.get("token_budget", 8192),
            max_length=raw.get("max_length"),
            prefix_reuse=raw.get("prefix_reuse", True),
            trust_remote_code=raw.get("trust_remote_code", False),
            revision=raw.get("revision"),
            quantization=QuantizationConfig(**quant) if quant else None,
            initializers=tuple(_plugin_spec(p) for p in raw.get("initializers") or ()),
            heads={key: _plugin_spec(p) for key, p in (raw.get("heads") or {}).items()},
            updater=_plugin_spec(raw["updater"]) if raw.get("updater") else None,
            training=training,
            checkpoint=raw.get("checkpoint"),
        )
    return Config(
        llms=llms,
        seed=data.get("seed", 0),
        threads_per_rank=data.get("threads_per_rank"),
        log_level=data.get("log_level", "info"),
        timeouts=Timeouts(**(data.get("timeouts") or {})),
        source=source,
    )


def world_size_problem(config: Config, world_size: int) -> str | None:
    """The message for a launch whose rank count does not match the config, or None."""
    if world_size == config.world_size:
        return None
    parts = " + ".join(f"{llm.replicas} x {llm.tensor_parallel} ({name})" for name, llm in config.llms.items())
    return (f"the launcher started {world_size} rank(s) but the config needs {config.world_size}: 1 client + {parts} "
            f"server ranks. Launch with `deepspeed --num_gpus {config.world_size} ...` (or a hostfile with "
            f"{config.world_size} slots in all), or use `llmrl run`, which counts them for you.")
