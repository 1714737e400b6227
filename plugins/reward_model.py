"""A reward model's parts: the ``reward`` head (a scalar per candidate) and the ``pairwise_reward`` updater that trains
it on preference pairs with the Bradley-Terry loss, as InstructGPT and PaLM-rlhf train theirs before the RL stage.

The head reads the last-layer hidden state at the last token of prompt + response (``candidate_hidden``); the reward
model answers ``caller.custom_module_fns(["reward"], prompts, [[response], ...], llm="reward")`` with one float per
response. The updater's samples are ``caller.update(prompts, [[chosen, rejected], ...], llm="reward")``: two
candidates per prompt, the preferred one first; per-sample keyword argument ``margins`` (optional, default 0) asks
the chosen reward to exceed the rejected one by that much (Llama 2's margin loss). Loss per pair:
``-log sigmoid(r_chosen - r_rejected - margin)``; statistics: ``loss``, ``accuracy`` (pairs ranked right before the
step), ``margin`` (mean ``r_chosen - r_rejected``), ``samples``.

This module does not generate or score text; the engine's forward pass gives the head its hidden states.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import ForwardOutputs, Head, LLMInfo, ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.updater_args import describe, updater_schema
from llmrl.plugins.value_head import mlp


class RewardHead(Head):
    """A scalar reward r(prompt, response) per candidate.

    Args (config ``args``):
        hidden: width of the hidden layers (default 256).
        layers: number of hidden layers (default 0: a linear head, as reward models usually have).
    """

    level = "candidate"
    needs_context_hidden = False
    needs_candidate_hidden = True
    args_schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"hidden": {"type": "integer", "minimum": 1, "description": "width of the hidden layers"},
                       "layers": {"type": "integer", "minimum": 0,
                                  "description": "number of hidden layers (0: a linear head)"}},
    }

    def __init__(self, llm: LLMInfo, hidden: int = 256, layers: int = 0):
        super().__init__(llm)
        self.mlp = mlp(llm.hidden_size, hidden, layers)

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor:
        weight = self.mlp[-1].weight
        return self.mlp(outputs.candidate_hidden.to(weight.dtype)).squeeze(-1).float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """``[n]`` per-pair loss ``-log sigmoid(chosen - rejected - margin)``."""
    diff = chosen - rejected
    if margins is not None:
        diff = diff - margins
    return -torch.nn.functional.logsigmoid(diff)


class PairwiseRewardUpdater(ShufflingUpdater):
    """Args (config ``args``):
        epochs: passes over the pairs per update (default 1).
        head: the reward head's key (default "reward").
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"margins": "sample"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema("epochs", "seed", head={"type": "string"})
    describe(args_schema,
             epochs="passes over the pairs per update",
             head="the reward head's key")

    def __init__(self, epochs: int = 1, head: str = "reward", seed: int = 0):
        self.epochs, self.head = epochs, head
        super().__init__(seed)

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        bad = None if batch.candidates is None else next(
            ((i, len(c)) for i, c in zip(batch.indices, batch.candidates) if len(c) != 2), None)
        if batch.candidates is None or bad is not None:
            raise ValueError("the pairwise_reward updater needs two candidates per prompt, the preferred one first: "
                             "caller.update(prompts, [[chosen, rejected], ...])"
                             + (f"; prompt {bad[0]} has {bad[1]}" if bad is not None else ""))
        sums = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        seen = 0
        for _ in range(self.epochs):
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                out = trainer.forward(mb.contexts, mb.candidates, heads=[self.head])
                rewards = out.heads[self.head].float().view(-1, 2)
                margins = None
                if "margins" in mb.kwargs:
                    margins = torch.as_tensor(mb.kwargs["margins"], dtype=torch.float32, device=rewards.device)
                loss = bradley_terry_loss(rewards[:, 0], rewards[:, 1], margins)
                trainer.backward(mb.mean(loss))
                trainer.step()
                diff = (rewards[:, 0] - rewards[:, 1]).detach()
                sums["loss"] += float(loss.detach().sum())
                sums["accuracy"] += float((diff > 0).float().sum())
                sums["margin"] += float(diff.sum())
                seen += len(mb)
        stats = {key: value / max(seen, 1) for key, value in sums.items()}
        stats["samples"] = len(batch)
        return stats
