"""The inputs of the updaters that train on generated text (``ppo_tokens``, ``grpo``), read and checked per prompt.

A sample of these updaters is one prompt (a context) with the continuations generated for it (its candidates,
best given as the ``tokens`` that ``generate`` returned). Their per-sample keyword arguments hold, per prompt, one
entry per continuation: ``rewards[i]`` a number per continuation (a bare number when there is one; for
``ppo_tokens``, a continuation's reward may instead be a list of dense rewards, one per generated token), and
``old_logprobs[i]`` / ``ref_logprobs[i]`` one sequence of per-token log-probs per continuation (a bare sequence
when there is one), each as long as the continuation's scored tokens. This module turns them into padded
``[continuations, tokens]`` float32 rows in the order of :class:`~llmrl.plugins.contracts.ForwardOutputs`
(prompts in order, their continuations in order), and refuses wrong shapes with an error naming the argument and
the prompt. Before any pass, :func:`check_inputs` refuses a call these updaters cannot train on; :func:`first_pass`
runs the gradient-free pass over the batch (old log-probs, values, reference log-probs; the sampler's
``behaviour_logprobs`` laid out when given) and keeps what it computed
per prompt (:class:`PromptRows`), which the training passes read back in minibatch order (:func:`join_prompts`).

It computes no loss and no advantage: the maths is in :mod:`llmrl.plugins.rl_math`, the algorithms in
:mod:`llmrl.plugins.ppo_tokens` and :mod:`llmrl.plugins.grpo`, their training passes in
:mod:`llmrl.plugins.token_policy`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from llmrl.plugins.contracts import Trainer, UpdateBatch


def rewards_of(value, counts: list[int], indices: list[int], name: str = "rewards", dense: bool = False
               ) -> torch.Tensor:
    """``[sum(counts)]`` float32: one reward per continuation, prompts in order (``counts[i]`` continuations of
    local prompt ``i``, whose position in the call is ``indices[i]``). With ``dense``, a continuation's reward may
    also be a sequence of per-token rewards, counted here by its sum (:func:`reward_rows_of` checks its length)."""
    rows = []
    for entry, k, where in zip(value, counts, indices):
        items = _reward_items(entry, k, dense)
        if items is None or len(items) != k:
            got = ("a number" if _is_number(entry) else f"{len(items)} numbers" if items is not None
                   else repr(entry))
            what = "entry" if dense else "number"
            each = "a number or a list with one number per generated token" if dense else "one reward"
            raise ValueError(f"{name}[{where}] must hold one {what} per continuation of prompt {where} ({k}), got "
                             f"{got}; pass, per prompt, a list with {each} per continuation (a number when there "
                             "is one)")
        rows += [float(sum(item)) if isinstance(item, list) else float(item) for item in items]
    out = torch.tensor(rows, dtype=torch.float32)
    _check_finite(out, name, indices)
    return out


def reward_rows_of(value, counts: list[int], lengths: torch.Tensor, indices: list[int], name: str = "rewards"
                   ) -> torch.Tensor:
    """``[sum(counts), max(lengths)]`` float32 per-token task rewards: a continuation's number on its last scored
    token, or its dense rewards (one per scored token) in place; zeros elsewhere. ``lengths`` are the
    continuations' numbers of scored tokens. A dense sequence of another length is refused naming
    ``name[prompt][continuation]``, the expected and the given lengths."""
    width = int(lengths.max()) if lengths.numel() else 0
    out = torch.zeros((len(lengths), width), dtype=torch.float32)
    row = 0
    for entry, k, where in zip(value, counts, indices):
        items = _reward_items(entry, k, dense=True)
        if items is None or len(items) != k:
            raise ValueError(f"{name}[{where}] must hold one entry per continuation of prompt {where} ({k})")
        for j, item in enumerate(items):
            tokens = int(lengths[row])
            if not isinstance(item, list):
                if tokens:
                    out[row, tokens - 1] = float(item)
            elif len(item) != tokens:
                raise ValueError(f"{name}[{where}][{j}] holds {len(item)} dense rewards but continuation {j} of prompt "
                                 f"{where} has {tokens} generated tokens: pass one number per generated token (or "
                                 "one number, counted on the last token); give the continuations as the token ids "
                                 "that generate returned (text is tokenised again and may split differently)")
            else:
                out[row, :tokens] = torch.tensor(item, dtype=torch.float32)
            row += 1
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
            if name.endswith("logprobs") and tokens and float(out[row, :tokens].max()) > 1e-4:
                t = int(out[row, :tokens].argmax())
                raise ValueError(f"{name}[{where}][{j}][{t}] is {float(out[row, t])}, above 0: a log-probability "
                                 "is at most 0; pass each token's log-prob (generate's 'logprobs'), not a "
                                 "probability or a negated value; nothing was trained")
            row += 1
    _check_finite(out, name, indices)
    return out


@dataclass
class PromptRows:
    """What a first, gradient-free pass computed for one prompt's continuations: ``[k, T]`` CPU float32 rows."""

    mask: torch.Tensor  # bool
    rewards: torch.Tensor  # [k]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # old_logprobs, ref_logprobs, values, ...
    spans: list = field(default_factory=list)  # multi-turn updaters: per continuation, its turns' (start, end)
    index: int = -1  # multi-turn updaters: the prompt's position in the call
    bootstrap: list = field(default_factory=list)  # ppo_turns: per continuation, whether it is truncated


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


def check_inputs(batch: UpdateBatch, trainer: Trainer, name: str, need_reference: bool, dense: bool = False
                 ) -> list[torch.Tensor]:
    """Refuse, before any pass, a call these updaters cannot train on (the message names what to pass); returns
    each local prompt's rewards, one per continuation (with ``dense``, a dense reward counts by its sum)."""
    if batch.candidates is None:
        raise ValueError(f"the {name} updater needs the continuations: caller.update(prompts, continuations, "
                         "rewards=...), continuations[i] a list of the token ids (or texts) generated for prompt i")
    if "rewards" not in batch.kwargs:
        raise ValueError(f"the {name} updater needs the per-sample keyword argument 'rewards' in caller.update(...): "
                         "per prompt, one reward per continuation")
    if need_reference and "ref_logprobs" not in batch.kwargs and not trainer.has_adapters:
        raise ValueError(f"the {name} updater's KL term needs a reference policy: add LoRA adapters (the lora "
                         "initializer; the reference is then the model with them disabled), pass ref_logprobs in "
                         "caller.update(...), or set kl_coef to 0")
    counts = [len(c) for c in batch.candidates]
    return list(rewards_of(batch.kwargs["rewards"], counts, batch.indices, dense=dense).split(counts))


def first_pass(batch: UpdateBatch, trainer: Trainer, rewards: list[torch.Tensor], adapter: str | None,
               value_head: str | None, need_reference: bool, reward_rows: bool = False, policy_pass=None
               ) -> list[PromptRows]:
    """A gradient-free pass over this replica's prompts (``rewards``: each one's, from :func:`check_inputs`): old
    log-probs (unless given), values (with a value head) and reference log-probs (unless given, when
    ``need_reference``), one :class:`PromptRows` per prompt in order. The policy's forward is skipped when it
    would give nothing (old log-probs given, no value head). When no pass is needed at all, the scored tokens are
    counted from the tokenisation (:meth:`Trainer.scored_token_counts`: no model call). With ``reward_rows``, each
    prompt's ``tensors["task_rewards"]`` holds its per-token task rewards (:func:`reward_rows_of`: numbers on the
    last token, dense rewards in place). Whether a pass runs depends only on the call's keyword names and the
    config, never on one replica's share, so every replica makes the same passes. ``policy_pass(trainer,
    minibatch, heads)``, when given, runs the policy's pass and returns its outputs, ``[n, T]`` log-probs and mask
    (``nlpo``: the masked policy's log-probs), and ``[n, T]`` log-probs for the KL penalty, or None for the same
    (``nlpo``: the unmasked ones), kept as ``tensors["kl_logprobs"]``."""
    prompts: list[PromptRows] = []
    heads = [value_head] if value_head else []
    given_old, given_ref = "old_logprobs" in batch.kwargs, "ref_logprobs" in batch.kwargs
    run_reference = need_reference and not given_ref
    run_policy = bool(value_head) or not given_old  # the same on every replica
    position = {index: k for k, index in enumerate(batch.indices)}
    for mb in batch.minibatches(trainer.micro_batch_size):
        rows, out = {}, None
        with torch.no_grad():
            if run_policy and policy_pass is not None:
                out, logp, mask, kl_logp = policy_pass(trainer, mb, heads)
                rows["old_logprobs"] = logp.float().cpu()
                if kl_logp is not None:
                    rows["kl_logprobs"] = kl_logp.float().cpu()
            elif run_policy:  # with the old log-probs given, only the value head is read: no log-prob computed
                out = trainer.forward(mb.contexts, mb.candidates, heads=heads, peft_adapter=adapter, per_token=True,
                                      logprobs=not given_old)
                logp, mask = out.tokens_by_candidate()
                if not given_old:  # (given ones are laid out below)
                    rows["old_logprobs"] = logp.float().cpu()
            if run_reference:
                with trainer.adapters_disabled():
                    ref = trainer.forward(mb.contexts, mb.candidates, per_token=True)
                logp, mask = ref.tokens_by_candidate()
                rows["ref_logprobs"] = logp.float().cpu()
                if not run_policy:
                    out = ref  # counts the tokens
        if out is None:  # no pass needed: the scored tokens are counted from the tokenisation alone
            lengths = trainer.scored_token_counts(mb.contexts, mb.candidates)
            counts = [len(c) for c in mb.candidates]
            mask = torch.arange(int(lengths.max()) if len(lengths) else 0)[None] < lengths[:, None]
        else:
            counts = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts).tolist()
            lengths = mask.sum(1).cpu()
        if given_old:
            rows["old_logprobs"] = token_rows_of(mb.kwargs["old_logprobs"], counts, lengths, mb.indices,
                                                 "old_logprobs")
        if given_ref:
            rows["ref_logprobs"] = token_rows_of(mb.kwargs["ref_logprobs"], counts, lengths, mb.indices,
                                                 "ref_logprobs")
        if "behaviour_logprobs" in mb.kwargs:  # the sampler's, for the off-policy correction
            rows["behaviour_logprobs"] = token_rows_of(mb.kwargs["behaviour_logprobs"], counts, lengths, mb.indices,
                                                       "behaviour_logprobs")
        if reward_rows:
            rows["task_rewards"] = reward_rows_of(mb.kwargs["rewards"], counts, lengths, mb.indices)
        if value_head:
            if out.head_levels[value_head] != "token":
                raise ValueError(f"value_head {value_head!r} is a {out.head_levels[value_head]}-level head; token-"
                                 "level PPO needs one value per token: use the token_value head (heads: {value: "
                                 "token_value}) or set value_head to null")
            rows["values"] = out.tokens_by_candidate(out.heads[value_head].float())[0].cpu()
        mb_rewards = [rewards[position[i]] for i in mb.indices]
        prompts += split_by_prompt(rows, mask, torch.cat(mb_rewards) if mb_rewards else torch.zeros(0), counts)
    return prompts


def _is_number(x) -> bool:
    """A real number (Python, NumPy or a 0-dimensional tensor), not a bool."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _reward_items(entry, k: int, dense: bool) -> list | None:
    """One prompt's rewards, one item per continuation: a float, or (``dense``) a list of floats; None when the
    entry is not of that shape (a bare number counts as the only continuation's)."""
    if _is_number(entry):
        return [float(entry)]
    if not dense:
        return _numbers(entry)
    if isinstance(entry, torch.Tensor):
        return entry.tolist() if entry.dim() == 1 else [row.tolist() for row in entry] if entry.dim() == 2 else None
    try:
        items = list(entry)
    except TypeError:
        return None
    out = []
    for item in items:
        if _is_number(item):
            out.append(float(item))
        else:
            numbers = _numbers(item)
            if numbers is None:
                return None
            out.append(numbers)
    return out


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
