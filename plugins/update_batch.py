"""What an updater receives: :class:`UpdateBatch`, one replica's share of an ``update`` call, with the arithmetic
that keeps replicas exact (minibatches of equal count on every replica, means over the whole optimizer step).

This module holds data and arithmetic only; the contracts are in :mod:`llmrl.plugins.contracts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from llmrl.plugins.per_sample import is_per_sample, take_samples


@dataclass
class UpdateBatch:
    """This replica's share of an ``update`` call, or of one of its minibatches.

    How samples are weighted: samples are processed in micro-steps (one ``trainer.backward`` each, usually one
    minibatch); every ``accumulation_steps`` micro-steps, and at the end of each pass over
    :meth:`minibatches` (or of the update), the optimizer takes one step. Within a step every sample weighs the
    same, whatever replica and micro-step it fell in: reduce per-sample losses with :meth:`mean`, whose
    divisor is the number of samples in the step (``step_size``) over all replicas. A step's gradient is then
    exactly the mean of the per-sample gradients of its samples, as in single-process training.

    Attributes:
        contexts / candidates: this replica's samples (``candidates`` may be None): strings, or token ids (lists
            of ints) as the client gave them; pass them on to ``trainer.forward`` as they are.
        kwargs: keyword arguments of the call; per-sample ones (length = number of contexts) are sliced.
        indices: positions of these samples in the whole call.
        global_size: number of samples in this (mini)batch, over all replicas.
        replica / num_replicas: this replica's index and the number of replicas.
        replica_sizes: the number of samples of every replica (equal up to one; a replica may have none).
        accumulation_steps: micro-steps per optimizer step (``training.gradient_accumulation_steps``).
        step_size: samples, over all replicas, in the optimizer step this minibatch belongs to (None: the
            whole batch is one step).
        ends_step: whether that optimizer step ends with this minibatch: taken at its ``trainer.step()``, or, for
            the last minibatch of a pass, once the loop over :meth:`minibatches` has ended.
        per_sample_keys: the keyword arguments sliced with the samples, as the client decided (the updater's
            ``per_sample_args`` declaration, or the length rule); None: the length rule, applied here.
    """

    contexts: list[str | list[int]]  # text, or token ids used as given
    candidates: list[list[str | list[int]]] | None
    kwargs: dict[str, Any]
    indices: list[int]
    global_size: int
    replica: int
    num_replicas: int
    replica_sizes: list[int]
    accumulation_steps: int = 1
    step_size: int | None = None
    end_of_pass: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    per_sample_keys: tuple[str, ...] | None = None
    ends_step: bool = True  # the optimizer step this minibatch belongs to ends with it (at end_of_pass, the last)

    def __len__(self) -> int:
        return len(self.contexts)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of per-sample ``values`` as the optimizer step sees it once DeepSpeed has averaged the
        gradients across replicas: each sample weighs 1 / (samples in the step), exactly, whatever the shares
        (a replica with no sample contributes zero)."""
        total = self.step_size if self.step_size is not None else self.global_size
        if total == 0:
            return values.sum() * 0.0
        return values.sum() * (self.num_replicas / total)

    def token_mean(self, token_sum: torch.Tensor, all_tokens: float) -> torch.Tensor:
        """The mean over this minibatch's tokens of a per-token loss whose sum over this replica's tokens is
        ``token_sum``; ``all_tokens`` counts the tokens of every replica's share of this minibatch (sum it with
        ``trainer.sum_across_replicas``). Each token of the minibatch weighs the same whatever replica it fell in;
        with gradient accumulation, each minibatch then weighs by its share of the step's samples. For every token
        of the optimizer step to weigh the same, divide by :meth:`step_totals` instead (the built-in updaters do)."""
        step = self.step_size if self.step_size is not None else self.global_size
        return token_sum * (self.num_replicas / max(all_tokens, 1.0)) * (self.global_size / max(step, 1))

    def step_totals(self, size: int, counts: dict[int, float], sum_across_replicas: Callable,
                    generator: torch.Generator | None = None) -> list[float]:
        """For each minibatch that ``minibatches(size, shuffle=generator is not None, generator=generator)`` will
        yield next, the sum of ``counts`` (a number per sample, by the sample's index in the call, such as its
        tokens) over every sample of every replica in the optimizer step that minibatch belongs to: the divisor
        that makes each token of a step weigh the same whatever micro-step and replica it fell in. The generator
        is left as it was, so the minibatches drawn next are the ones counted. Every replica must call it (one
        ``sum_across_replicas``)."""
        state = None if generator is None else generator.get_state()
        plan = replace(self, end_of_pass=None).minibatches(size, shuffle=generator is not None, generator=generator)
        local = [sum(float(counts[i]) for i in mb.indices) for mb in plan]
        if generator is not None:
            generator.set_state(state)
        totals = [float(v) for v in sum_across_replicas(local)]
        group = max(1, self.accumulation_steps)
        return [sum(totals[k - k % group: k - k % group + group]) for k in range(len(totals))]

    def select(self, positions: list[int], sizes: list[int], step_size: int | None = None) -> UpdateBatch:
        """A sub-batch of the samples at local ``positions``; ``sizes`` are every replica's sub-batch sizes."""
        kwargs = {}
        for key, value in self.kwargs.items():
            declared = self.per_sample_keys is not None
            sliced = key in self.per_sample_keys if declared else is_per_sample(value, len(self))
            kwargs[key] = take_samples(value, positions) if sliced else value
        return replace(
            self,
            contexts=[self.contexts[p] for p in positions],
            candidates=None if self.candidates is None else [self.candidates[p] for p in positions],
            kwargs=kwargs,
            indices=[self.indices[p] for p in positions],
            global_size=sum(sizes),
            replica_sizes=list(sizes),
            step_size=step_size,
        )

    def minibatches(self, size: int, shuffle: bool = False, generator: torch.Generator | None = None
                    ) -> Iterator[UpdateBatch]:
        """Split into minibatches of at most ``size`` samples per replica.

        Every replica yields the same number of minibatches (the last ones may be empty on replicas
        with fewer samples), so collective steps stay aligned. Consecutive groups of ``accumulation_steps``
        minibatches form one optimizer step each (the last group may be shorter); when the pass ends, a step
        that is still open is taken, so no gradient is carried into the next pass or the next update.
        """
        count = max(1, math.ceil(max(self.replica_sizes) / size)) if self.replica_sizes else 1
        order = list(range(len(self)))
        if shuffle:
            order = torch.randperm(len(self), generator=generator).tolist()
        per_replica = [[min(size, max(0, n - k * size)) for k in range(count)] for n in self.replica_sizes]
        totals = [sum(sizes[k] for sizes in per_replica) for k in range(count)]
        group = max(1, self.accumulation_steps)
        for k in range(count):
            first = k - k % group
            step_size = sum(totals[first:first + group])
            positions = order[k * size: k * size + per_replica[self.replica][k]]
            ends = k % group == group - 1 or k == count - 1
            yield replace(self.select(positions, [sizes[k] for sizes in per_replica], step_size), ends_step=ends)
        if self.end_of_pass is not None:
            self.end_of_pass()


def sample_token_counts(batch: UpdateBatch, trainer, add_eos: bool = False) -> dict[int, float]:
    """Each local sample's scored tokens (over its candidates), by its index in the call, from the tokenisation
    alone (:meth:`Trainer.scored_token_counts`): what :meth:`UpdateBatch.step_totals` sums."""
    counts = trainer.scored_token_counts(batch.contexts, batch.candidates, add_eos=add_eos).tolist()
    out, first = {}, 0
    for index, candidates in zip(batch.indices, batch.candidates):
        out[index] = float(sum(counts[first:first + len(candidates)]))
        first += len(candidates)
    return out


def check_token_count(mb: UpdateBatch, tokens_of: dict[int, float], scored: torch.Tensor, updater: str) -> None:
    """Refuse to divide by a step's token count that the pass did not see: the tokens ``scored`` (a ``[rows, T]``
    mask, or a flat ``[tokens]`` tensor with one entry per token) must be those counted for the minibatch's
    samples."""
    seen = float(scored.sum()) if scored.dim() == 2 else float(scored.numel())
    counted = sum(tokens_of[i] for i in mb.indices)
    if seen != counted:
        raise RuntimeError(f"{updater}: the forward pass scored {seen:g} tokens where the tokenisation counted "
                           f"{counted:g} for samples {mb.indices}; the token-weighted loss would be wrong")
