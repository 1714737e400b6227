"""The example plugin package's updater (examples/plugin_package) against its loss written out in plain PyTorch, on
one and on two in-process replicas (:mod:`testkit.bigram`): REINFORCE over candidate actions with the whole batch's
mean return as the baseline. A review found the example's baseline taken over each replica's share: with 2
replicas its weights moved 0.40 away from the plain step, for a step of 0.27."""

import os
import sys

import torch

from testkit.bigram import BigramTrainer, batch, two_replicas

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                "plugin_package"))

CONTEXTS = [[1, 2], [3], [0, 4], [5]]
CANDIDATES = [[[1], [2, 3]], [[4], [5], [0, 1]], [[2], [3]], [[1, 1], [4]]]
ACTIONS = [0, 2, 1, 1]
RETURNS = [1.0, 3.0, 0.0, -2.0]


def plain_gradient(W: torch.Tensor) -> torch.Tensor:
    W = W.detach().clone().requires_grad_(True)
    table = torch.log_softmax(W, -1)
    baseline = sum(RETURNS) / len(RETURNS)
    losses = []
    for context, candidates, action, ret in zip(CONTEXTS, CANDIDATES, ACTIONS, RETURNS):
        scores = torch.stack([sum(table[p, t] for p, t in zip([context[-1], *c[:-1]], c)) for c in candidates])
        losses.append(-(ret - baseline) * torch.log_softmax(scores, 0)[action])
    torch.stack(losses).mean().backward()
    return W.grad


def test_reinforce_example_equals_its_plain_loss_on_one_and_two_replicas():
    from llmrl_example_plugins import ReinforceUpdater

    whole = batch(CONTEXTS, CANDIDATES, actions=ACTIONS, returns=RETURNS)
    want = plain_gradient(BigramTrainer().W)
    one = BigramTrainer(micro_batch_size=8)
    ReinforceUpdater().update(whole, one)
    torch.testing.assert_close(sum(g[0] for g in one.grads), want, atol=1e-6, rtol=0)
    grads = two_replicas(whole, [[0, 1], [2, 3]], lambda: BigramTrainer(micro_batch_size=8), ReinforceUpdater)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, want, atol=1e-6, rtol=0)  # DeepSpeed averages the two
