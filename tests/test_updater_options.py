"""Built-in updaters' options that changed what they train without a word, run in process on a bigram stand-in
for the trainer (:mod:`testkit.bigram`) against the documented loss written out in plain PyTorch:

- ``grpo_turns`` skipped every update whose groups all returned alike, also when its loss had a KL term (whose
  gradient is not 0 once the policy has left the reference): with ``kl_coef`` it now steps on that term;
- ``ppo`` without ``old_values`` ignored its ``value_clip`` (0.2 by default): refused, naming both; so are
  ``old_logprobs`` above 0 (not log-probabilities)."""

from __future__ import annotations

import pytest
import torch

from testkit.bigram import BigramTrainer, batch, token_logps

CONTEXTS = [[1], [2]]
EPISODES = [[[0, 1, 2, 3, 4], [3, 3, 5, 1]], [[5, 0, 2], [1, 2, 3, 4, 0, 1]]]
MASKS = [[[1, 1, 0, 1, 1], [1, 0, 0, 1]], [[1, 0, 1], [1, 1, 0, 0, 1, 1]]]
ALIKE = [[[0.0, 1.0], [1.0, 0.0]], [[0.5, 0.5], [0.0, 1.0]]]  # each start's two episodes return the same


def old_logprobs(W: torch.Tensor) -> list:
    return [[(token_logps(W, c, e).detach() + 0.1 * torch.tensor([(-1.0) ** t for t in range(len(e))])).tolist()
             for e in episodes] for c, episodes in zip(CONTEXTS, EPISODES)]


def kl_only_gradient(trainer: BigramTrainer, kl_coef: float) -> torch.Tensor:
    """The documented loss when every advantage is 0: kl_coef x k3(ref, policy), averaged over an episode's model
    tokens, then over a start's episodes, then over starts."""
    W = trainer.W.detach().clone().requires_grad_(True)
    per_start = []
    for context, episodes, masks in zip(CONTEXTS, EPISODES, MASKS):
        per_episode = []
        for tokens, mask in zip(episodes, masks):
            d = token_logps(trainer.W0, context, tokens) - token_logps(W, context, tokens)
            per_episode.append((kl_coef * (torch.exp(d) - d - 1))[torch.tensor(mask, dtype=torch.bool)].mean())
        per_start.append(torch.stack(per_episode).mean())
    torch.stack(per_start).mean().backward()
    return W.grad


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_turns_steps_on_its_kl_term_when_every_group_returned_alike(kl_coef):
    from llmrl.plugins.ppo_turns import GRPOTurnsUpdater

    trainer = BigramTrainer()
    stats = GRPOTurnsUpdater(epochs=1, kl_coef=kl_coef).update(
        batch(CONTEXTS, EPISODES, model_mask=MASKS, turn_rewards=ALIKE, old_logprobs=old_logprobs(trainer.W)), trainer)
    if kl_coef == 0:  # no term has a gradient: no step (Adam's momentum would still move the weights)
        assert stats["skipped"] == 1 and trainer.steps == 0 and not trainer.grads
        return
    expected = kl_only_gradient(trainer, kl_coef)
    assert "skipped" not in stats and trainer.steps == 1 and float(expected.abs().max()) > 1e-3
    torch.testing.assert_close(trainer.grads[0][0], expected, atol=1e-6, rtol=0)


def test_ppo_refuses_a_value_clip_without_old_values():
    from llmrl.plugins.ppo import PPOUpdater

    kwargs = {"actions": [0, 1], "old_logprobs": [-0.7, -0.7], "advantages": [1.0, -1.0], "returns": [5.0, -5.0]}
    candidates = [[[0], [1]], [[2], [3]]]
    with pytest.raises(ValueError, match=r"clips the value loss around old_values \(value_clip 0.2\).*value_clip to "
                                         "null"):
        PPOUpdater(epochs=1).update(batch(CONTEXTS, candidates, **kwargs), BigramTrainer(head_level="context"))
    for clip, given in ((None, {}), (0.2, {"old_values": [0.0, 0.0]})):
        trainer = BigramTrainer(head_level="context")
        PPOUpdater(epochs=1, value_clip=clip).update(batch(CONTEXTS, candidates, **kwargs, **given), trainer)
        assert trainer.steps == 1


def test_ppo_refuses_old_logprobs_above_zero():
    """A log-probability is at most 0: a positive one is not the log-policy over the candidates that ppo's ratio
    needs (``score(..., normalize=True)``), and was trained on as given."""
    from llmrl.plugins.ppo import PPOUpdater

    kwargs = {"actions": [0, 1], "old_logprobs": [-0.7, 0.5], "advantages": [1.0, -1.0], "returns": [5.0, -5.0]}
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] is 0.5, above 0: .*normalize=True"):
        PPOUpdater(epochs=1, value_clip=None).update(batch(CONTEXTS, [[[0], [1]], [[2], [3]]], **kwargs),
                                                     BigramTrainer(head_level="context"))
