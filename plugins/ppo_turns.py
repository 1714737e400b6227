"""The built-in multi-turn updaters ``ppo_turns`` and ``grpo_turns``: PPO over whole episodes of an agent that acted
over many turns, with the credit given per turn and the loss taken only on the model's own tokens.

A sample is one start (a context: the episode's first prompt, as token ids) with the episodes played from it (its
candidates: each episode's ids after the start, the model's turns and the environment's replies in between, as a
:class:`~llmrl.engine.client.trajectory.Trajectory` holds them; :func:`llmrl.episode_batch` builds the call from
episodes). Per-sample keyword arguments of ``caller.update(starts, episodes, ...)``:

    model_mask: per start, one sequence per episode with one value per token: 1 where the model sampled the token,
        0 where the environment (or the chat template) wrote it. The turns are the maximal runs of 1s.
    turn_rewards: per start, one list per episode with one reward per turn (the reward the environment gave after
        that turn's action); it arrives at the turn's last token.
    old_logprobs: (optional) per start, per episode, each token's log-prob under the policy that sampled it (the
        trajectory's ``sampling_logprobs``; values on environment tokens are not read); without it, a gradient-free
        pass computes it.
    ref_logprobs: (optional) the same under the reference policy, for the KL term (default: the model with its
        LoRA adapters disabled).
    bootstrap: (optional, ``ppo_turns`` only) per start, one 0 or 1 per episode: 1 for an episode cut short
        (truncated), whose ids then go on after its last turn to the state it was cut in (the observation and the
        next generation prompt) and end with one placeholder token; the critic's value read there is the value after
        its last turn, instead of 0. ``llmrl.episode_batch(groups, bootstrap=True)`` builds these.

Advantages, one per turn, spread over the turn's tokens:

- ``ppo_turns``: a token-level value head gives ``V_k``, the value of the state before turn ``k`` (read at the
  turn's first token, whose prediction sees the whole history before it); GAE across turns, a turn being one step
  (``gamma`` and ``lam`` are per turn; the value after the last turn is 0, or, for an episode marked ``bootstrap``,
  the value read at its placeholder token): :func:`~llmrl.plugins.rl_math.turn_gae`.
  Returns ``R_k = A_k + V_k`` train the value head at the turns' boundaries; advantages are whitened over every turn
  of the batch, all replicas together (``whiten``).
- ``grpo_turns``: no critic; a sample's episodes are a group from the same start (at least 2), and every turn of an
  episode gets the episode's advantage, its discounted return against the group's
  (:func:`~llmrl.plugins.rl_math.group_episode_advantages`; ``gamma`` < 1 favours shorter episodes).

Per model token: PPO's clipped policy loss with ``ratio = exp(logprob - old_logprob)``, plus ``kl_coef`` x the
KL estimator to the reference (:func:`~llmrl.plugins.rl_math.kl_k3`, or the ``kl_estimator`` chosen), minus
``entropy_coef`` x the entropy (which may decay linearly over updates). With ``off_policy`` and the sampler's
``behaviour_logprobs`` (the trajectory's ``sampling_logprobs``), the policy term is weighed by truncated or masked
importance weights over the model's tokens (:mod:`llmrl.plugins.rl_math.off_policy`).
Normalisation: an episode's model tokens are averaged (environment tokens weigh nothing), plus, for ``ppo_turns``,
``value_coef`` x the mean over its turns of the (clipped) value loss; then a start's episodes are averaged, then
starts (:meth:`UpdateBatch.mean`).

An update of ``grpo_turns`` whose groups all returned alike (every advantage 0) and whose loss has no KL or entropy
term takes no step: Adam would still move the weights along its momentum. It reports ``skipped: 1`` and no losses.
With ``kl_coef`` or ``entropy_coef`` set, the step is taken on those terms.

Statistics per replica: ``reward`` (mean episode return), ``turns`` (mean per episode), ``policy_loss``,
``value_loss`` and ``value_error`` (``ppo_turns``), ``kl_penalty``, ``approx_kl``, ``clip_fraction``, ``entropy``
(when ``entropy_coef`` is set; computing it over the whole vocabulary at every token costs), all over the model's
tokens, ``tokens`` (model tokens), ``samples``. The maths is in :mod:`llmrl.plugins.rl_math`, the first
pass in :mod:`llmrl.plugins.rollouts`, the passes over the batch in :func:`llmrl.plugins.token_policy.train_epochs`;
this module reads the turns, gives the advantages and the loss of a minibatch (:meth:`TurnUpdater.minibatch_loss`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import (
    OffPolicy,
    group_episode_advantages,
    kl_penalty,
    penalised,
    per_prompt_mean,
    sequence_mean,
    token_ppo_losses,
    turn_gae,
    turn_spans,
    whiten_batch,
)
from llmrl.plugins.rl_math.variants import EntropySchedule
from llmrl.plugins.rollouts import PromptRows, first_pass, token_rows_of
from llmrl.plugins.token_policy import (
    Minibatch,
    MinibatchTerms,
    check_off_policy,
    off_policy_weights,
    policy_forward,
    train_epochs,
)
from llmrl.plugins.updater_args import SCHEDULED_ENTROPY_COEF, describe, updater_schema


@dataclass(frozen=True)
class TurnTerms:
    """The loss's optional terms both turn updaters take: the entropy bonus's schedule, the KL estimator and the
    off-policy correction."""

    entropy: EntropySchedule = field(default_factory=EntropySchedule)
    kl_estimator: str = "k3"
    off_policy: OffPolicy = field(default_factory=OffPolicy)

    @classmethod
    def of(cls, entropy_coef: float | dict, kl_estimator: str, off_policy: dict | None) -> TurnTerms:
        return cls(EntropySchedule.of(entropy_coef), kl_estimator, OffPolicy.of(off_policy))


def read_turns(batch: UpdateBatch, prompts: list[PromptRows], name: str) -> list[list[torch.Tensor]]:
    """Per local start, per episode, its ``[K]`` turn rewards; stores each start's ``model_mask`` rows and each
    episode's turn spans. Refuses, naming the argument and the episode, a mask that is not 0/1, an episode with
    no model token, and a number of rewards that is not the number of turns."""
    for key in ("model_mask", "turn_rewards"):
        if key not in batch.kwargs:
            raise ValueError(f"the {name} updater needs the per-sample keyword argument {key!r} (llmrl.episode_batch "
                             "builds the call from episodes: contexts, candidates, model_mask, turn_rewards, "
                             "old_logprobs)")
    counts = [len(p.rewards) for p in prompts]
    lengths = torch.cat([p.mask.sum(1) for p in prompts]) if prompts else torch.zeros(0, dtype=torch.long)
    masks = token_rows_of(batch.kwargs["model_mask"], counts, lengths, batch.indices, "model_mask")
    out, row = [], 0
    flags = batch.kwargs.get("bootstrap")
    if flags is None:
        flags = [None] * len(prompts)
    for p, entry, where, flagged in zip(prompts, batch.kwargs["turn_rewards"], batch.indices, flags):
        rows = masks[row:row + len(p.rewards), :p.mask.shape[1]]
        row += len(p.rewards)
        if not bool(((rows == 0) | (rows == 1)).all()):
            raise ValueError(f"model_mask[{where}] holds a value other than 0 and 1: mark the model's tokens 1 and the "
                             "environment's 0")
        p.tensors["model_mask"] = rows.bool() & p.mask
        p.spans = [turn_spans(r) for r in p.tensors["model_mask"]]
        p.index = where
        p.bootstrap = _bootstrap_flags(flagged, p, where)
        episodes = []
        for j, spans in enumerate(p.spans):
            rewards = torch.as_tensor(entry[j], dtype=torch.float32).flatten()
            if not spans:
                raise ValueError(f"episode {j} of start {where} has no model token (model_mask is all 0): there "
                                 "is nothing to train on")
            if rewards.numel() != len(spans):
                raise ValueError(f"turn_rewards[{where}][{j}] holds {rewards.numel()} rewards but episode {j} of "
                                 f"start {where} has {len(spans)} turns (runs of model tokens in model_mask): pass "
                                 "one reward per turn")
            if not bool(torch.isfinite(rewards).all()):
                raise ValueError(f"turn_rewards[{where}][{j}] holds a non-finite value; nothing was trained")
            episodes.append(rewards)
        out.append(episodes)
    return out


def _bootstrap_flags(entry, rows: PromptRows, where: int) -> list[bool]:
    """A start's per-episode ``bootstrap`` flags from its ``entry`` (all False for None); refuses a flag that is not
    0 or 1, and a flagged episode that ends on a model token (its last token must be the placeholder after the
    state it was cut in)."""
    count = rows.mask.shape[0]
    if entry is None:
        return [False] * count
    if isinstance(entry, numbers.Number) or isinstance(entry, torch.Tensor) and entry.dim() == 0:
        entry = [entry]  # a start with one episode
    flags = []
    for j in range(count):
        flag = entry[j]
        if isinstance(flag, torch.Tensor):
            flag = flag.item()
        if not isinstance(flag, bool) and flag not in (0, 1):
            raise ValueError(f"bootstrap[{where}][{j}] is {flag!r}: mark each episode 1 (truncated: bootstrap from "
                             "the critic) or 0 (ended)")
        length = int(rows.mask[j].sum())
        if flag and bool(rows.tensors["model_mask"][j, length - 1]):
            raise ValueError(f"episode {j} of start {where} is marked bootstrap but ends on a model token: a "
                             "bootstrapped episode goes on to the state it was cut in and ends with a placeholder "
                             "token (llmrl.episode_batch(groups, bootstrap=True) builds it)")
        flags.append(bool(flag))
    return flags


def spread(per_turn: list[torch.Tensor], spans: list[list[tuple[int, int]]], width: int, at_start: bool = False
           ) -> torch.Tensor:
    """``[k, width]`` rows holding each turn's value on its tokens (``at_start``: on its first token only)."""
    out = torch.zeros((len(per_turn), width))
    for j, (values, turns) in enumerate(zip(per_turn, spans)):
        for value, (start, end) in zip(values.tolist(), turns):
            out[j, start:start + 1 if at_start else end] = value
    return out


class TurnUpdater(ShufflingUpdater):
    """What ``ppo_turns`` and ``grpo_turns`` share: the inputs, the first pass and the loss of a minibatch
    (:meth:`minibatch_loss`, which :func:`~llmrl.plugins.token_policy.train_epochs` runs); a subclass gives the
    per-turn advantages (:meth:`advantages`)."""

    name = "turns"
    per_sample_args = {"model_mask": "token", "turn_rewards": "candidate", "old_logprobs": "token",
                       "ref_logprobs": "token", "bootstrap": "candidate", "behaviour_logprobs": "token"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    value_head: str | None = None  # no critic (grpo_turns): no value term
    value_clip: float | None = None

    def __init__(self, epochs: int, clip_eps: float, kl_coef: float, gamma: float, peft_adapter: str | None,
                 seed: int, terms: TurnTerms):
        self.epochs, self.clip_eps, self.kl_coef = epochs, clip_eps, kl_coef
        self.terms, self.entropy_coef, self.updates_done = terms, terms.entropy.at(0), 0
        self.gamma, self.peft_adapter = gamma, peft_adapter
        super().__init__(seed)

    def state_dict(self) -> dict:
        """The shuffling generator and, with an entropy schedule, the updates done (where the schedule is)."""
        state = super().state_dict()
        return {**state, "updates_done": self.updates_done} if self.terms.entropy.scheduled else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates_done = int(state.get("updates_done", 0))

    def advantages(self, prompts: list[PromptRows], rewards: list[list[torch.Tensor]], trainer: Trainer) -> None:
        raise NotImplementedError

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        if batch.candidates is None:
            raise ValueError(f"the {self.name} updater needs the episodes as candidates: caller.update(starts, "
                             "episodes, model_mask=..., turn_rewards=...) (llmrl.episode_batch builds them)")
        text = next((i for i, c in zip(batch.indices, batch.candidates)
                     if not all(isinstance(x, (list, tuple)) and all(isinstance(t, int) for t in x) for x in c)), None)
        if text is not None:  # (a replica that raises here is voted out by the others at their next trainer call)
            raise ValueError(f"the episodes of start {text} are not all token ids: {self.name} reads model_mask per "
                             "token, which only ids scored exactly as given line up with (llmrl.episode_batch gives "
                             "ids)")
        if self.kl_coef > 0 and "ref_logprobs" not in batch.kwargs and not trainer.has_adapters:
            raise ValueError(f"the {self.name} updater's KL term needs a reference policy: add LoRA adapters, pass "
                             "ref_logprobs, or set kl_coef to 0")
        if "bootstrap" in batch.kwargs and not self.value_head:
            raise ValueError(f"{self.name} has no critic to bootstrap truncated episodes from: drop bootstrap "
                             "(llmrl.episode_batch(groups) without bootstrap=True), or train with ppo_turns")
        check_off_policy(batch, self.terms.off_policy, self.name)
        self.entropy_coef = self.terms.entropy.at(self.updates_done)
        zeros = [torch.zeros(len(c)) for c in batch.candidates]
        prompts = first_pass(batch, trainer, zeros, self.peft_adapter, self.value_head,
                             need_reference=self.kl_coef > 0)
        rewards = read_turns(batch, prompts, self.name)
        self.advantages(prompts, rewards, trainer)
        mismatch = off_policy_weights(prompts, self.terms.off_policy, mask_key="model_mask")
        scheduled = {"entropy_coef": self.entropy_coef} if self.terms.entropy.scheduled else {}
        self.updates_done += 1
        episodes = sum(len(r) for r in rewards)
        collected = {"reward": sum(float(r.sum()) for e in rewards for r in e),
                     "turns": sum(r.numel() for e in rewards for r in e)}
        signal = sum(float(p.tensors["advantages"].abs().sum()) for p in prompts)
        only_advantages = not self.value_head and self.kl_coef == 0 and self.entropy_coef == 0
        if only_advantages and float(trainer.sum_across_replicas([signal])[0]) == 0:
            # every group's episodes returned alike and the loss has no other term: no gradient, and an optimizer
            # step would still move the weights along the optimizer's momentum
            return {"reward": collected["reward"] / max(episodes, 1), "turns": collected["turns"] / max(episodes, 1),
                    "tokens": int(sum(float(p.tensors["model_mask"].sum()) for p in prompts)), "samples": len(batch),
                    "skipped": 1, **mismatch, **scheduled}
        passes = train_epochs(batch, trainer, prompts, self.minibatch_loss, self.epochs, self.generator)
        stats = passes.token_means()
        if "value_loss" in passes.sums:
            stats["value_loss"] = passes.sums["value_loss"] / max(collected["turns"] * self.epochs, 1)
            stats["value_error"] = self.value_error
        stats.update(reward=collected["reward"] / max(episodes, 1), turns=collected["turns"] / max(episodes, 1),
                     tokens=int(sum(float(p.tensors["model_mask"].sum()) for p in prompts)), samples=len(batch),
                     **mismatch, **scheduled)
        return stats

    def minibatch_loss(self, trainer: Trainer, m: Minibatch) -> MinibatchTerms:
        """One minibatch's loss over the model's tokens (each episode's mean, plus the value loss's mean over its
        turns; then each start's, then the step's) and its statistics."""
        heads = [self.value_head] if self.value_head else []
        out, logp, scored, entropy = policy_forward(trainer, m.batch, self.peft_adapter, heads,
                                                    entropy=self.entropy_coef != 0)
        if not torch.equal(m.take("mask", logp), scored.bool()):
            raise RuntimeError(f"the {self.name} updater's inputs were read for other token counts than the pass "
                               "scored (candidates must be scored exactly as their token ids)")
        own = m.take("model_mask", logp).bool()
        values = out.tokens_by_candidate(out.heads[self.value_head].float())[0] if self.value_head else None
        terms = token_ppo_losses(logp.float(), m.take("old_logprobs", logp), m.take("advantages", logp), values,
                                 m.take("values", logp) if self.value_head else None,
                                 m.take("returns", logp) if self.value_head else None, self.clip_eps, self.value_clip)
        kl = kl_penalty(logp.float(), m.take("ref_logprobs", logp) if self.kl_coef > 0 else None, like=terms.policy,
                        estimator=self.terms.kl_estimator)
        policy = terms.policy * m.take("is_weights", logp) if self.terms.off_policy.active else terms.policy
        per_token = penalised(policy, kl, self.kl_coef, entropy, self.entropy_coef)
        per_token = torch.where(own, per_token, 0.0)
        per_episode = sequence_mean(per_token, own)  # (where: an environment token's term never reaches it)
        sums = {}
        if self.value_head:
            boundary = m.take("boundaries", logp).bool()
            per_episode = per_episode + self.value_coef * sequence_mean(terms.value, boundary)
            sums["value_loss"] = float((terms.value.detach() * boundary).sum())
        loss = m.batch.mean(per_prompt_mean(per_episode, out.candidate_context, out.num_contexts))
        return MinibatchTerms(loss, own, {"policy_loss": policy, "kl_penalty": kl, "clip_fraction": terms.clipped,
                                          "approx_kl": terms.approx_kl, "entropy": entropy}, sums)


class PPOTurnsUpdater(TurnUpdater):
    """Args (config ``args``):
        epochs: passes over the batch per update (default 2).
        clip_eps: policy ratio clip (default 0.2).
        value_clip: value clip around the first pass's values (default 0.2; null disables).
        value_coef / entropy_coef: loss weights (defaults 0.5 and 0.0); entropy_coef may be {start, end, updates}.
        kl_coef: weight of the per-token KL estimator to the reference (default 0: no reference pass).
        kl_estimator: "k1", "k2" or "k3" (default), the per-token KL estimator in the loss.
        off_policy: the correction from behaviour_logprobs (the sampler's) to the old log-probs (default: none).
        gamma / lam: GAE's discount and lambda per turn (defaults 1.0 and 0.95).
        whiten: whiten the turns' advantages over the whole batch (default true).
        value_head: the token-level head giving the value at each turn's boundary (default "value").
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    name = "ppo_turns"
    args_schema = updater_schema("epochs", "clip_eps", "value_clip", "value_coef", "kl_coef",
                                 "value_head", "peft_adapter", "seed", "off_policy", "kl_estimator",
                                 entropy_coef=SCHEDULED_ENTROPY_COEF,
                                 gamma={"type": "number", "minimum": 0, "maximum": 1},
                                 lam={"type": "number", "minimum": 0, "maximum": 1}, whiten={"type": "boolean"})
    describe(args_schema,
             kl_coef="weight of the per-token KL estimator to the reference (0: no reference pass)",
             gamma="GAE discount per turn",
             lam="GAE lambda per turn",
             whiten="whiten the turns' advantages over the whole batch",
             value_clip="value clip around the first pass's values (null disables)",
             value_head="the token-level head giving the value at each turn's boundary")

    def __init__(self, epochs: int = 2, clip_eps: float = 0.2, value_clip: float | None = 0.2,
                 value_coef: float = 0.5, entropy_coef: float | dict = 0.0, kl_coef: float = 0.0, gamma: float = 1.0,
                 lam: float = 0.95, whiten: bool = True, value_head: str = "value", peft_adapter: str | None = None,
                 seed: int = 0, kl_estimator: str = "k3", off_policy: dict | None = None):
        super().__init__(epochs, clip_eps, kl_coef, gamma, peft_adapter, seed,
                         TurnTerms.of(entropy_coef, kl_estimator, off_policy))
        if not value_head:
            raise ValueError("ppo_turns needs a token-level value head (value_head); without a critic use grpo_turns")
        self.value_clip, self.value_coef, self.lam, self.whiten = value_clip, value_coef, lam, whiten
        self.value_head = value_head
        self.value_error = 0.0

    def advantages(self, prompts, rewards, trainer) -> None:
        per_turn, squared, count = [], 0.0, 0
        for p, episodes in zip(prompts, rewards):
            values = [p.tensors["values"][j, [start for start, _ in spans]] for j, spans in enumerate(p.spans)]
            after = [float(p.tensors["values"][j, int(p.mask[j].sum()) - 1]) if cut else None
                     for j, cut in enumerate(p.bootstrap)]  # the value at a truncated episode's placeholder
            pairs = [turn_gae(r, v, self.gamma, self.lam, last) for r, v, last in zip(episodes, values, after)]
            per_turn.append([a for a, _ in pairs])
            width = p.mask.shape[1]
            p.tensors["returns"] = spread([g for _, g in pairs], p.spans, width, at_start=True)
            p.tensors["boundaries"] = spread([torch.ones(len(s)) for s in p.spans], p.spans, width, at_start=True)
            squared += sum(float(((g - v) ** 2).sum()) for (_, g), v in zip(pairs, values))
            count += sum(len(s) for s in p.spans)
        self.value_error = squared / max(count, 1)
        if self.whiten:  # over every turn of the batch, as one tensor (one sum: the same on every replica count)
            flat = torch.cat([a for episodes in per_turn for a in episodes] or [torch.zeros(0)])
            whitened = iter(whiten_batch([flat], None, trainer.sum_across_replicas, unit="turn")[0].split(
                [a.numel() for episodes in per_turn for a in episodes]))
            per_turn = [[next(whitened) for _ in episodes] for episodes in per_turn]
        for p, episodes in zip(prompts, per_turn):
            p.tensors["advantages"] = spread(episodes, p.spans, p.mask.shape[1])


class GRPOTurnsUpdater(TurnUpdater):
    """Args (config ``args``):
        epochs: passes over the batch per update (default 1).
        clip_eps: policy ratio clip (default 0.2).
        kl_coef: weight of the per-token KL estimator to the reference (default 0: no reference pass).
        entropy_coef: entropy bonus (default 0), or {start, end, updates}: linear over updates.
        kl_estimator: "k1", "k2" or "k3" (default), the per-token KL estimator in the loss.
        off_policy: the correction from behaviour_logprobs (the sampler's) to the old log-probs (default: none).
        gamma: discount per turn of the episode returns (default 1.0).
        scale_rewards: divide by the group's standard deviation of episode returns (default true).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    name = "grpo_turns"
    args_schema = updater_schema("epochs", "clip_eps", "kl_coef", "peft_adapter", "seed", "off_policy",
                                 "kl_estimator", entropy_coef=SCHEDULED_ENTROPY_COEF,
                                 gamma={"type": "number", "minimum": 0, "maximum": 1},
                                 scale_rewards={"type": "boolean"})
    describe(args_schema,
             kl_coef="weight of the per-token KL estimator to the reference (0: no reference pass)",
             gamma="discount per turn of the episode returns",
             scale_rewards="divide by the group's standard deviation of episode returns")

    def __init__(self, epochs: int = 1, clip_eps: float = 0.2, kl_coef: float = 0.0,
                 entropy_coef: float | dict = 0.0, gamma: float = 1.0, scale_rewards: bool = True,
                 peft_adapter: str | None = None, seed: int = 0, kl_estimator: str = "k3",
                 off_policy: dict | None = None):
        super().__init__(epochs, clip_eps, kl_coef, gamma, peft_adapter, seed,
                         TurnTerms.of(entropy_coef, kl_estimator, off_policy))
        self.scale_rewards = scale_rewards

    def advantages(self, prompts, rewards, trainer) -> None:
        for p, episodes in zip(prompts, rewards):
            if len(episodes) < 2:
                raise ValueError(f"start {p.index} has {len(episodes)} episode(s): a grpo_turns group needs at least 2 "
                                 "episodes from the same start (play several episodes per start)")
            advantages = group_episode_advantages(episodes, self.gamma, self.scale_rewards)
            p.tensors["advantages"] = spread(advantages, p.spans, p.mask.shape[1])
