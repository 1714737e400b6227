"""Checks of a config that the JSON Schema cannot express: across keys, and against this machine.

:func:`semantic_problems` is pure (it reads the mapping only); :func:`environment_problems` looks at the
machine (model folders, GPUs, bitsandbytes, tensor-parallel divisibility) and may read a model's config.
Both return ``(dotted path, message)`` problems; neither raises. :func:`world_size_problem` words a launch
whose rank count does not match the config.

This module loads no model weights and starts nothing.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from llmrl.engine.config.types import TRACKING_PACKAGES, Config
from llmrl.engine.errors import did_you_mean

BUILTIN_MODEL_PREFIX = "builtin:"

Problem = tuple[str, str]

# from_pretrained arguments that llmrl sets from its own keys: llms.<name>.model_kwargs may not set them.
RESERVED_MODEL_KWARGS = {
    "dtype": "dtype", "torch_dtype": "dtype",
    "device_map": "devices", "device": "devices",
    "quantization_config": "quantization", "load_in_4bit": "quantization", "load_in_8bit": "quantization",
    "trust_remote_code": "trust_remote_code", "revision": "revision",
    "tp_plan": "tensor_parallel", "tp_size": "tensor_parallel",
    "pretrained_model_name_or_path": "model", "config": "model",
}

# entries of score()'s per-context result dicts that a head's output would replace (engine/requests/score.py)
RESERVED_HEAD_KEYS = ("score", "tokens", "logprobs", "entropy")


def head_key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a head (its output would silently replace an entry of score()'s results), or None."""
    if key not in RESERVED_HEAD_KEYS:
        return None
    return (f"head key {key!r} collides with the {key!r} entry of score()'s results (one dict per context holding "
            f"{', '.join(repr(k) for k in RESERVED_HEAD_KEYS)} and each head's output by key): the head's output would "
            f"replace it; rename the head, e.g. {key + '_head'!r} (reserved: {', '.join(RESERVED_HEAD_KEYS)})")


def semantic_problems(data: dict) -> list[Problem]:
    """Checks across keys that the schema cannot express; pure (no environment)."""
    problems: list[Problem] = []
    timeouts = data.get("timeouts") or {}
    heartbeat, dead_after = timeouts.get("heartbeat", 1.0), timeouts.get("dead_after", 20.0)
    if dead_after <= 2 * heartbeat:
        problems.append(("timeouts.dead_after",
                         f"{dead_after} s must exceed twice timeouts.heartbeat ({heartbeat} s): a "
                         "healthy server would be declared dead between two heartbeats"))
    for name, llm in data["llms"].items():
        at = f"llms.{name}"
        replicas, tp = llm.get("replicas", 1), llm.get("tensor_parallel", 1)
        devices = llm.get("devices", "cpu")
        if isinstance(devices, list):
            if len(devices) != replicas * tp:
                problems.append((f"{at}.devices", f"lists {len(devices)} GPU id(s) but the LLM has replicas x "
                                 f"tensor_parallel = {replicas} x {tp} = {replicas * tp} ranks; give one id per rank"))
        for key in llm.get("heads") or {}:
            if head_key_problem(key):
                problems.append((f"{at}.heads.{key}", head_key_problem(key)))
        plugins = [spec if isinstance(spec, str) else (spec or {}).get("plugin")
                   for spec in llm.get("initializers") or []]
        if tp > 1 and any(p in ("lora", "qlora") for p in plugins):
            problems.append((f"{at}.initializers", "LoRA adapters are not split by DeepSpeed's tensor parallelism (the "
                             "sharded layers no longer match their adapters' shapes); use replicas instead of "
                             "tensor_parallel, or train every weight"))
        schedule = (llm.get("training") or {}).get("lr_schedule") or {}
        if schedule.get("type") in ("linear", "cosine"):
            total, warmup = schedule.get("total_steps"), schedule.get("warmup_steps", 0)
            if total is None or total <= warmup:
                problems.append((f"{at}.training.lr_schedule.total_steps",
                                 f"a {schedule['type']} schedule decays until total_steps, which must exceed "
                                 f"warmup_steps ({warmup}); got {total}: set it to the number of optimizer steps of "
                                 "the run (each update reports its optimizer_steps)"))
        if llm.get("trunk_reuse_mb", 0):
            why = ("a seq2seq model" if llm.get("type", "causal") != "causal" else
                   "tensor-parallel ranks" if tp > 1 else
                   "ZeRO-3 (replicas must gather the same weights)" if llm.get("training", {}).get("zero_stage", 0) == 3
                   else None)
            if why:
                problems.append((f"{at}.trunk_reuse_mb",
                                 f"frozen-trunk reuse is not supported with {why}: set it to 0"))
        if llm.get("kv_cache_mb", 0) and llm.get("type", "causal") != "causal":
            problems.append((f"{at}.kv_cache_mb", "the cache across calls holds a causal model's context keys and "
                             "values; a seq2seq model re-encodes its contexts: set kv_cache_mb: 0"))
        if llm.get("trainable") is False and llm.get("updater"):
            problems.append((f"{at}.trainable", "an LLM with an updater is trained: remove the updater, or set "
                             "trainable: true (or leave it out)"))
        dtype = llm.get("dtype", "float32")
        if dtype == "float16" and devices == "cpu":
            problems.append((f"{at}.dtype",
                             "float16 is not supported on CPU; use float32 (bfloat16 is very slow on CPU)"))
        quant = llm.get("quantization")
        if quant:
            if tp > 1:
                problems.append((f"{at}.quantization",
                                 "quantized models cannot be tensor-parallel; set tensor_parallel: 1"))
            if llm.get("training", {}).get("zero_stage", 0) == 3:
                problems.append((f"{at}.quantization",
                                 "quantized models cannot be trained with ZeRO-3; use zero_stage 0-2"))
            if not llm.get("from_pretrained", True):
                problems.append((f"{at}.quantization",
                                 "quantization needs from_pretrained: true (weights to quantize)"))
        for key in llm.get("model_kwargs") or {}:
            if key in RESERVED_MODEL_KWARGS:
                problems.append((f"{at}.model_kwargs.{key}", f"{key!r} cannot be set in {at}.model_kwargs: llmrl "
                                 f"sets it from {at}.{RESERVED_MODEL_KWARGS[key]}; set that key instead"))
        if llm.get("checkpoint"):
            from llmrl.engine.checkpoint_layout import resolve_checkpoint

            try:
                resolve_checkpoint(llm["checkpoint"])
            except FileNotFoundError:
                problems.append((f"{at}.checkpoint", f"checkpoint {llm['checkpoint']!r} does not exist or is not "
                                 "complete; give a folder written by Caller.save(path)"))
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
            from llmrl.engine.model.store.builtin_models import BUILTIN_MODELS

            builtin = model[len(BUILTIN_MODEL_PREFIX):]
            if builtin not in BUILTIN_MODELS:
                problems.append((f"{at}.model",
                                 f"unknown builtin model {builtin!r}{did_you_mean(builtin, BUILTIN_MODELS)}; "
                                 f"available: {', '.join(sorted(BUILTIN_MODELS))}"))
        else:
            local = Path(os.path.expanduser(model))
            if not local.exists() and looks_like_local_path(model):
                problems.append((f"{at}.model",
                                 f"model path {model!r} does not exist (a hub id looks like 'org/name')"))
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
    return problems + tracking_problems((data.get("tracking") or {}).get("backends") or ())


def tracking_problems(backends) -> list[Problem]:
    """The tracking back ends whose package is not installed on this machine (the client's: rank 0 writes)."""
    problems = []
    for name in backends:
        module, install = TRACKING_PACKAGES.get(name, (None, ""))
        if module and importlib.util.find_spec(module) is None:
            problems.append(("tracking.backends", f"the {name} back end needs the {module} package, which is not "
                             f"installed: {install}, or remove {name} from tracking.backends"))
    return problems


def _tensor_parallel_problems(at: str, llm: dict, tp: int) -> list[Problem]:
    model = llm["model"]
    if model.startswith(BUILTIN_MODEL_PREFIX):
        from llmrl.engine.model.store.builtin_models import builtin_model_config

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


def world_size_problem(config: Config, world_size: int) -> str | None:
    """The message for a launch whose rank count does not match the config, or None."""
    if world_size == config.world_size:
        return None
    parts = " + ".join(f"{llm.replicas} x {llm.tensor_parallel} ({name})" for name, llm in config.llms.items())
    return (f"the launcher started {world_size} rank(s) but the config needs {config.world_size}: 1 client + {parts} "
            f"server ranks. Launch with `deepspeed --num_gpus {config.world_size} ...` (or a hostfile with "
            f"{config.world_size} slots in all), or use `llmrl run`, which counts them for you.")
