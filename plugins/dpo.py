"""The built-in ``dpo`` updater: Direct Preference Optimization (Rafailov et al., 2023), and its IPO and robust
variants, on (prompt, chosen, rejected) pairs.

A sample is one prompt with two continuations, the preferred one first: ``caller.update(prompts, [[chosen,
rejected], ...])``. The loss of a pair compares how much more the policy prefers the chosen continuation than a
frozen reference does: with ``h = (logp_c - ref_c) - (logp_r - ref_r)`` (summed log-probs of each continuation's
tokens; per-token means for ``ipo``), :func:`~llmrl.plugins.rl_math.preference_loss` gives ``sigmoid`` (DPO; with
``label_smoothing`` conservative DPO), ``robust`` (robust DPO) or ``ipo``. The reference (``reference``) is the model
with its LoRA adapters disabled (``"base"``, the default), a snapshot or another adapter by name (taken with
``caller.snapshot``), or the log-probs the client gives per pair (per-sample ``ref_logprobs``: per prompt, the
chosen's and the rejected's summed log-probs, or their per-token means for ``ipo``), which skips the reference pass.
Reference log-probs are computed once per update, before any step, so every epoch compares with the same values.

Statistics per replica: ``loss``, ``rewards_chosen`` and ``rewards_rejected`` (the implicit rewards
``beta * (logp - ref)``, means), ``reward_margin`` (their mean difference), ``reward_accuracy`` (the share of pairs
whose chosen reward is the higher), ``logps_chosen`` / ``logps_rejected`` (the policy's, as scored), ``samples``.
This module is the algorithm; the maths is in :mod:`llmrl.plugins.rl_math`.
"""

from __future__ import annotations

import numbers

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import preference_loss
from llmrl.plugins.updater_args import describe, updater_schema


def check_pairs(batch: UpdateBatch, what: str) -> None:
    """Refuse a batch whose prompts do not each have exactly two continuations, naming the first that does not."""
    bad = None if batch.candidates is None else next(
        ((i, len(c)) for i, c in zip(batch.indices, batch.candidates) if len(c) != 2), None)
    if batch.candidates is None or bad is not None:
        raise ValueError(f"the {what} updater needs two continuations per prompt, the preferred one first: "
                         "caller.update(prompts, [[chosen, rejected], ...])"
                         + (f"; prompt {bad[0]} has {bad[1]}" if bad is not None else ""))


def pair_logps(out, mean: bool) -> torch.Tensor:
    """``[pairs, 2]``: each continuation's summed log-prob (or per-token mean), chosen then rejected."""
    scores = out.candidate_scores.float()
    if mean:
        scores = scores / out.candidate_token_counts.to(scores.device).clamp(min=1)
    return scores.view(-1, 2)


def _count(value) -> int:
    """How many numbers ``value`` holds: a number 1, a tensor or array its elements, a sequence its length."""
    if isinstance(value, numbers.Number):
        return 1
    if isinstance(value, torch.Tensor):
        return value.numel()
    if hasattr(value, "size") and not callable(value.size):  # numpy
        return int(value.size)
    return len(value) if hasattr(value, "__len__") else 1


def _number(value) -> float:
    """The one number of a number, a 0-d or one-element tensor or array."""
    return float(value.reshape(())) if hasattr(value, "reshape") else float(value)


class DPOUpdater(ShufflingUpdater):
    """Args (config ``args``):
        beta: the strength of the reference (default 0.1).
        loss: "sigmoid" (DPO), "robust" or "ipo" (default "sigmoid").
        label_smoothing: the assumed share of flipped preferences, for "sigmoid" and "robust" (default 0).
        reference: "base" (the model with its adapters disabled) or the name of a snapshot or adapter (default
            "base"); per-sample ``ref_logprobs`` replace it.
        epochs: passes over the batch per update (default 1).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"ref_logprobs": "candidate"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema(
        "epochs", "peft_adapter", "seed", beta={"type": "number", "exclusiveMinimum": 0},
        loss={"enum": ["sigmoid", "robust", "ipo"]},
        label_smoothing={"type": "number", "minimum": 0, "exclusiveMaximum": 0.5},
        reference={"type": "string", "minLength": 1})
    describe(args_schema,
             beta="the strength of the reference",
             loss="\"sigmoid\" (DPO), \"robust\" or \"ipo\"",
             label_smoothing="the assumed share of flipped preferences, for \"sigmoid\" and \"robust\"",
             reference="\"base\" (the model with its adapters disabled) or the name of a snapshot or adapter; "
                       "per-sample ref_logprobs replace it")

    def __init__(self, beta: float = 0.1, loss: str = "sigmoid", label_smoothing: float = 0.0,
                 reference: str = "base", epochs: int = 1, peft_adapter: str | None = None, seed: int = 0):
        if loss == "ipo" and label_smoothing:
            raise ValueError(f"label_smoothing: {label_smoothing} is not read by loss 'ipo' (its target is fixed); "
                             "set it to 0, or use loss 'sigmoid' (conservative DPO) or 'robust'")
        self.beta, self.loss, self.label_smoothing, self.reference = beta, loss, label_smoothing, reference
        self.epochs, self.peft_adapter = epochs, peft_adapter
        super().__init__(seed)

    def _references(self, batch: UpdateBatch, trainer: Trainer) -> torch.Tensor:
        """``[pairs, 2]`` reference log-probs of this replica's pairs, in batch order."""
        if "ref_logprobs" in batch.kwargs:
            for index, pair in zip(batch.indices, batch.kwargs["ref_logprobs"]):
                sized = next((j for j, v in enumerate(pair) if _count(v) != 1), None)
                if sized is not None:  # per-token values: float() failed on a server without naming them
                    raise ValueError(f"ref_logprobs[{index}][{sized}] holds {_count(pair[sized])} values; dpo reads "
                                     "one number per candidate: the reference log-prob of the whole continuation (the "
                                     "sum over its tokens); nothing was trained")
            given = torch.tensor([[_number(v) for v in pair] for pair in batch.kwargs["ref_logprobs"]],
                                 dtype=torch.float32).view(-1, 2)
            if not torch.isfinite(given).all():
                row = int(torch.nonzero(~torch.isfinite(given).all(1))[0])
                raise ValueError(f"ref_logprobs[{batch.indices[row]}] is not finite: {given[row].tolist()}")
            return given
        if self.reference == "base" and not trainer.has_adapters:
            raise ValueError("the dpo updater's reference is 'base' (the model with its LoRA adapters disabled), but "
                             "this model has no adapters: add the lora initializer, set args.reference to a "
                             "snapshot's name, or pass ref_logprobs per pair")
        rows = []
        with torch.no_grad():
            for mb in batch.minibatches(trainer.micro_batch_size):
                if self.reference == "base":
                    with trainer.adapters_disabled():
                        out = trainer.forward(mb.contexts, mb.candidates)
                else:
                    out = trainer.forward(mb.contexts, mb.candidates, peft_adapter=self.reference)
                rows.append(pair_logps(out, self.loss == "ipo").cpu())
        return torch.cat(rows) if rows else torch.zeros((0, 2))

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        check_pairs(batch, "dpo")
        references = self._references(batch, trainer)
        position = {index: k for k, index in enumerate(batch.indices)}
        sums = {k: 0.0 for k in ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "logps_chosen",
                                 "logps_rejected")}
        seen = 0
        for _ in range(self.epochs):
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                out = trainer.forward(mb.contexts, mb.candidates, peft_adapter=self.peft_adapter)
                logps = pair_logps(out, self.loss == "ipo")
                ref = references[[position[i] for i in mb.indices]].to(logps.device).view(-1, 2)
                loss, chosen, rejected = preference_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], self.beta,
                                                         self.loss, self.label_smoothing)
                trainer.backward(mb.mean(loss))
                trainer.step()
                seen += len(mb)
                for key, value in (("loss", loss.detach()), ("rewards_chosen", chosen),
                                   ("rewards_rejected", rejected), ("reward_accuracy", (chosen > rejected).float()),
                                   ("logps_chosen", logps[:, 0].detach()), ("logps_rejected", logps[:, 1].detach())):
                    sums[key] += float(value.sum())
        stats = {key: value / max(seen, 1) for key, value in sums.items()}
        stats["reward_margin"] = stats["rewards_chosen"] - stats["rewards_rejected"]
        stats["samples"] = len(batch)
        return stats
