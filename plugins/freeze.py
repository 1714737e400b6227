"""The built-in freeze initializer (entry point ``freeze``): choose which parameters train, by name pattern.

``freeze`` patterns (default: everything) stop training; ``unfreeze`` patterns, checked after, train
again. Patterns are shell-style (``fnmatch``) over parameter names such as ``model.layers.1.mlp.up_proj.weight``.
A ``freeze`` or ``unfreeze`` pattern that matches no parameter is an error, naming the pattern (a typo would
silently train, or freeze, the whole model).
"""

from __future__ import annotations

from fnmatch import fnmatch

from llmrl.plugins.contracts import Initializer, LLMInfo


class FreezeInitializer(Initializer):
    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "freeze": {"type": "array", "items": {"type": "string"},
                       "description": "shell-style patterns of parameter names that stop training (null: every "
                                      "parameter)"},
            "unfreeze": {"type": "array", "items": {"type": "string"},
                         "description": "patterns of parameter names that train again, checked after freeze"},
        },
    }

    def __init__(self, freeze: list[str] | None = None, unfreeze: list[str] | None = None):
        self.freeze = list(freeze) if freeze is not None else ["*"]
        self.unfreeze = list(unfreeze or [])

    def initialize(self, model, llm: LLMInfo):
        names = [name for name, _ in model.named_parameters()]
        for field, patterns in (("freeze", self.freeze), ("unfreeze", self.unfreeze)):
            for pattern in patterns:
                if not any(fnmatch(name, pattern) for name in names):
                    raise ValueError(f"{field} pattern {pattern!r} matches no parameter; names look like {names[:3]}")
        for name, param in model.named_parameters():
            if any(fnmatch(name, p) for p in self.freeze):
                param.requires_grad_(False)
            if any(fnmatch(name, p) for p in self.unfreeze):
                param.requires_grad_(True)
        return model
