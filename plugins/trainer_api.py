"""What an updater trains through: the :class:`Trainer` contract (implemented by the engine in
:mod:`llmrl.engine.model.training.trainer`; documented here for plugin authors).

It holds no implementation.
"""

from __future__ import annotations

from typing import Any

import torch


class Trainer:
    """What an updater uses to train (implemented by the engine; documented here for plugin authors).

    Attributes:
        llm: the LLM's description.
        engine: the DeepSpeed engine (for advanced use).
        micro_batch_size / gradient_accumulation_steps: from ``llms.<name>.training``.
    """

    llm: Any  # the LLM's LLMInfo (llmrl.plugins.contracts; not imported here: contracts imports this module)
    engine: Any
    micro_batch_size: int
    gradient_accumulation_steps: int

    def forward(self, contexts: list, candidates: list[list] | None = None, heads=(),
                peft_adapter: str | None = None, *, per_token: bool = False, entropy: bool = False,
                add_eos: bool = False, head_kwargs: dict | None = None, logits: bool = False,
                logprobs: bool = True) -> Any:
        """Score the candidates and run the named heads, with gradients (wrap in ``torch.no_grad()`` for none).

        Args:
            contexts: strings, or lists of token ids used exactly as given (as in ``Caller.score``).
            candidates: per context, strings or lists of token ids (ids when the context is ids), or None.
            heads: the head keys to run in the same pass.
            peft_adapter: the LoRA adapter to use (None: the active one).
            per_token: also keep every scored token's log-prob apart (``token_logprobs``, ``token_candidate``,
                ``token_ids``), for token-level losses: a per-token PPO ratio
                ``exp(out.token_logprobs - old_token_logprobs)``, a per-token KL to the base model (a second
                forward inside ``trainer.adapters_disabled()``), GRPO's per-token objective. Costs nothing
                when False.
            entropy: also compute ``token_entropy`` (needs ``per_token``), for an entropy bonus.
            add_eos: candidates end with the EOS token (as ``Caller.score(..., add_eos=True)``).
            head_kwargs: keyword arguments for the heads' ``forward`` (see :class:`Head`), passed as given.
            logits: also keep ``token_logits`` (``[n_tokens, vocab]`` float32, the logits at the positions predicting
                the scored tokens; implies ``per_token``), for losses over the whole distribution (``nlpo``'s
                masked policy). Costs ``n_tokens x vocab`` floats.
            logprobs: False computes no log-prob (NaN where they would be; with neither ``entropy`` nor
                ``logits``), for a pass read only for its heads and token counts: where the model allows, its output
                layer does not run over the vocabulary (``ppo_tokens``' first pass when the client gave the old
                log-probs: only the value head is read).

        Returns:
            The pass's :class:`ForwardOutputs`; per-token tensors in candidate order, with gradients.
        """
        raise NotImplementedError

    def scored_token_counts(self, contexts: list, candidates: list[list], add_eos: bool = False) -> torch.Tensor:
        """Each candidate's number of scored tokens (long, CPU, in candidate order), as
        ``forward(contexts, candidates, per_token=True, add_eos=add_eos)`` counts them, from the tokenisation
        alone: no model call. For per-token inputs the client gives (old log-probs) when no pass is otherwise
        needed. Every replica may call it or not independently (it is no collective)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-step's ``loss`` (a scalar; reduce per-sample losses with ``batch.mean``, which
        weights every sample of the optimizer step equally)."""
        raise NotImplementedError

    def step(self) -> None:
        """End one micro-step. Every ``gradient_accumulation_steps`` micro-steps, at the end of each pass over
        ``batch.minibatches()`` and at the end of the update, the optimizer steps (and clips)."""
        raise NotImplementedError

    def adapters_disabled(self):
        """Context manager: forward passes inside use the base model without LoRA adapters."""
        raise NotImplementedError

    @property
    def has_adapters(self) -> bool:
        """Whether the model has LoRA adapters (then ``adapters_disabled()`` gives the frozen base model)."""
        raise NotImplementedError

    @property
    def heads(self) -> dict[str, torch.nn.Module]:
        """The LLM's head modules by key, for what an optimizer step does not do (``ilql``'s Polyak update of its
        target Q heads, under ``torch.no_grad()``). Refused under ZeRO-3 (its parameters are partitioned)."""
        raise NotImplementedError

    def snapshot(self, name: str, source: str | None = None) -> None:
        """Freeze a copy of adapter ``source`` (default: the active one; without LoRA, of the trained weights) under
        ``name``, as ``caller.snapshot(name)`` does; ``forward(..., peft_adapter=name)`` then reads it (``nlpo``'s
        masking policy). Every replica calls it alike. ZeRO 0-2 only."""
        raise NotImplementedError

    def has_snapshot(self, name: str) -> bool:
        """Whether a snapshot ``name`` exists (taken by the client, an earlier update or a checkpoint)."""
        raise NotImplementedError

    def sum_across_replicas(self, values) -> torch.Tensor:
        """The sum of ``values`` (a number, list or tensor; the same shape on every replica) over all replicas of the
        LLM, as a float64 CPU tensor, identical on every replica: for statistics of the whole batch (the mean and
        variance used to whiten advantages, the mean KL that adapts a KL coefficient). Every replica must call it
        the same number of times, like ``backward``."""
        raise NotImplementedError
