"""The built-in value head (entry point ``value``): an MLP on the hidden state of each context's last token.

For a causal model that is the last token of the context tokenised alone; for a seq2seq model, the
decoder's start position (which reads the whole encoded context). One scalar per context, in float32.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import ForwardOutputs, Head, LLMInfo


class ValueHead(Head):
    """A state-value estimate V(context).

    Args (config ``args``):
        hidden: width of the hidden layers (default 256).
        layers: number of hidden layers (default 1; 0 makes a linear head).
    """

    level = "context"
    needs_context_hidden = True
    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"hidden": {"type": "integer", "minimum": 1}, "layers": {"type": "integer", "minimum": 0}},
    }

    def __init__(self, llm: LLMInfo, hidden: int = 256, layers: int = 1):
        super().__init__(llm)
        blocks: list[torch.nn.Module] = []
        width = llm.hidden_size
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
            width = hidden
        out = torch.nn.Linear(width, 1)
        torch.nn.init.normal_(out.weight, std=1e-2)
        torch.nn.init.zeros_(out.bias)
        self.mlp = torch.nn.Sequential(*blocks, out)

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor:
        weight = self.mlp[-1].weight
        return self.mlp(outputs.context_hidden.to(weight.dtype)).squeeze(-1).float()
