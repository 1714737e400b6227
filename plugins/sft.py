"""The built-in ``sft`` updater: supervised fine-tuning on (prompt, target) pairs, the loss on the targets' tokens
only: a warm start before RL, as RL4LMs' supervised trainer gives one.

A sample is one prompt with its target continuation(s): ``caller.update(prompts, [[target], ...])`` (several
targets per prompt are allowed; a bare string is one target). The prompt's tokens carry no loss. Each target
token's loss is its negative log-likelihood. ``loss: "token"`` (the default, as Hugging Face's Trainer and TRL's
SFTTrainer average) weighs every target token of an optimizer step the same, whatever micro-step and replica it fell
in (micro-batch 2 x accumulation 4 trains as micro-batch 8 x 1); ``"sequence"`` averages each target's tokens first,
then the targets of a prompt, then the prompts. With ``add_eos`` (default true) each target
ends with the EOS token, so the model also learns where to stop.

Statistics per replica: ``loss`` (mean negative log-likelihood per target token), ``tokens`` (target tokens),
``samples``. This module is the algorithm; the means are in :mod:`llmrl.plugins.rl_math`.
"""

from __future__ import annotations

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import aggregate
from llmrl.plugins.update_batch import check_token_count, sample_token_counts
from llmrl.plugins.updater_args import describe, updater_schema


class SFTUpdater(ShufflingUpdater):
    """Args (config ``args``):
        loss: "token" or "sequence" normalisation (default "token").
        add_eos: end every target with the EOS token (default true).
        epochs: passes over the batch per update (default 1).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    args_schema = updater_schema("epochs", "peft_adapter", "seed", loss={"enum": ["token", "sequence"]},
                                 add_eos={"type": "boolean"})
    describe(args_schema,
             loss="\"token\" or \"sequence\" normalisation",
             add_eos="end every target with the EOS token")
    per_sample_args: dict = {}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused

    def __init__(self, loss: str = "token", add_eos: bool = True, epochs: int = 1, peft_adapter: str | None = None,
                 seed: int = 0):
        self.loss, self.add_eos, self.epochs, self.peft_adapter = loss, add_eos, epochs, peft_adapter
        super().__init__(seed)

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        if batch.candidates is None or any(len(c) == 0 for c in batch.candidates):
            raise ValueError("the sft updater trains on targets: caller.update(prompts, [[target], ...]), at least "
                             "one target per prompt")
        nll_sum, tokens = 0.0, 0
        tokens_of = sample_token_counts(batch, trainer, self.add_eos) if self.loss == "token" else {}
        for _ in range(self.epochs):
            step_tokens = iter(batch.step_totals(trainer.micro_batch_size, tokens_of, trainer.sum_across_replicas,
                                                 self.generator) if self.loss == "token" else ())
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                out = trainer.forward(mb.contexts, mb.candidates, peft_adapter=self.peft_adapter, per_token=True,
                                      add_eos=self.add_eos)
                nll, mask = out.tokens_by_candidate()
                nll = -nll.float()
                if self.loss == "sequence":
                    loss = mb.mean(aggregate(nll, mask, "sequence", out.candidate_context, out.num_contexts))
                else:  # every token of the optimizer step weighs the same, whatever micro-step and replica
                    check_token_count(mb, tokens_of, mask, "sft")
                    loss = aggregate(nll, mask, "batch_token", out.candidate_context, out.num_contexts,
                                     step_tokens=next(step_tokens), num_replicas=mb.num_replicas)
                trainer.backward(loss)
                trainer.step()
                nll_sum += float((nll.detach() * mask).sum())
                tokens += int(mask.sum())
        return {"loss": nll_sum / max(tokens, 1), "tokens": tokens // max(self.epochs, 1), "samples": len(batch)}
