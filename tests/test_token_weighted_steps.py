"""The token-weighted losses of ``sft`` (``loss: token``) and ``grpo`` (``loss: batch_token``) weigh every token of
an optimizer step the same, whatever micro-step and replica it fell in: micro-batch 1 x accumulation 3 trains as
micro-batch 3 x 1, as Hugging Face's Trainer does since it counts the step's tokens (``num_items_in_batch``). Each
micro-step used to divide by its own tokens only, so a short sample beside long ones weighed as much as all of
them. Run in process on a bigram stand-in for the trainer (:mod:`testkit.bigram`) against the loss written out in
plain PyTorch. (``ilql`` divides the same way: :mod:`llmrl.plugins.update_batch`'s ``step_totals``.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from testkit.bigram import BigramTrainer, batch, token_logps, two_replicas

PROMPTS = [[1], [2], [4]]
TARGETS = [[[0, 1, 2, 3, 4, 5, 0, 1]], [[5]], [[3, 3], [2, 2, 2]]]  # 8, 1 and 5 tokens


def plain_sft_gradient(trainer: BigramTrainer) -> torch.Tensor:
    """The mean negative log-likelihood over the 14 target tokens of the step."""
    W = trainer.W.detach().clone().requires_grad_(True)
    nll = torch.cat([-token_logps(W, p, t) for p, targets in zip(PROMPTS, TARGETS) for t in targets])
    nll.mean().backward()
    return W.grad


@pytest.mark.parametrize("micro, accumulation", [(3, 1), (1, 3), (2, 2)])
def test_sft_weighs_every_target_token_of_the_step_the_same(micro, accumulation):
    from llmrl.plugins.sft import SFTUpdater

    trainer = BigramTrainer(micro_batch_size=micro)
    stats = SFTUpdater(add_eos=False).update(replace(batch(PROMPTS, TARGETS), accumulation_steps=accumulation),
                                             trainer)
    torch.testing.assert_close(sum(g[0] for g in trainer.grads), plain_sft_gradient(trainer), atol=1e-6, rtol=0)
    assert stats["tokens"] == 14


def test_sft_weighs_every_target_token_the_same_across_two_replicas():
    from llmrl.plugins.sft import SFTUpdater

    reference = BigramTrainer()
    grads = two_replicas(batch(PROMPTS, TARGETS), [[0, 1], [2]], lambda: BigramTrainer(micro_batch_size=2),
                         lambda: SFTUpdater(add_eos=False))
    torch.testing.assert_close((grads[0] + grads[1]) / 2, plain_sft_gradient(reference), atol=1e-6, rtol=0)


def test_a_forward_that_scores_other_tokens_than_counted_is_refused():
    """The step's divisor comes from the tokenisation; a pass that disagrees would train on a wrong weight."""
    from llmrl.plugins.sft import SFTUpdater

    trainer = BigramTrainer()
    trainer.scored_token_counts = lambda contexts, candidates, add_eos=False: torch.tensor(
        [len(c) + 1 for targets in candidates for c in targets])
    with pytest.raises(RuntimeError, match="scored 14 tokens where the tokenisation counted 18"):
        SFTUpdater(add_eos=False).update(batch(PROMPTS, TARGETS), trainer)
    assert not trainer.grads
