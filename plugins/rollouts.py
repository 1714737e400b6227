"""The inputs of the updaters that train on generated text (``ppo_tokens``, ``grpo``), read and checked per prompt.

A sample of these updaters is one prompt (a context) with the continuations generated for it (its candidates,
best given as the ``tokens`` that ``generate`` returned). Their per-sample keyword arguments hold, per prompt, one
entry per continuation: ``rewards[i]`` a number per continuation (a bare number when there is one), and
``old_logprobs[i]`` / ``ref_logprobs[i]`` one sequence of per-token log-probs per continuation (a bare sequence
when there is one), each as long as the continuation's scored tokens. This module turns them into padded
``[continuations, tokens]`` float32 rows in the order of :class:`~llmrl.plugins.contracts.ForwardOutputs`
(prompts in order, their continuations in order), and refuses wrong shapes with an error naming the argument and
the prompt. It also keeps what a first pass over the batch computed (:class:`PromptRows`).

It computes no loss; the maths is in :mod:`llmrl.plugins.token_ppo` and :mod:`llmrl.plugins.grpo`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


def rewards_of(value, counts: list[int], indices: list[int], name: str = "rewards") -> torch.Tensor:
    """``[sum(counts)]`` float32: one reward per continuation, prompts in order (``counts[i]`` continuations of
    local prompt ``i``, whose position in the call is ``indices[i]``)."""
    rows = []
    for entry, k, where in zip(value, counts, indices):
        numbers = [entry] if _is_number(entry) else _numbers(entry)
        if numbers is None or len(numbers) != k:
            got = "a number" if _is_number(entry) else f"{len(numbers)} numbers" if numbers is not None else repr(entry)
            raise ValueError(f"{name}[{where}] must hold one number per continuation of prompt {where} ({k}), got "
                             f"{got}; pass, per prompt, a list with one reward per continuation (a number when "
                             "there is one)")
        rows += numbers
    out = torch.tensor(rows, dtype=torch.float32)
    _check_finite(out, name, indices)
    return out


def token_rows_of(value, counts: list[int], lengths: torch.Tensor, indices: list[int], name: str) -> torch.Tensor:
    """``[sum(counts), max(lengths)]`` float32 rows (zeros after each row's end) from per-prompt, per-continuation
    sequences of per-token values; ``lengths`` are the continuations' numbers of scored tokens."""
    width = int(lengths.max()) if lengths.numel() else 0
    out = torch.zeros((len(lengths), width), dtype=torch.float32)
    row = 0
    for entry, k, where in zip(value, counts, indices):
        sequences = _sequences(entry, k)
        if sequences is None:
            raise ValueError(f"{name}[{where}] must hold one sequence of per-token values per continuation of prompt "
                             f"{where} ({k}), got {type(entry).__name__}; pass, per prompt, a list with one sequence "
                             "per continuation (e.g. the generate samples' 'logprobs')")
        if len(sequences) != k:
            raise ValueError(f"{name}[{where}] holds {len(sequences)} sequences but prompt {where} has {k} "
                             "continuations; pass one sequence of per-token values per continuation")
        for j, sequence in enumerate(sequences):
            tokens = int(lengths[row])
            if len(sequence) != tokens:
                raise ValueError(f"{name}[{where}][{j}] has {len(sequence)} values but continuation {j} of prompt "
                                 f"{where} has {tokens} scored tokens; pass the continuations as the token ids that "
                                 "generate returned (text is tokenised again and may split differently)")
            out[row, :tokens] = torch.as_tensor(sequence, dtype=torch.float32)
            row += 1
    _check_finite(out, name, indices)
    return out


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` the mean of each row's real tokens (0 for a row without any)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)


def per_prompt_mean(values: torch.Tensor, candidate_context: torch.Tensor, num_contexts: int) -> torch.Tensor:
    """``[num_contexts]`` the mean of each prompt's per-continuation ``values`` (differentiable)."""
    index = candidate_context.to(values.device)
    counts = torch.bincount(index, minlength=num_contexts).to(values.dtype)
    sums = values.new_zeros(num_contexts).index_add(0, index, values)
    if values.numel() == 0:  # still part of the graph: a replica with no sample reaches the same weights
        sums = sums + 0.0 * values.sum()
    return sums / counts.clamp(min=1)


@dataclass
class PromptRows:
    """What a first, gradient-free pass computed for one prompt's continuations: ``[k, T]`` CPU float32 rows."""

    mask: torch.Tensor  # bool
    rewards: torch.Tensor  # [k]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # old_logprobs, ref_logprobs, values, ...


def split_by_prompt(rows: dict[str, torch.Tensor], mask: torch.Tensor, rewards: torch.Tensor,
                    counts: list[int]) -> list[PromptRows]:
    """Cut ``[n_candidates, T]`` rows into one :class:`PromptRows` per prompt (trimmed to its longest row)."""
    out, first = [], 0
    for k in counts:
        m = mask[first:first + k].cpu()
        width = int(m.sum(1).max()) if k else 0
        out.append(PromptRows(m[:, :width], rewards[first:first + k].float().cpu(),
                              {key: t[first:first + k, :width].detach().float().cpu() for key, t in rows.items()}))
        first += k
    return out


def join_prompts(prompts: list[PromptRows], key: str, width: int, device) -> torch.Tensor:
    """``[sum k, width]`` rows of ``key`` (or of ``"mask"`` / ``"rewards"``) for these prompts, zero-padded."""
    parts = []
    for p in prompts:
        t = p.mask if key == "mask" else p.rewards if key == "rewards" else p.tensors[key]
        if t.dim() == 2:
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
        parts.append(t)
    if not parts:
        shape = (0,) if key == "rewards" else (0, width)
        return torch.zeros(shape, dtype=torch.bool if key == "mask" else torch.float32, device=device)
    return torch.cat(parts).to(device)


def _is_number(x) -> bool:
    """A real number (Python, NumPy or a 0-dimensional tensor), not a bool."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _numbers(entry) -> list[float] | None:
    if isinstance(entry, torch.Tensor):
        return entry.flatten().tolist() if entry.dim() == 1 else None
    try:
        items = list(entry)
    except TypeError:
        return None
    return [float(x) for x in items] if all(_is_number(x) for x in items) else None


def _sequences(entry, k: int) -> list | None:
    """The per-continuation sequences of one prompt's entry (a bare sequence counts as the only one when k = 1)."""
    if isinstance(entry, torch.Tensor):
        if entry.dim() == 1 and k == 1:
            return [entry]
        return list(entry) if entry.dim() == 2 else None
    try:
        items = list(entry)
    except TypeError:
        return None
    if k == 1 and all(_is_number(x) for x in items):
        return [items]
    if all(isinstance(x, torch.Tensor) or _numbers(x) is not None for x in items):
        return [x if isinstance(x, torch.Tensor) else _numbers(x) for x in items]
    return None


def _check_finite(t: torch.Tensor, name: str, indices: list[int]) -> None:
    bad = ~torch.isfinite(t)
    if bad.any():
        raise ValueError(f"{name} holds a non-finite value ({t[bad][0].item()}) for one of the prompts "
                         f"{indices[0] if indices else '?'}..{indices[-1] if indices else '?'}; nothing was trained")


def whiten_stats(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of the masked values (float64), to sum across replicas."""
    v = values[mask].double()
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), (v * v).sum()])


def mean_and_std(stats: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased standard deviation from summed ``[count, sum, sum of squares]``."""
    n, s, ss = (float(x) for x in stats)
    if n == 0:
        return 0.0, 1.0
    mean = s / n
    var = (ss - n * mean * mean) / max(n - 1.0, 1.0)
    return mean, math.sqrt(max(var, 0.0))
