"""The built-in LoRA initializer (entry point ``lora``): one or several named PEFT LoRA adapters.

The base model is frozen; every adapter trains when it is the active one. Requests pick an adapter
with ``peft_adapter="name"`` (default: the first). An adapter can start from saved weights (``path``,
a folder written by PEFT or by ``Caller.save``). Works on 4-bit models too (QLoRA).
"""

from __future__ import annotations

from llmrl.plugins.contracts import Initializer, LLMInfo

_ADAPTER_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "r": {"type": "integer", "minimum": 1},
        "alpha": {"type": "number", "exclusiveMinimum": 0},
        "dropout": {"type": "number", "minimum": 0, "maximum": 1},
        "target_modules": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "path": {"type": "string"},
    },
}


class LoraInitializer(Initializer):
    """Args (config ``args``):
        adapters: ``{name: {r, alpha, dropout, target_modules, path}}`` (default: one adapter ``default``, r=8).
    """

    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"adapters": {"type": "object", "minProperties": 1, "additionalProperties": _ADAPTER_SCHEMA}},
    }

    def __init__(self, adapters: dict | None = None):
        self.adapters = adapters or {"default": {}}

    def initialize(self, model, llm: LLMInfo):
        from peft import LoraConfig, PeftModel, TaskType, get_peft_model

        task = TaskType.SEQ_2_SEQ_LM if llm.kind == "seq2seq" else TaskType.CAUSAL_LM
        peft_model = None
        for name, spec in self.adapters.items():
            spec = dict(spec)
            path = spec.pop("path", None)
            if path:
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=True)
                else:
                    peft_model.load_adapter(path, adapter_name=name, is_trainable=True)
                continue
            config = LoraConfig(task_type=task, r=spec.get("r", 8), lora_alpha=spec.get("alpha", 2 * spec.get("r", 8)),
                                lora_dropout=spec.get("dropout", 0.0),
                                target_modules=spec.get("target_modules", "all-linear"))
            if peft_model is None:
                peft_model = get_peft_model(model, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
        first = next(iter(self.adapters))
        peft_model.set_adapter(first)
        # Every adapter stays trainable; requests switch the active one without touching these flags.
        for name, param in peft_model.named_parameters():
            if any(f".{adapter}." in name or name.endswith(f".{adapter}") for adapter in self.adapters) and "lora_" in name:
                param.requires_grad_(True)
        return peft_model
