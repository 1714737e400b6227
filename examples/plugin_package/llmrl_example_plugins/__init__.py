"""Example llmrl plugins: a candidate-level action-value head and a REINFORCE updater.

Registered in this package's pyproject.toml under the entry-point groups ``llmrl.heads`` and
``llmrl.updaters``; llmrl imports this module only when a config names one of them.
"""

from __future__ import annotations

import torch

from llmrl.plugins import Head, Updater


class ActionValueHead(Head):
    """Q(context, candidate): an MLP on the hidden state of each candidate's last token."""

    level = "candidate"
    needs_context_hidden = False
    needs_candidate_hidden = True
    args_schema = {"type": "object", "additionalProperties": False,
                   "properties": {"hidden": {"type": "integer", "minimum": 1}}}

    def __init__(self, llm, hidden: int = 64):
        super().__init__(llm)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(llm.hidden_size, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, outputs):
        weight = self.mlp[0].weight
        return self.mlp(outputs.candidate_hidden.to(weight.dtype)).squeeze(-1).float()


class ReinforceUpdater(Updater):
    """REINFORCE over candidate actions: loss = -(return - baseline) * log pi(action | context).

    Per-sample keyword arguments: ``actions`` (chosen candidate index), ``returns``.
    """

    args_schema = {"type": "object", "additionalProperties": False,
                   "properties": {"baseline": {"type": "boolean"}}}

    def __init__(self, baseline: bool = True):
        self.baseline = baseline

    def update(self, batch, trainer):
        returns_all = torch.as_tensor(batch.kwargs["returns"], dtype=torch.float32)
        baseline = torch.tensor(0.0)
        if self.baseline:  # the mean return of the whole batch, over every replica's share (the same everywhere)
            summed, count = trainer.sum_across_replicas([float(returns_all.sum()), float(len(returns_all))])
            baseline = (summed / count.clamp(min=1)).float()
        total = 0.0
        for mb in batch.minibatches(trainer.micro_batch_size):
            out = trainer.forward(mb.contexts, mb.candidates)
            logits, mask = out.scores_by_context()
            logp = torch.log_softmax(logits.float(), -1)
            actions = torch.as_tensor(mb.kwargs["actions"], dtype=torch.long, device=logp.device)
            returns = torch.as_tensor(mb.kwargs["returns"], dtype=torch.float32, device=logp.device)
            chosen = logp.gather(1, actions[:, None]).squeeze(1)
            loss = mb.mean(-(returns - baseline.to(logp.device)) * chosen)
            trainer.backward(loss)
            trainer.step()
            total += float(loss.detach())
        return {"loss": total}
