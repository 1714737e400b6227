"""The shared training loop of the token-level policy updaters (:mod:`llmrl.plugins.token_policy`), run in process on
the bigram stand-in for the trainer (:mod:`testkit.bigram`): one backward pass and one step per minibatch of every
epoch, each minibatch handed the rows of its own samples and, when counted, its optimizer step's token total;
statistics averaged over the tokens the loss names, a term outside them counting 0 whatever its value; and
:func:`~llmrl.plugins.rl_math.whiten_batch` equal to whitening the concatenation by hand."""

from __future__ import annotations

from dataclasses import replace

import torch

from testkit.bigram import BigramTrainer, batch

CONTEXTS = [[1], [2], [4]]
CONTINUATIONS = [[[0, 1, 2], [3]], [[5, 0]], [[2, 2, 2, 2]]]


def test_every_minibatch_of_every_epoch_steps_once_with_its_own_rows_and_step_total():
    from llmrl.plugins.rollouts import PromptRows
    from llmrl.plugins.token_policy import MinibatchTerms, policy_forward, train_epochs

    trainer = BigramTrainer(micro_batch_size=2)
    whole = replace(batch(CONTEXTS, CONTINUATIONS), accumulation_steps=2)
    prompts = [PromptRows(mask=torch.ones(len(c), 1, dtype=torch.bool), rewards=torch.zeros(len(c)),
                          tensors={"tag": torch.full((len(c), 1), float(i))}) for i, c in enumerate(CONTINUATIONS)]
    seen = []

    def loss_of(trainer, m):
        out, logp, mask, _ = policy_forward(trainer, m.batch, None)
        assert [int(r.tensors["tag"][0, 0]) for r in m.rows] == m.batch.indices  # its own samples' rows
        seen.append(m.step_tokens)
        nan_outside = torch.where(mask, 1.0, float("nan"))
        return MinibatchTerms((logp * mask).sum(), mask, {"one": nan_outside, "absent": None}, {"calls": 1.0})

    totals = train_epochs(whole, trainer, prompts, loss_of, epochs=3, generator=torch.Generator().manual_seed(0),
                          step_token_counts={0: 10.0, 1: 20.0, 2: 40.0})
    assert trainer.steps == len(trainer.grads) == 6 and totals.sums == {"calls": 6.0}
    assert seen == [70.0] * 6  # two micro-batches of one accumulated step: all three samples' tokens
    assert totals.tokens == 3 * 10 and totals.token_means() == {"one": 1.0}  # NaN outside the mask counts 0


def test_whiten_batch_is_whitening_the_concatenation():
    from llmrl.plugins.rl_math import whiten_batch

    values = [torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[4.0, -3.0, 0.0], [0.5, 7.0, 0.0]])]
    masks = [torch.tensor([[True, True, False]]), torch.tensor([[True, True, False], [True, True, True]])]
    real = torch.cat([v[m] for v, m in zip(values, masks)])
    mean, std = float(real.double().mean()), float(real.double().std())
    got = whiten_batch(values, masks, lambda stats: stats)
    for v, m, g in zip(values, masks, got):
        torch.testing.assert_close(g, torch.where(m, (v - mean) / (std + 1e-8), 0.0))
    flat = whiten_batch([real], None, lambda stats: stats)[0]
    torch.testing.assert_close(flat, (real - mean) / (std + 1e-8))
