"""The built-in ``nlpo`` updater: Natural Language Policy Optimization (Ramamurthy et al., 2023, RL4LMs): token-level
PPO (:mod:`llmrl.plugins.ppo_tokens`, whose arguments, per-sample arguments and statistics it shares) whose
policy chooses each token within the top-p set of a masking policy.

The masking policy is a frozen copy of the policy (a snapshot, ``mask_snapshot``), taken when first needed and
taken again after every ``mask_sync_every`` updates (RL4LMs' ``target_update_iterations``). At a state, the policy's
distribution is ``softmax(logits)`` renormalised over the masking policy's top-p set (``top_p``, RL4LMs'
``top_mask``; the tokenizer's special tokens always in, as RL4LMs keeps them):

- sampling: ``generate(..., steer=True)`` samples under the mask (``steer={"top_p": 0.8}`` overrides ``top_p``);
- the update: the old log-probs (computed here; the client gives none), the ratio and the entropy are the masked
  distribution's. The KL penalty (and the ``kl`` statistic) compares the policy's unmasked log-probs with the
  reference's, as RL4LMs does: a masked log-prob is the unmasked one minus ``log`` of the set's mass, which would
  penalise every token by that much (a length penalty) and inflate the KL the adaptive coefficient follows. A token
  outside the current mask (sampled without ``steer``, or before a sync) is added to its state's set, so that its
  log-prob stays finite; ``mask_misses`` counts such tokens.

Extra statistics: ``mask_size`` (mean tokens in a state's set), ``mask_misses`` (share of tokens outside it),
``mask_syncs`` (snapshots taken so far). This module is the algorithm's difference from ``ppo_tokens``; the masks are
computed in :mod:`llmrl.plugins.rl_math.masking`, sampling under them in :mod:`llmrl.plugins.steering`.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import Trainer, UpdateBatch
from llmrl.plugins.ppo_tokens import PPOTokensUpdater
from llmrl.plugins.rl_math.masking import masked_logprobs, top_p_mask
from llmrl.plugins.steering import MaskSteering
from llmrl.plugins.updater_args import describe, updater_schema


class NLPOUpdater(PPOTokensUpdater):
    """Args (config ``args``): those of ``ppo_tokens``, and
        top_p: the masking policy's top-p set (default 0.9).
        mask_sync_every: updates between two snapshots of the masking policy (default 20).
        mask_snapshot: the snapshot's name (default "nlpo_mask").
    """

    per_sample_args = {"rewards": "candidate_or_token", "ref_logprobs": "token", "behaviour_logprobs": "token"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema(
        **{k: v for k, v in PPOTokensUpdater.args_schema["properties"].items()},
        top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        mask_sync_every={"type": "integer", "minimum": 1}, mask_snapshot={"type": "string", "minLength": 1})
    describe(args_schema,
             top_p="the masking policy's top-p set",
             mask_sync_every="updates between two snapshots of the masking policy",
             mask_snapshot="the masking policy snapshot's name")

    def __init__(self, top_p: float = 0.9, mask_sync_every: int = 20, mask_snapshot: str = "nlpo_mask", **args):
        super().__init__(**args)
        self.top_p, self.mask_sync_every, self.mask_snapshot = top_p, mask_sync_every, mask_snapshot
        self.updates_done, self.mask_syncs = 0, 0
        self.mask_stats = [0.0, 0.0, 0.0]  # tokens, allowed-set sizes, misses (of the current update)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "updates_done": self.updates_done, "mask_syncs": self.mask_syncs}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates_done, self.mask_syncs = int(state.get("updates_done", 0)), int(state.get("mask_syncs", 0))

    def steering(self, view, top_p: float | None = None) -> MaskSteering:
        """``generate(..., steer=True)``: sample within the masking policy's top-p set."""
        if view.kind != "causal":
            raise ValueError("nlpo's masked sampling runs causal models (its masking policy reads the policy's "
                             "decoder inputs); this model is seq2seq")
        if not view.has_snapshot(self.mask_snapshot):
            view.snapshot(self.mask_snapshot, self.peft_adapter)
            self.mask_syncs += 1
        return MaskSteering(view, self.mask_snapshot, self.top_p if top_p is None else float(top_p),
                            list(view.tokenizer.all_special_ids))

    def prepare(self, batch: UpdateBatch, trainer: Trainer) -> None:
        if not trainer.has_snapshot(self.mask_snapshot):
            trainer.snapshot(self.mask_snapshot, self.peft_adapter)
            self.mask_syncs += 1
        self.mask_stats = [0.0, 0.0, 0.0]

    def first_policy_pass(self):
        def run(trainer, mb, heads):
            out, logp, mask, _ = self.policy_pass(trainer, mb, heads, count=False)
            return out, logp, mask, out.tokens_by_candidate()[0]  # the KL penalty's: the unmasked log-probs
        return run

    def policy_pass(self, trainer: Trainer, mb: UpdateBatch, heads: list, count: bool = True) -> tuple:
        out = trainer.forward(mb.contexts, mb.candidates, heads=heads, peft_adapter=self.peft_adapter, per_token=True,
                              logits=True)
        with torch.no_grad():
            masking = trainer.forward(mb.contexts, mb.candidates, peft_adapter=self.mask_snapshot, logits=True)
            special = torch.tensor(sorted(set(trainer.llm.tokenizer.all_special_ids)), dtype=torch.long)
            allowed = top_p_mask(masking.token_logits, self.top_p, special)
            rows = torch.arange(len(out.token_ids), device=allowed.device)
            ids = out.token_ids.to(allowed.device)
            missed = ~allowed[rows, ids]
            allowed[rows, ids] = True
        logp, entropy = masked_logprobs(out.token_logits, allowed.to(out.token_logits.device), out.token_ids)
        if count:
            self.mask_stats[0] += len(ids)
            self.mask_stats[1] += float(allowed.sum())
            self.mask_stats[2] += float(missed.sum())
        padded, mask = out.tokens_by_candidate(logp)
        return out, padded, mask, out.tokens_by_candidate(entropy)[0]

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        if "old_logprobs" in batch.kwargs:  # generate's log-probs are the unmasked model's: silently wrong ratios
            raise ValueError("the nlpo updater computes the masked policy's old log-probs itself: leave old_logprobs "
                             "out of caller.update(...) (generate's logprobs are the unmasked model's)")
        stats = super().update(batch, trainer)
        self.updates_done += 1
        if self.updates_done % self.mask_sync_every == 0:
            trainer.snapshot(self.mask_snapshot, self.peft_adapter)
            self.mask_syncs += 1
        tokens = max(self.mask_stats[0], 1.0)
        stats.update(mask_size=self.mask_stats[1] / tokens, mask_misses=self.mask_stats[2] / tokens,
                     mask_syncs=self.mask_syncs)
        return stats
