"""The built-in value heads: ``value``, an MLP on the hidden state of each context's last token (one V per context),
and ``token_value``, the same MLP on the hidden state that predicts each scored token (one V(s_t) per generated
token, for token-level PPO: ``ppo_tokens``).

For a causal model the context's last token is that of the context tokenised alone; for a seq2seq model, the
decoder's start position (which reads the whole encoded context). Values are float32. The heads do not train
themselves: an updater's value loss does (:func:`llmrl.plugins.rl_math.value_loss`).
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
        "properties": {"hidden": {"type": "integer", "minimum": 1, "description": "width of the hidden layers"},
                       "layers": {"type": "integer", "minimum": 0,
                                  "description": "number of hidden layers (0: a linear head)"}},
    }

    def __init__(self, llm: LLMInfo, hidden: int = 256, layers: int = 1):
        super().__init__(llm)
        self.mlp = mlp(llm.hidden_size, hidden, layers)

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor:
        weight = self.mlp[-1].weight
        return self.mlp(outputs.context_hidden.to(weight.dtype)).squeeze(-1).float()


class TokenValueHead(Head):
    """V(s_t) for every scored token t, s_t being the context and the tokens before t (the hidden state at the
    position that predicts t). Same arguments as :class:`ValueHead`."""

    level = "token"
    needs_context_hidden = False
    needs_token_hidden = True
    args_schema = ValueHead.args_schema

    def __init__(self, llm: LLMInfo, hidden: int = 256, layers: int = 1):
        super().__init__(llm)
        self.mlp = mlp(llm.hidden_size, hidden, layers)

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor:
        weight = self.mlp[-1].weight
        return self.mlp(outputs.token_hidden.to(weight.dtype)).squeeze(-1).float()


def mlp(width: int, hidden: int, layers: int) -> torch.nn.Sequential:
    """``layers`` x (Linear to ``hidden``, Tanh), then a Linear to 1 whose weights start small (std 1e-2, bias 0)."""
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
        width = hidden
    out = torch.nn.Linear(width, 1)
    torch.nn.init.normal_(out.weight, std=1e-2)
    torch.nn.init.zeros_(out.bias)
    return torch.nn.Sequential(*blocks, out)
