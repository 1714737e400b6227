"""The built-in ``ilql`` updater: implicit language Q-learning (Snell et al., 2022), offline, as trlX trains it:
from a dataset of texts and their rewards, with no sampling.

A sample is one prompt with its continuations from the dataset, each with a reward: ``caller.update(prompts,
continuations, rewards=...)``, ``rewards[i]`` one number per continuation (counted on its last token) or, for
continuations given as token ids, one number per token. The rewards are used as given (trlX first standardises
the dataset's returns; do that in the script). The LLM needs the ``ilql`` head (``heads: {ilql: {plugin:
ilql}}``): per token, Q heads over the vocabulary, target Q heads and a value head.

Per token ``t`` of a continuation (state ``s_t``: the prompt and the tokens before ``t``; action ``a_t``), the
loss is ``loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac``
(:func:`~llmrl.plugins.rl_math.ilql.ilql_losses`):

- ``loss_q``: each Q head's ``(Q_i(s_t, a_t) - (r_t + gamma * V(s_t+1)))^2``, V of the terminal state 0;
- ``loss_v``: expectile regression (``tau``) of ``V(s_t)`` on ``min_i targetQ_i(s_t, a_t)``;
- ``loss_cql``: each Q head's cross-entropy at ``a_t`` (a conservative term pushing down unseen actions' Q);
- ``loss_awac``: the language model's negative log-likelihood of ``a_t``, weighted by ``exp(awac_beta * (targetQ -
  V))`` (``awac_beta`` 0, trlX's default: plain likelihood).

Every token of an optimizer step weighs the same, across micro-steps and replicas (trlX averages over the tokens of
its batch). After every ``sync_every`` optimizer steps the target Q heads move towards the Q heads: ``target <-
alpha * Q + (1 - alpha) * target`` (:func:`~llmrl.plugins.rl_math.ilql.polyak_update`, in float32 copies for a
bfloat16 or float16 model, whose heads could not take a step of ``alpha``: 4 bytes per target parameter, kept on the
heads' device, about 450 MB for SmolLM2-135M's default heads; the step count is saved in
checkpoints). Without gradient accumulation an optimizer step is a minibatch.

Generation steered by the advantages: ``generate(..., steer=True)`` samples from ``log_softmax(logits) + beta * (
min_i targetQ_i(s, .) - V(s))`` (then temperature, top-k, top-p; ``steer={"beta": 4}`` overrides ``beta``).

Statistics per replica: ``loss``, ``loss_q``, ``loss_v``, ``loss_cql``, ``loss_awac`` (means per token),
``advantage`` (mean ``targetQ - V`` at the actions taken), ``value`` (mean V), ``reward`` (mean reward per
continuation), ``tokens``, ``samples``. This module is the algorithm; the maths is in
:mod:`llmrl.plugins.rl_math.ilql`, the heads in :mod:`llmrl.plugins.ilql_heads`.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math.ilql import ilql_losses, polyak_update
from llmrl.plugins.rollouts import reward_rows_of, rewards_of
from llmrl.plugins.steering import AdvantageSteering
from llmrl.plugins.update_batch import check_token_count, sample_token_counts
from llmrl.plugins.updater_args import describe, updater_schema


class ILQLUpdater(ShufflingUpdater):
    """Args (config ``args``), trlX's names and defaults:
        head: the key of the ``ilql`` head (default "ilql").
        tau: the expectile of the value loss (default 0.7).
        gamma: the discount over tokens (default 0.99).
        cql_scale / awac_scale: the weights of the CQL and language-model terms (defaults 0.1 and 1).
        awac_beta: the advantage weighting of the language-model term (default 0: none).
        alpha: the Polyak rate of the target Q heads (default 0.001).
        sync_every: optimizer steps between two Polyak updates (default 5).
        beta: the advantage's weight when sampling with ``steer`` (default 1).
        epochs: passes over the batch per update (default 1).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"rewards": "candidate_or_token"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema(
        "epochs", "peft_adapter", "seed", head={"type": "string", "minLength": 1},
        tau={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        gamma={"type": "number", "minimum": 0, "maximum": 1}, cql_scale={"type": "number", "minimum": 0},
        awac_scale={"type": "number", "minimum": 0}, awac_beta={"type": "number"},
        alpha={"type": "number", "exclusiveMinimum": 0, "maximum": 1}, sync_every={"type": "integer", "minimum": 1},
        beta={"type": "number"})
    describe(args_schema,
             head="the key of the ilql head",
             tau="the expectile of the value loss",
             gamma="the discount over tokens",
             cql_scale="the weight of the CQL term",
             awac_scale="the weight of the language-model term",
             awac_beta="the advantage weighting of the language-model term (0: none)",
             alpha="the Polyak rate of the target Q heads",
             sync_every="optimizer steps between two Polyak updates",
             beta="the advantage's weight when sampling with steer")

    def __init__(self, head: str = "ilql", tau: float = 0.7, gamma: float = 0.99, cql_scale: float = 0.1,
                 awac_scale: float = 1.0, awac_beta: float = 0.0, alpha: float = 0.001, sync_every: int = 5,
                 beta: float = 1.0, epochs: int = 1, peft_adapter: str | None = None, seed: int = 0):
        self.head, self.tau, self.gamma, self.cql_scale, self.awac_scale = head, tau, gamma, cql_scale, awac_scale
        self.awac_beta, self.alpha, self.sync_every, self.beta = awac_beta, alpha, sync_every, beta
        self.epochs, self.peft_adapter = epochs, peft_adapter
        self.steps_done = 0
        self.target_masters: dict = {}  # float32 copies of bfloat16 / float16 target Q heads (polyak_update)
        super().__init__(seed)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.steps_done = int(state.get("steps_done", state.get("minibatches_done", 0)))  # the older name

    def held_bytes(self) -> int:
        """The float32 copies of half-precision target heads this updater keeps (for ``server_memory()``)."""
        return sum(t.numel() * t.element_size() for t in self.target_masters.values())

    def _sync(self, module: torch.nn.Module, due: bool) -> bool:
        """The Polyak update of the target Q heads, when one is due; returns False (none is due any more)."""
        if due:
            polyak_update(list(module.target_q_heads), list(module.q_heads), self.alpha, self.target_masters)
        return False

    def _heads_module(self, heads: dict) -> torch.nn.Module:
        module = heads.get(self.head)
        if module is None or not hasattr(module, "target_q_heads"):
            raise ValueError(f"the ilql updater reads the ilql head under key {self.head!r}, which this LLM "
                             f"{'lacks' if module is None else 'has as another kind of head'}: add heads: "
                             f"{{{self.head}: {{plugin: ilql}}}} to the LLM's config (or set args.head)")
        return module

    def steering(self, view, beta: float | None = None) -> AdvantageSteering:
        """``generate(..., steer=True)``: sample from ``log_softmax(logits) + beta * (targetQ - V)``."""
        if view.kind != "causal":  # untested there: refused, as the README says, rather than run unchecked
            raise ValueError("ilql's steered sampling runs causal models; this model is seq2seq")
        return AdvantageSteering(view, self._heads_module(view.heads), self.beta if beta is None else float(beta))

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        if batch.candidates is None or "rewards" not in batch.kwargs:
            raise ValueError("the ilql updater trains on a dataset: caller.update(prompts, continuations, rewards=...),"
                             " rewards[i] one number per continuation of prompt i (or one per token)")
        module = self._heads_module(trainer.heads)
        counts = [len(c) for c in batch.candidates]
        totals = rewards_of(batch.kwargs["rewards"], counts, batch.indices, dense=True)  # checks before any pass
        sums = {k: 0.0 for k in ("loss", "loss_q", "loss_v", "loss_cql", "loss_awac", "advantage", "value")}
        tokens = 0
        tokens_of = sample_token_counts(batch, trainer)
        sync_due = False  # the Polyak update follows the optimizer step it is due after (with accumulation, taken
        for _ in range(self.epochs):  # at the next minibatch's start, or once the pass has ended)
            step_tokens = iter(batch.step_totals(trainer.micro_batch_size, tokens_of, trainer.sum_across_replicas,
                                                 self.generator))
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                sync_due = self._sync(module, sync_due)
                out = trainer.forward(mb.contexts, mb.candidates, heads=[self.head], peft_adapter=self.peft_adapter,
                                      per_token=True)
                lengths = out.candidate_token_counts.cpu()
                mb_counts = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts).tolist()
                rows = reward_rows_of(mb.kwargs["rewards"], mb_counts, lengths, mb.indices)
                rewards = rows[torch.arange(rows.shape[1])[None] < lengths[:, None]].to(out.token_logprobs.device)
                h = out.heads[self.head]
                qs = [h[k] for k in sorted(h) if k.startswith("q")]
                targets = [h[k] for k in sorted(h) if k.startswith("target_q")]
                terms = ilql_losses(qs, targets, h["v"], out.token_ids, out.token_logprobs.float(), rewards,
                                    out.token_candidate, self.gamma, self.tau, self.awac_beta)
                per_token = terms.q + terms.v + self.cql_scale * terms.cql + self.awac_scale * terms.awac
                check_token_count(mb, tokens_of, per_token, "ilql")  # every token of the step weighs the same
                trainer.backward(per_token.sum() * (mb.num_replicas / max(next(step_tokens), 1.0)))
                trainer.step()
                if mb.ends_step:
                    self.steps_done += 1
                    sync_due = self.steps_done % self.sync_every == 0
                tokens += per_token.numel()
                for key, value in (("loss", per_token), ("loss_q", terms.q), ("loss_v", terms.v),
                                   ("loss_cql", terms.cql), ("loss_awac", terms.awac),
                                   ("advantage", terms.advantage), ("value", h["v"])):
                    sums[key] += float(value.detach().sum())
            sync_due = self._sync(module, sync_due)
        stats = {key: value / max(tokens, 1) for key, value in sums.items()}
        stats.update(reward=float(totals.mean()) if len(totals) else 0.0, tokens=tokens // max(self.epochs, 1),
                     samples=len(batch))
        return stats
