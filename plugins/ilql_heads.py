"""The built-in ``ilql`` head: the token-level Q and V heads of implicit language Q-learning, as trlX builds them.

For every scored token ``t`` it reads the hidden state of the state ``s_t`` (the position predicting ``t``) and
gives ``Q_i(s_t, .)`` over the whole vocabulary for each Q head, the same from each target Q head (copies that the
``ilql`` updater moves towards the Q heads by Polyak averaging; never trained by the optimizer) and ``V(s_t)``.
Each head is trlX's: ``Linear(H, hidden)``, ReLU, ``Linear(hidden, out)`` (``hidden`` 0: one linear layer), except
that the output layers start at zero: every Q and V starts at 0, so that sampling steered by ``Q - V`` starts as
the model's own distribution. (With PyTorch's default initialisation, trlX's, a hidden state of norm ~40, as
SmolLM2's, gives every token a random Q of about one nat, which steering then follows wherever the data never
taught otherwise.)

It computes outputs only; the losses are in :mod:`llmrl.plugins.rl_math.ilql`, the training in
:mod:`llmrl.plugins.ilql`, the steered sampling in :mod:`llmrl.plugins.steering`.
"""

from __future__ import annotations

import copy

import torch

from llmrl.plugins.contracts import ForwardOutputs, Head, LLMInfo


def _head(width: int, hidden: int, out: int) -> torch.nn.Module:
    """trlX's head, its output layer starting at zero (see :class:`ILQLHeads`)."""
    last = torch.nn.Linear(width if hidden == 0 else hidden, out)
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    if hidden == 0:
        return last
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), last)


class ILQLHeads(Head):
    """Args (config ``args``):
        two_qs: two Q heads (and two targets), the minimum of the targets used, as in trlX (default true).
        hidden: the heads' hidden width (default null: twice the model's hidden size, trlX's; 0: linear heads).

    Output per scored token: ``{"q0": [vocab], "q1": [vocab], "target_q0": [vocab], "target_q1": [vocab],
    "v": []}`` (float32; ``q1`` / ``target_q1`` with ``two_qs``).
    """

    level = "token"
    needs_context_hidden = False
    needs_token_hidden = True
    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "two_qs": {"type": "boolean", "description": "two Q heads (and two targets), the minimum of the targets "
                                                         "used, as in trlX"},
            "hidden": {"type": ["integer", "null"], "minimum": 0,
                       "description": "the heads' hidden width (null: twice the model's hidden size; 0: linear "
                                      "heads)"}},
    }

    def __init__(self, llm: LLMInfo, two_qs: bool = True, hidden: int | None = None):
        super().__init__(llm)
        hidden = 2 * llm.hidden_size if hidden is None else hidden
        count = 2 if two_qs else 1
        self.q_heads = torch.nn.ModuleList(_head(llm.hidden_size, hidden, llm.vocab_size) for _ in range(count))
        self.target_q_heads = copy.deepcopy(self.q_heads).requires_grad_(False)
        self.v_head = _head(llm.hidden_size, hidden, 1)

    def steering_terms(self, hidden: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What steered sampling reads, for hidden states ``[n, H]``: the target Q heads' ``[n, vocab]`` and V
        ``[n]`` (not the Q heads: one vocabulary-wide matmul per head less at every sampling step)."""
        hidden = hidden.to(next(self.v_head.parameters()).dtype)
        return [q(hidden).float() for q in self.target_q_heads], self.v_head(hidden).squeeze(-1).float()

    def forward(self, outputs: ForwardOutputs) -> dict[str, torch.Tensor]:
        targets, v = self.steering_terms(outputs.token_hidden)
        hidden = outputs.token_hidden.to(next(self.v_head.parameters()).dtype)
        qs = [q(hidden).float() for q in self.q_heads]
        out = {f"q{i}": q for i, q in enumerate(qs)}
        out.update({f"target_q{i}": q for i, q in enumerate(targets)})
        out["v"] = v
        return out
