"""Checks of a config that the JSON Schema cannot express: across keys, and against this machine.

:func:`semantic_problems` is pure (it reads the mapping only); :func:`environment_problems` looks at the machine (model
folders, GPUs and their ids, the CPU's float16 kernels, bitsandbytes, tensor-parallel divisibility, ``max_length``
against the model's position limit) and may read a model's config. Keys that would be silently overridden or ignored are
:mod:`llmrl.engine.config.key_conflicts`' (called from :func:`semantic_problems`). All return ``(dotted path, message)``
problems; none raises. :func:`strict_validator` is the JSON Schema validator the config and plugin ``args`` share
(strict integers).
:func:`world_size_problem` words a launch whose rank count does not match the config.

This module loads no model weights, downloads nothing and starts nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from llmrl.engine.config.key_conflicts import deepspeed_problems, inapplicable_problems
from llmrl.engine.config.reference import given_or_default
from llmrl.engine.config.types import Config
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


def llm_setting(llm: dict, *path: str):
    """A setting of an LLM's raw mapping (``"replicas"``, or ``"training", "zero_stage"``), or its schema default where
    the mapping leaves it out."""
    if len(path) == 1:
        return given_or_default(llm, "llm", path[0])
    return given_or_default(llm.get(path[0]), path[0], path[1])


def head_key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a head (its output would silently replace an entry of score()'s results, or the
    heads' ``torch.nn.ModuleDict`` would refuse it), or None."""
    if key not in RESERVED_HEAD_KEYS:
        if not isinstance(key, str) or not key or "." in key:
            return f"head key {key!r} must be a non-empty string without '.' (it names a torch submodule)"
        import torch  # only for a config that has heads

        if hasattr(torch.nn.ModuleDict(), key):
            return (f"head key {key!r} is the name of a torch.nn.Module attribute or method, which the heads' "
                    f"ModuleDict cannot take as a key; rename the head, e.g. {key + '_head'!r}")
        return None
    return (f"head key {key!r} collides with the {key!r} entry of score()'s results (one dict per context holding "
            f"{', '.join(repr(k) for k in RESERVED_HEAD_KEYS)} and each head's output by key): the head's output would "
            f"replace it; rename the head, e.g. {key + '_head'!r} (reserved: {', '.join(RESERVED_HEAD_KEYS)})")


def semantic_problems(data: dict) -> list[Problem]:
    """Checks across keys that the schema cannot express; pure (no environment)."""
    problems: list[Problem] = []
    timeouts = data.get("timeouts") or {}
    heartbeat = given_or_default(timeouts, "timeouts", "heartbeat")
    dead_after = given_or_default(timeouts, "timeouts", "dead_after")
    if dead_after <= 2 * heartbeat:
        problems.append(("timeouts.dead_after",
                         f"{dead_after} s must exceed twice timeouts.heartbeat ({heartbeat} s): a "
                         "healthy server would be declared dead between two heartbeats"))
    for name, llm in data["llms"].items():
        at = f"llms.{name}"
        replicas, tp = llm_setting(llm, "replicas"), llm_setting(llm, "tensor_parallel")
        devices = llm_setting(llm, "devices")
        if isinstance(devices, list):
            if len(devices) != replicas * tp:
                problems.append((f"{at}.devices", f"lists {len(devices)} GPU id(s) but the LLM has replicas x "
                                 f"tensor_parallel = {replicas} x {tp} = {replicas * tp} ranks; give one id per rank"))
        for key in llm.get("heads") or {}:
            if head_key_problem(key):
                problems.append((f"{at}.heads.{key}", head_key_problem(key)))
        problems += deepspeed_problems(at, (llm.get("training") or {}).get("deepspeed") or {})
        problems += inapplicable_problems(at, llm)
        schedule = (llm.get("training") or {}).get("lr_schedule") or {}
        if schedule.get("type") in ("linear", "cosine"):
            total, warmup = schedule.get("total_steps"), given_or_default(schedule, "lr_schedule", "warmup_steps")
            if total is None or total <= warmup:
                problems.append((f"{at}.training.lr_schedule.total_steps",
                                 f"a {schedule['type']} schedule decays until total_steps, which must exceed "
                                 f"warmup_steps ({warmup}); got {total}: set it to the number of optimizer steps of "
                                 "the run (each update reports its optimizer_steps)"))
        if llm_setting(llm, "trunk_reuse_mb"):
            why = ("a seq2seq model" if llm_setting(llm, "type") != "causal" else
                   "tensor-parallel ranks" if tp > 1 else
                   "ZeRO-3 (replicas must gather the same weights)" if llm_setting(llm, "training", "zero_stage") == 3
                   else None)
            if why:
                problems.append((f"{at}.trunk_reuse_mb",
                                 f"frozen-trunk reuse is not supported with {why}: set it to 0"))
        if llm_setting(llm, "kv_cache_mb") and llm_setting(llm, "type") != "causal":
            problems.append((f"{at}.kv_cache_mb", "the cache across calls holds a causal model's context keys and "
                             "values; a seq2seq model re-encodes its contexts: set kv_cache_mb: 0"))
        if llm.get("trainable") is False and llm.get("updater"):
            problems.append((f"{at}.trainable", "an LLM with an updater is trained: remove the updater, or set "
                             "trainable: true (or leave it out)"))
        quant = llm.get("quantization")
        if quant:
            if tp > 1:
                problems.append((f"{at}.quantization",
                                 "quantized models cannot be tensor-parallel; set tensor_parallel: 1"))
            if llm_setting(llm, "training", "zero_stage") == 3:
                problems.append((f"{at}.quantization",
                                 "quantized models cannot be trained with ZeRO-3; use zero_stage 0-2"))
            if not llm_setting(llm, "from_pretrained"):
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


@functools.cache
def strict_validator():
    """JSON Schema's Draft 2020-12 validator class with strict integers, for the config and for plugin ``args``
    (call it with a schema): JSON Schema counts ``2.0`` as an integer, but a config means ``2`` or it is a mistake
    that breaks later with a message naming no key (``replicas: 2.0``, an updater's ``range(epochs)``)."""
    import jsonschema

    strict = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=strict)


def cpu_float16() -> bool:
    """Whether DeepSpeed computes in float16 on this machine's CPU (its CPU accelerator's own test: oneDNN's float16
    kernels)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())


def looks_like_local_path(model: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that names a folder is a local path."""
    return model.startswith(("/", ".", "~")) or model.rstrip("/").count("/") > 1


def environment_problems(data: dict, check_devices: bool = True, single_node: bool | None = None) -> list[Problem]:
    """Checks that look at this machine: model folders, GPUs (unless ``check_devices`` is false: their presence, the
    listed ids, and ``devices: auto``'s ranks where the node's ranks are known, see :func:`auto_device_problems`),
    float16 on a CPU without float16 kernels,
    ``max_length`` against the model's position limit (where its config is on this machine), bitsandbytes,
    tensor-parallel divisibility."""
    problems: list[Problem] = []
    cuda_available: bool | None = None
    gpu_count = 0
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
        if llm_setting(llm, "dtype") == "float16" and llm_setting(llm, "devices") == "cpu" and not cpu_float16():
            problems.append((f"{at}.dtype", "float16 on CPU needs oneDNN's float16 kernels (AVX-512 FP16 or AMX), "
                             "which this CPU lacks, so DeepSpeed refuses it; use float32 (bfloat16 is very slow "
                             "on CPUs without AVX-512 BF16 or AMX)"))
        if check_devices and llm_setting(llm, "devices") != "cpu":
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
                gpu_count = torch.cuda.device_count() if cuda_available else 0
            if not cuda_available:
                problems.append((f"{at}.devices", f"{llm['devices']!r} asks for GPUs but CUDA is not available on this "
                                 "machine; use devices: cpu"))
            elif isinstance(llm["devices"], list) and max(llm["devices"]) >= gpu_count:
                missing = sorted({i for i in llm["devices"] if i >= gpu_count})
                problems.append((f"{at}.devices", f"GPU id(s) {', '.join(map(str, missing))} do not exist on this "
                                 f"machine, which has {gpu_count} GPU(s) (ids 0..{gpu_count - 1}, as "
                                 "CUDA_VISIBLE_DEVICES leaves them); list ids below that, or use devices: auto"))
        limit = position_limit_problem(at, llm)
        if limit:
            problems.append(limit)
        if llm.get("quantization") and importlib.util.find_spec("bitsandbytes") is None:
            problems.append((f"{at}.quantization", "needs the bitsandbytes package: pip install bitsandbytes"))
        tp = llm_setting(llm, "tensor_parallel")
        if tp > 1:
            problems += _tensor_parallel_problems(at, llm, tp)
    if check_devices and cuda_available:
        problems += auto_device_problems(data, gpu_count, single_node)
    return problems + tracking_problems((data.get("tracking") or {}).get("backends") or ())


def auto_device_problems(data: dict, gpu_count: int, single_node: bool | None = None,
                         environ=os.environ) -> list[Problem]:
    """The ``devices: auto`` LLMs whose ranks on this node would take a GPU id this machine lacks.

    ``auto`` gives server local rank L GPU L-1 on node 0 (local rank 0 is the client) and GPU L on the other nodes
    (:func:`llmrl.engine.config.topology.device_for`). Which ranks run on this node is known inside a launched rank
    (the launcher's RANK, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK), or, with ``single_node``, when every rank runs here.
    Otherwise (``llmrl validate``, or ``llmrl run`` before it launches: the run may span nodes of a hostfile) nothing
    is reported; each rank checks again when it starts."""
    if single_node is False:
        return []
    if single_node:
        first, size, node_rank = 0, 1 + sum(llm_setting(llm, "replicas") * llm_setting(llm, "tensor_parallel")
                                            for llm in data["llms"].values()), 0
    else:
        try:
            rank, local_rank = int(environ["RANK"]), int(environ["LOCAL_RANK"])
            first, size = rank - local_rank, int(environ["LOCAL_SIZE"])
            node_rank = int(environ.get("CROSS_RANK", "0") or 0)
        except (KeyError, ValueError):
            return []  # not a launched rank: this node's ranks are unknown
    owners = [name for name, llm in data["llms"].items()
              for _ in range(llm_setting(llm, "replicas") * llm_setting(llm, "tensor_parallel"))]
    # server rank g: owners[g - 1]
    highest: dict[str, int] = {}
    for local in range(size):
        rank = first + local
        if not 1 <= rank <= len(owners) or llm_setting(data["llms"][owners[rank - 1]], "devices") != "auto":
            continue
        highest[owners[rank - 1]] = local - 1 if node_rank == 0 else local
    return [(f"llms.{name}.devices",
             f"auto gives each server rank of a node the next GPU in local-rank order (the ranks of the LLMs listed "
             f"before it take their places too, on CPU or not): on this node {name}'s ranks need GPU ids up to {top}, "
             f"but this machine has {gpu_count} GPU(s); use fewer replicas or tensor_parallel ranks, list GPU ids "
             "(devices: [0, 1, ...], ids may repeat across LLMs), or spread the run over nodes with a hostfile")
            for name, top in highest.items() if top >= gpu_count]


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")  # max_input_length reads them too


def position_limit_problem(at: str, llm: dict) -> Problem | None:
    """``max_length`` above the model's position limit (read from its config.json where it is on this machine: a
    local folder, a prepared builtin model or the Hugging Face cache; ``model_kwargs`` may raise it), or None."""
    max_length = llm.get("max_length")
    if max_length is None:
        return None
    config = _model_config_json(llm)
    if not isinstance(config, dict):
        return None
    from llmrl.engine.model.families import family_of

    if family_of(config).relative_positions:  # no table to index past: their n_positions is no input limit
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kwargs = llm.get("model_kwargs") or {}
    for key in POSITION_KEYS:
        limit = kwargs.get(key, text.get(key))
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if max_length <= limit:
                return None
            return (f"{at}.max_length",
                    f"{max_length} exceeds the model's position limit ({key}: {limit} in its config): a longer input "
                    f"would index past its position embeddings and fail; set max_length to at most {limit}, or null "
                    "(the model's limit)")
    return None


def _model_config_json(llm: dict) -> dict | None:
    """The model's config.json as a mapping, where it is on this machine without loading or downloading anything."""
    import json

    model = llm["model"]
    if model.startswith(BUILTIN_MODEL_PREFIX):
        from llmrl.engine.model.store.folders import models_dir

        path = models_dir() / model[len(BUILTIN_MODEL_PREFIX):] / "config.json"
    elif Path(os.path.expanduser(model)).is_dir():
        path = Path(os.path.expanduser(model)) / "config.json"
    elif looks_like_local_path(model):
        return None
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json", revision=llm.get("revision"))
        except Exception:  # noqa: BLE001 - a hub id that is not cached: checked when the model loads
            return None
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tracking_problems(backends) -> list[Problem]:
    """The tracking back ends whose package is not installed on this machine (the client's: rank 0 writes); the
    packages and installs come from :mod:`llmrl.engine.client.tracking.registry`."""
    if not backends:
        return []
    from llmrl.engine.client.tracking.registry import requirement

    problems = []
    for name in backends:
        module, install = requirement(name) or (None, "")
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
                                                   trust_remote_code=llm_setting(llm, "trust_remote_code"))
        except Exception as err:  # noqa: BLE001 - reported as a config problem
            return [(f"{at}.model", f"cannot read the model config: {err}")]
    else:
        return []  # a hub id: checked when the model loads
    if hf_config is None:
        return []
    problems = []
    from llmrl.engine.model.families import family_of

    model_type = getattr(hf_config, "model_type", "?")
    if not family_of(model_type).autotp:
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
