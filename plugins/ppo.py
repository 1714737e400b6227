"""The built-in PPO updater (entry point ``ppo``) for policies that choose among scored candidate actions.

The policy over a context's candidates is the softmax of their scores (log p(candidate | context)),
as in GLAM (Carta et al., 2023). Each update call runs ``epochs`` passes over the batch in shuffled
minibatches of ``training.micro_batch_size`` samples per replica; DeepSpeed steps the optimizer every
``gradient_accumulation_steps`` micro-batches and clips gradients by ``training.gradient_clipping``.

Per-sample keyword arguments of ``caller.update(contexts, candidates, ...)``:
    actions: index of the chosen candidate.
    old_logprobs: log-prob of that action under the policy that collected the data: ``log_softmax(scores /
        temperature)`` at the action, with the scores of ``score(...)`` and the updater's ``temperature`` (at 1:
        ``score(..., normalize=True)``).
    advantages: advantage estimates (normalise them in your script if you want).
    returns: value targets.
    old_values: values at collection time (for value clipping; required unless ``value_clip`` is null).

Loss per sample: clipped policy loss + ``value_coef`` x (clipped) value loss - ``entropy_coef`` x entropy
+ ``kl_coef`` x KL(policy || base model), where the base model is the same network with its LoRA
adapters disabled. This module is the algorithm: the loop and the loss of a minibatch (:func:`ppo_terms`, a pure
function); the maths it is made of is in :mod:`llmrl.plugins.rl_math` (advantages for your script's rollouts:
:func:`llmrl.plugins.rl_math.gae`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import approx_kl, categorical_kl, clipped_surrogate, value_loss
from llmrl.plugins.updater_args import describe, updater_schema


@dataclass
class PPOTerms:
    policy_loss: torch.Tensor  # per sample
    value_loss: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    clipped: torch.Tensor  # 1.0 where the ratio was clipped


def ppo_terms(logits: torch.Tensor, mask: torch.Tensor, actions: torch.Tensor, old_logprobs: torch.Tensor,
              advantages: torch.Tensor, values: torch.Tensor | None, returns: torch.Tensor | None,
              old_values: torch.Tensor | None, clip_eps: float, value_clip: float | None) -> PPOTerms:
    """Per-sample PPO terms for a categorical policy over candidates.

    Args:
        logits: ``[n, K]`` candidate scores (unnormalised log-probs), padded.
        mask: ``[n, K]`` True for real candidates.
        actions, old_logprobs, advantages, returns, old_values: ``[n]``.
        values: ``[n]`` current value estimates (None: no value loss).
    """
    logits = logits.masked_fill(~mask, float("-inf"))
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, actions[:, None]).squeeze(1)
    log_ratio = logp - old_logprobs
    policy_loss, clipped = clipped_surrogate(torch.exp(log_ratio), advantages, clip_eps)
    probs = logp_all.exp()
    entropy = -(probs * logp_all.masked_fill(~mask, 0.0)).sum(-1)
    return PPOTerms(policy_loss, value_loss(values, returns, old_values, value_clip, like=policy_loss), entropy,
                    approx_kl(log_ratio), clipped)


def check_actions(actions, candidates: list, indices: list[int]) -> None:
    """Each action must be the index of one of its context's candidates: an integer from 0 to their number - 1. (An
    index past a context's candidates would pick a padded slot of a longer context's row, log-prob -inf: that
    sample's policy term would vanish without a word; 1.7 would be cut to 1.)"""
    for action, cands, where in zip(actions, candidates, indices):
        value = action.item() if hasattr(action, "item") else action
        integral = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
        if not integral or not 0 <= value < len(cands):
            raise ValueError(f"update argument 'actions'[{where}] is {value!r}, but context {where} offers "
                             f"{len(cands)} candidate(s): an action is the index (0 to {len(cands) - 1}) of the "
                             "candidate taken")


class PPOUpdater(ShufflingUpdater):
    """Args (config ``args``):
        epochs: passes over the batch per update (default 4).
        clip_eps: policy ratio clip (default 0.2).
        value_clip: value clip around ``old_values`` (default 0.2; null disables).
        value_coef / entropy_coef / kl_coef: loss weights (defaults 0.5, 0.01, 0.0).
        value_head: the head key giving V(context) (default "value"; null for a policy-only update).
        peft_adapter: the LoRA adapter to train (default: the active one).
        temperature: the policy is softmax(scores / temperature) (default 1; above 1 explores more). Sample
            with the same temperature in your script.
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"actions": "sample", "old_logprobs": "sample", "advantages": "sample", "returns": "sample",
                  "old_values": "sample"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema("epochs", "clip_eps", "value_clip", "value_coef", "entropy_coef", "kl_coef",
                                 "value_head", "peft_adapter", "seed",
                                 temperature={"type": "number", "exclusiveMinimum": 0})
    describe(args_schema,
             value_head="the head key giving V(context) (null: a policy-only update)",
             kl_coef="weight of the KL term to the model without its LoRA adapters (0 disables it)",
             temperature="the policy is softmax(scores / temperature) (above 1 explores more); sample with the same "
                         "temperature in your script")

    def __init__(self, epochs: int = 4, clip_eps: float = 0.2, value_clip: float | None = 0.2,
                 value_coef: float = 0.5, entropy_coef: float = 0.01, kl_coef: float = 0.0,
                 value_head: str | None = "value", peft_adapter: str | None = None, temperature: float = 1.0,
                 seed: int = 0):
        self.epochs, self.clip_eps, self.value_clip = epochs, clip_eps, value_clip
        self.value_coef, self.entropy_coef, self.kl_coef = value_coef, entropy_coef, kl_coef
        self.value_head, self.peft_adapter = value_head, peft_adapter
        self.temperature = temperature
        super().__init__(seed)  # minibatch shuffling, saved in checkpoints

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        if batch.candidates is None:
            raise ValueError("the ppo updater needs candidates (the actions offered in each context)")
        if self.kl_coef > 0 and not trainer.has_adapters:  # the base model would be the policy itself: KL 0
            raise ValueError("the ppo updater's KL term (kl_coef > 0) compares the policy with the model without its "
                             "LoRA adapters, and this LLM has none: add LoRA adapters (the lora initializer), or set "
                             "kl_coef to 0")
        missing = [k for k in ("actions", "old_logprobs", "advantages") if k not in batch.kwargs]
        if self.value_head and "returns" not in batch.kwargs:
            missing.append("returns")
        if missing:
            raise ValueError(f"the ppo updater needs the per-sample keyword argument(s) {missing} in "
                             "caller.update(...)")
        if self.value_head and self.value_clip is not None and "old_values" not in batch.kwargs:
            raise ValueError(f"the ppo updater clips the value loss around old_values (value_clip {self.value_clip}): "
                             "pass old_values=[...] (the value head's outputs at collection time) to caller.update, "
                             "or set the updater's value_clip to null")
        check_actions(batch.kwargs["actions"], batch.candidates, batch.indices)
        positive = next(((i, lp) for i, lp in zip(batch.indices, batch.kwargs["old_logprobs"]) if float(lp) > 1e-6),
                        None)
        if positive is not None:  # a log-probability is at most 0: raw scores of multi-token actions are not one
            raise ValueError(f"old_logprobs[{positive[0]}] is {positive[1]}, above 0: give the log-policy of the "
                             "chosen action, log_softmax over the context's candidates "
                             "(caller.score(..., normalize=True)[i][action])")
        totals: dict[str, float] = {}
        count = 0
        heads = [self.value_head] if self.value_head else []
        for _ in range(self.epochs):
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                out = trainer.forward(mb.contexts, mb.candidates, heads=heads, peft_adapter=self.peft_adapter)
                per_sample, terms, kl = self._loss(mb, out, trainer)
                trainer.backward(mb.mean(per_sample))
                trainer.step()
                n = len(mb)
                if n:
                    for key, value in (("policy_loss", terms.policy_loss), ("value_loss", terms.value_loss),
                                       ("entropy", terms.entropy), ("approx_kl", terms.approx_kl),
                                       ("clip_fraction", terms.clipped), ("kl_to_base", kl)):
                        totals[key] = totals.get(key, 0.0) + float(value.detach().sum())
                    count += n
        stats = {key: value / max(count, 1) for key, value in totals.items()}
        stats["samples"] = len(batch)
        return stats

    def _loss(self, mb: UpdateBatch, out, trainer: Trainer):
        """Per-sample total loss of one minibatch, with its PPO terms and KL to the base model."""
        logits, mask = out.scores_by_context()
        logits = logits / self.temperature
        device = logits.device

        def column(key: str, dtype=torch.float32) -> torch.Tensor:
            return torch.as_tensor(mb.kwargs[key], dtype=dtype, device=device)

        values = out.heads[self.value_head].float() if self.value_head else None
        terms = ppo_terms(logits.float(), mask, column("actions", torch.long), column("old_logprobs"),
                          column("advantages"), values, column("returns") if self.value_head else None,
                          column("old_values") if "old_values" in mb.kwargs else None, self.clip_eps, self.value_clip)
        per_sample = terms.policy_loss + self.value_coef * terms.value_loss - self.entropy_coef * terms.entropy
        kl = torch.zeros_like(per_sample)
        if self.kl_coef > 0:
            with torch.no_grad(), trainer.adapters_disabled():
                base, _ = trainer.forward(mb.contexts, mb.candidates).scores_by_context()
            kl = categorical_kl(logits.float(), base.float() / self.temperature, mask)
            per_sample = per_sample + self.kl_coef * kl
        return per_sample, terms, kl
