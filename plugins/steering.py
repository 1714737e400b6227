"""Sampling from an updater's own policy: ``generate(..., steer=True)``.

Some updaters train a policy that is not the model's plain next-token distribution: ``nlpo`` samples within the
top-p set of a masking policy, ``ilql`` shifts the log-probs by ``beta`` times the advantage its heads estimate.
Such an updater defines ``steering(view, **options)`` and returns a Hugging Face ``LogitsProcessor``; the server
adds it to the request's processors (before temperature, top-k and top-p, which Hugging Face applies last), runs
Hugging Face's ``generate``, then calls the processor's ``close()``. The returned ``logprobs`` stay the raw
model's; ``sampling_logprobs`` are those of the steered distribution the tokens were drawn from.

What a processor may read, :class:`SteeringView`: the model, its heads, its adapters and snapshots. Two taps
(forward hooks) give it what Hugging Face's processors are not given: :class:`HiddenTap`, the last hidden state of
the step (``ilql``), and :class:`InputsTap`, the step's model inputs (``nlpo`` runs its masking policy on them,
with a key/value cache of its own). This module holds the taps and the two processors (the view and the hook's call,
the contract the engine reaches, are :mod:`llmrl.plugins.steering_api`'s, re-exported here); the maths is in
:mod:`llmrl.plugins.rl_math` (:func:`~llmrl.plugins.rl_math.ilql.steered_logits`,
:func:`~llmrl.plugins.rl_math.masking.top_p_mask`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from llmrl.plugins.rl_math.ilql import steered_logits
from llmrl.plugins.rl_math.masking import top_p_mask
from llmrl.plugins.steering_api import SteeringView, steering_processor  # noqa: F401 - their public path too


class HiddenTap:
    """The last position's last-layer hidden state of every step, ``last``: ``[rows, H]`` (the decoder's output:
    what ``hidden_states[-1]`` holds and the output layer reads)."""

    def __init__(self, model):
        self.last: torch.Tensor | None = None
        self._hook = model.get_decoder().register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        self.last = hidden[:, -1]

    def close(self) -> None:
        self._hook.remove()


class InputsTap:
    """The keyword inputs of the model's latest call (``kwargs``), not recorded while ``paused``."""

    def __init__(self, model):
        self.kwargs: dict | None = None
        self.paused = False
        self._hook = model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module, args, kwargs):
        if not self.paused:
            self.kwargs = dict(kwargs, **({"input_ids": args[0]} if args else {}))

    def close(self) -> None:
        self._hook.remove()


class AdvantageSteering(LogitsProcessor):
    """``ilql``: scores become ``log_softmax(scores) + beta * (min_i targetQ_i(s, .) - V(s))``."""

    def __init__(self, view: SteeringView, head: torch.nn.Module, beta: float):
        self.head, self.beta = head, float(beta)
        self.tap = HiddenTap(view.base)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with torch.no_grad():
            targets, values = self.head.steering_terms(self.tap.last)
        return steered_logits(scores, targets, values, self.beta).to(scores.dtype)

    def close(self) -> None:
        self.tap.close()


class MaskSteering(LogitsProcessor):
    """``nlpo``: tokens outside the top-p set of the masking policy (adapter or snapshot ``mask``) get ``-inf``.
    The masking policy reads the same inputs as the policy at every step, with its own key/value cache (started
    afresh at each batch's prefill, when the policy reads every token)."""

    def __init__(self, view: SteeringView, mask: str, top_p: float, always: list[int]):
        self.view, self.mask, self.top_p = view, mask, float(top_p)
        self.always = torch.tensor(sorted(set(always)), dtype=torch.long)
        self.tap = InputsTap(view.base)
        self.cache = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        kwargs = dict(self.tap.kwargs)
        if kwargs["input_ids"].shape[1] == input_ids.shape[1]:  # the policy read every token: a new batch's prefill
            self.cache = None
        kwargs.pop("past_key_values", None)  # never the policy's own cache: the masking policy keeps its own
        kwargs.pop("cache", None)
        kwargs[self.view.cache_argument] = self.cache
        kwargs["use_cache"] = True
        self.tap.paused = True
        try:
            with torch.no_grad(), self.view.adapter(self.mask):
                out = self.view.base(**kwargs)
        finally:
            self.tap.paused = False
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        allowed = top_p_mask(out.logits[:, -1].float(), self.top_p, self.always)
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def close(self) -> None:
        self.tap.close()
        self.cache = None
