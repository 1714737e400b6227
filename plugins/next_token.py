"""The built-in ``next_token`` head: the model's distribution over the token after each context, with no candidate
(Lamorel users wrote ``score(contexts, [[""]], add_eos=True)`` with a logits-reading module function for it).

It reads ``outputs.context_logits`` (``Head.needs_context_logits``: the engine applies the model's output layer to
the last hidden state at each context's last token, so the logits are ``model(ids).logits[:, -1]``'s) and returns,
per context, the log-probabilities (or raw logits) of the whole vocabulary, or of its ``top_k`` most likely tokens
with their ids. It has no weights and trains nothing; with an updater its log-probs carry gradients like any head's.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import ForwardOutputs, Head, LLMInfo


class NextTokenHead(Head):
    """Per context, the next token's log-probabilities (``values: logprobs``) or logits (``values: logits``).

    Args (config ``args``):
        top_k: keep the ``top_k`` largest values per context, with their token ids (default null: the whole
            vocabulary, ``[vocab]`` per context).
        values: ``"logprobs"`` (default; log-softmax over the whole vocabulary, before any top-k) or ``"logits"``.

    Output per context: without ``top_k``, a ``[vocab]`` float32 tensor; with it, ``{"ids": [k] long,
    "values": [k] float32}``, largest first.

    Example::

        heads: {next: {plugin: next_token, args: {top_k: 5}}}
        out = caller.custom_module_fns(["next"], ["The capital of France is"])
        out[0]["next"]["ids"], out[0]["next"]["values"]  # the 5 likeliest next tokens and their log-probs
    """

    level = "context"
    needs_context_hidden = False
    needs_context_logits = True
    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"top_k": {"type": ["integer", "null"], "minimum": 1,
                                 "description": "keep the top_k largest values per context, with their token ids "
                                                "(null: the whole vocabulary)"},
                       "values": {"enum": ["logprobs", "logits"],
                                  "description": "log-softmax over the whole vocabulary (before any top-k), or raw "
                                                 "logits"}},
    }

    def __init__(self, llm: LLMInfo, top_k: int | None = None, values: str = "logprobs"):
        super().__init__(llm)
        self.top_k, self.values = top_k, values

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor | dict[str, torch.Tensor]:
        scores = outputs.context_logits
        if self.values == "logprobs":
            scores = torch.log_softmax(scores, dim=-1)
        if self.top_k is None:
            return scores
        values, ids = scores.topk(min(self.top_k, scores.shape[-1]), dim=-1)
        return {"ids": ids, "values": values}
