"""The built-in LoRA initializer (entry point ``lora``): one or several named PEFT LoRA adapters.

The base model is frozen; every adapter trains when it is the active one. Requests pick an adapter
with ``peft_adapter="name"`` (default: the first). An adapter can start from saved weights (``path``,
a folder written by PEFT or by ``Caller.save``; its saved shape is used, so shape keys beside ``path`` are refused).
``layers`` (indices from 0, checked against the model's layer count) and ``last_layers`` exclude each other; on an
encoder-decoder model an index picks that block of both the encoder and the decoder.
Works on 4-bit models too (QLoRA). This initializer only adds adapters and sets what trains; keeping one adapter's
step from moving another is the optimizer's (:mod:`llmrl.engine.model.training.optimizer`).
"""

from __future__ import annotations

from llmrl.plugins.contracts import Initializer, LLMInfo

_ADAPTER_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "r": {"type": "integer", "minimum": 1},
        "alpha": {"type": "number", "exclusiveMinimum": 0},
        "dropout": {"type": "number", "minimum": 0, "maximum": 0},  # 0 only: see _spec_problem
        "target_modules": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "layers": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        "last_layers": {"type": "integer", "minimum": 1},
        "path": {"type": "string", "minLength": 1},
    },
}


class LoraInitializer(Initializer):
    """Args (config ``args``):
        adapters: ``{name: {r, alpha, dropout, target_modules, layers, last_layers, path}}`` (default: one
            adapter ``default``, r=8, on every linear layer). ``last_layers: k`` adapts only the top k
            transformer layers: backward passes then stop there, which makes updates much cheaper; ``layers`` names
            them (indices from 0) instead. An adapter with ``path`` takes its shape from the saved one.
            ``dropout`` must be 0: llmrl runs its models in evaluation mode, where LoRA dropout never acts.
    """

    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"adapters": {
            "type": "object", "minProperties": 1, "additionalProperties": _ADAPTER_SCHEMA,
            "description": "{name: {r, alpha, dropout, target_modules, layers, last_layers, path}} (null: one adapter "
                           "'default', r=8, on every linear layer); last_layers: k adapts only the top k layers, "
                           "layers names them; path loads a saved adapter; dropout must be 0"}},
    }

    def __init__(self, adapters: dict | None = None):
        self.adapters = adapters or {"default": {}}
        for name, spec in self.adapters.items():
            problem = _spec_problem(name, spec)
            if problem:
                raise ValueError(problem)

    def initialize(self, model, llm: LLMInfo):
        from peft import LoraConfig, PeftModel, TaskType, get_peft_model

        task = TaskType.SEQ_2_SEQ_LM if llm.kind == "seq2seq" else TaskType.CAUSAL_LM
        peft_model = None
        # read before the first adapter wraps the model's linears (their names would then be LoRA's own)
        linear_names = _layer_linear_names(model) if any(
            isinstance(spec, dict) and (spec.get("layers") is not None or spec.get("last_layers"))
            for spec in self.adapters.values()) else None
        for name, spec in self.adapters.items():
            spec = dict(spec)
            path = spec.pop("path", None)
            if path:
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=True)
                else:
                    peft_model.load_adapter(path, adapter_name=name, is_trainable=True)
                continue
            layers = spec.get("layers")
            if spec.get("last_layers"):
                count = _last_layers_count(model, name)
                layers = list(range(max(0, count - spec["last_layers"]), count))
            elif layers is not None and (count := _layer_count(model)) is not None and max(layers) >= count:
                raise ValueError(f"adapters.{name}.layers: {sorted(i for i in layers if i >= count)} out of range; "
                                 f"this model has {count} layers: use indices from 0 to {count - 1}")
            targets = spec.get("target_modules") or ("all-linear" if layers is None else linear_names)
            config = LoraConfig(task_type=task, r=spec.get("r", 8), lora_alpha=spec.get("alpha", 2 * spec.get("r", 8)),
                                lora_dropout=spec.get("dropout", 0.0), target_modules=targets,
                                layers_to_transform=layers)
            if peft_model is None:
                peft_model = get_peft_model(model, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
        first = next(iter(self.adapters))
        peft_model.set_adapter(first)
        # Every adapter stays trainable; requests switch the active one without touching these flags.
        for name, param in peft_model.named_parameters():
            mine = any(f".{adapter}." in name or name.endswith(f".{adapter}") for adapter in self.adapters)
            if mine and "lora_" in name:
                param.requires_grad_(True)
        return peft_model


_SHAPE_KEYS = ("r", "alpha", "dropout", "target_modules", "layers", "last_layers")


def _spec_problem(name: str, spec) -> str | None:
    """Why adapter ``name``'s spec contradicts itself (keys that would be silently ignored), or None."""
    if not isinstance(spec, dict):
        return f"adapters.{name}: expected a mapping of {list(_SHAPE_KEYS) + ['path']}, got {type(spec).__name__}"
    if spec.get("dropout"):
        return (f"adapters.{name}.dropout: llmrl runs its models in evaluation mode (every pass, and so every "
                "log-prob and importance ratio, exact and repeatable), where LoRA dropout never acts: it would be "
                "recorded in the exported adapter's config without having been applied; set 0")
    if "layers" in spec and "last_layers" in spec:
        return (f"adapters.{name}: give layers or last_layers, not both (layers lists the adapted layers, "
                "last_layers: k the top k)")
    shape = [key for key in _SHAPE_KEYS if key in spec]
    if spec.get("path") and shape:
        return (f"adapters.{name}: {', '.join(shape)} given with path, which loads the saved adapter with its own "
                f"shape; drop {', '.join(shape)}, or drop path to start a new adapter")
    return None


def _layer_count(model) -> int | None:
    """The number of transformer layers layer indices refer to (for an encoder-decoder, the larger stack), or
    None if the config does not say."""
    config = model.config.get_text_config()
    counts = [getattr(config, key, None) for key in ("num_hidden_layers", "num_decoder_layers")]
    counts = [c for c in counts if isinstance(c, int)]
    return max(counts) if counts else None


def _last_layers_count(model, name: str) -> int:
    """The depth ``last_layers`` counts down from. An encoder-decoder's layer indices pick blocks of both stacks
    alike, so its top k are the top k of each only when the two stacks are equally deep."""
    config = model.config.get_text_config()
    depths = {getattr(config, key) for key in ("num_hidden_layers", "num_decoder_layers", "decoder_layers")
              if isinstance(getattr(config, key, None), int)}
    if len(depths) > 1:
        raise ValueError(f"adapters.{name}.last_layers: this encoder-decoder's stacks have {sorted(depths)} layers, "
                         "and layer indices pick the blocks of both stacks alike: give layers (indices from 0) "
                         "instead")
    return depths.pop()


def _layer_linear_names(model) -> list[str]:
    """Names of the linear modules inside the transformer layers (what "all-linear" means, made explicit,
    since PEFT needs explicit names to restrict adapters to some layers)."""
    import torch

    names = set()
    for name, module in model.named_modules():
        is_linear = isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")
        if is_linear and any(stack in f".{name}." for stack in (".layers.", ".h.", ".block.")):  # T5's: block
            names.add(name.rsplit(".", 1)[-1])
    if not names:
        raise ValueError("found no linear module inside the model's layers; give target_modules explicitly")
    return sorted(names)
