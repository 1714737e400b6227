"""Batched text generation that also returns each generated token's log-prob under the raw model.

Runs left-padded batches formed by a token budget in llmrl's own decoding loop (:mod:`llmrl.engine.model.decoding`)
wherever its :class:`~llmrl.engine.model.decoding.runtime.Decoder` takes the request (the default,
``generation.decoder: auto``: greedy decoding and sampling of causal models), else in Hugging Face's ``generate``
(beam search and the other modes, seq2seq models, ``decoder: hf``). Log-probs come from the raw logits, before any
temperature, top-k or top-p processing, so they agree with ``score`` on the same continuation. A sequence ends at
its first EOS: the EOS is kept (it was generated, its log-prob counts) and nothing after it is returned or counted.
A prompt given as token ids is used exactly as given (no BOS added, no re-tokenisation); a string prompt is
tokenised with special tokens, as ``score`` tokenises contexts, so a sample's ``tokens``, scored as candidate ids of
the same prompt, give its ``logprobs`` back.

In Hugging Face's ``generate``, greedy decoding and sampling read each chosen token's log-prob as the tokens are
produced (:class:`ChosenLogprobs`): only the current step's raw logits are held (rows x vocabulary), never rows x
steps x vocabulary. They also read its log-prob under the distribution it was drawn from (``sampling_logprobs``: the
step's scores after every logits processor, temperature, top-k and top-p included), freeing those scores at once.
``stop`` strings and token ids end a sequence at the token that completes them (:mod:`llmrl.engine.model.stops`);
every sample says why it ended (``stop_reason``). ``prompt_logprobs`` runs one more forward pass per prompt. With
beam search (``num_beams > 1``) and the other decoding modes, Hugging Face's ``output_logits`` are kept and each
token's log-prob is read from the beam that produced it (``beam_indices``); each returned sequence also carries
Hugging Face's length-normalised beam score (``sequences_scores``) as ``beam_score``.

This module does not route requests; it runs on one server rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from llmrl.engine.model.attention_span import keeps_state_outside_attention
from llmrl.engine.model.decoding.batches import Batch, split_prompt_rows
from llmrl.engine.model.decoding.eligibility import config_fields
from llmrl.engine.model.decoding.options import DecodeOptions
from llmrl.engine.model.reuse.generation_prefix import cached_past, keep_generated
from llmrl.engine.model.reuse.hf_kv import cache_kwarg, cache_of
from llmrl.engine.model.row_adapters import RowAdapters
from llmrl.engine.model.scoring.planning import group_greedily
from llmrl.engine.model.scoring.tokenization import encode_inputs
from llmrl.engine.model.stops import StopRecorder, parse_stop, which_stop

RESERVED_KWARGS = ("input_ids", "attention_mask", "return_dict_in_generate", "output_logits", "output_scores",
                   "synced_gpus", "inputs", "decoder_input_ids", "tokenizer")


def check_generate_kwargs(kwargs: dict) -> None:
    bad = [k for k in kwargs if k in RESERVED_KWARGS]
    if bad:
        raise ValueError(f"generate argument(s) {bad} are set by llmrl itself; remove them")


def _eos_ids(model, tokenizer, kwargs) -> set[int]:
    eos = kwargs.get("eos_token_id", getattr(model.generation_config, "eos_token_id", None))
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def plan_generation(lengths: list[int], new_tokens: int, num_return: int, token_budget: int, max_rows: int,
                    independent_rows: bool = True) -> list[Batch]:
    """Group prompt indices so that rows x (prompt + new tokens) stays within the budget and rows within
    ``max_rows``; a prompt whose own rows exceed them is cut into runs of its rows (each its own batch), where its
    rows are ``independent_rows`` (samples; not beam search, whose returned rows are the best of one search)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups = [[order[k] for k in group] for group in
              group_greedily([lengths[i] for i in order], token_budget, max_rows, rows_each=num_return,
                             extra_width=new_tokens)]
    if not independent_rows:
        return [(group, num_return) for group in groups]
    return split_prompt_rows(groups, num_return,
                             lambda i: min(max_rows, token_budget // (max(lengths[i], 1) + new_tokens)))


@dataclass
class GenerationPlan:
    """A checked generation request: its prompts' token ids, their batches and the generate arguments."""

    prompts: list[list[int]]
    batches: list[Batch]  # prompt indices, and the samples each returns in the batch
    kwargs: dict
    num_return: int
    stop: tuple[list[str], list[list[int]]] = ([], [])  # strings, token-id sequences (engine/model/stops.py)
    prompt_logprobs: bool = False
    token_budget: int = 8192  # the bounds the batches were planned within (llmrl's loop plans its own from them)
    max_rows: int = 64
    # the adapter of each prompt, where the prompts read different LoRA adapters in one pass (None: one adapter)
    row_adapters: RowAdapters | None = None


def plan_generate(model, tokenizer, kind: str, contexts: list, kwargs: dict, token_budget: int, max_rows: int,
                  max_length: int | None, vocab_size: int | None = None) -> GenerationPlan:
    """Tokenise and batch a request (contexts are strings or token id lists); raises ValueError on bad input
    (reserved arguments, inputs too long, ids outside ``[0, vocab_size)``) before anything runs."""
    check_generate_kwargs(kwargs)
    kwargs = dict(kwargs)
    stop = parse_stop(kwargs.pop("stop", None))
    if kwargs.get("stop_strings") is not None:  # Hugging Face's own argument: the same strings, the same matching
        strings = kwargs.pop("stop_strings")
        stop = (stop[0] + ([strings] if isinstance(strings, str) else list(strings)), stop[1])
    outside = [t for sequence in stop[1] for t in sequence if vocab_size is not None and t >= vocab_size]
    if outside:  # the model never samples it: the stop would never match
        raise ValueError(f"stop token id {outside[0]} is outside the model's vocabulary [0, {vocab_size})")
    prompt_logprobs = bool(kwargs.pop("prompt_logprobs", False))
    if prompt_logprobs and kind != "causal":
        raise ValueError("prompt_logprobs reads a causal model's next-token log-probs; this model is seq2seq")
    if (stop[0] or stop[1]) and not _reads_logprobs_stepwise(model, kwargs):
        raise ValueError("stop applies to greedy decoding and sampling (num_beams 1), not to beam search")
    num_return = int(kwargs.get("num_return_sequences", 1))
    new_tokens = int(kwargs.get("max_new_tokens", getattr(model.generation_config, "max_new_tokens", None) or 20))
    kwargs.setdefault("max_new_tokens", new_tokens)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    if kwargs.get("eos_token_id", model.generation_config.eos_token_id) is None and tokenizer.eos_token_id is not None:
        kwargs["eos_token_id"] = tokenizer.eos_token_id  # samples end there: min_new_tokens must hold it back too
    beams = int(kwargs.get("num_beams", getattr(model.generation_config, "num_beams", None) or 1))
    if beams > 1:
        kwargs["output_scores"] = True  # Hugging Face returns sequences_scores (the beam score) only with it
    prompts = encode_inputs(tokenizer, contexts, vocab_size)
    for i, ids in enumerate(prompts):
        if max_length is not None and kind == "causal" and len(ids) + new_tokens > max_length:
            raise ValueError(f"context {i} ({len(ids)} tokens) plus max_new_tokens={new_tokens} exceeds the model's "
                             f"maximum length {max_length}")
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"context {i} is {len(ids)} tokens long; the model accepts at most {max_length}")
    batches = plan_generation([len(p) for p in prompts], new_tokens, num_return, token_budget, max_rows,
                              independent_rows=beams == 1)  # two runs of one beam search would return the same beams
    return GenerationPlan(prompts, batches, kwargs, num_return, stop, prompt_logprobs, token_budget, max_rows)


def generate(model, tokenizer, kind: str, plan: GenerationPlan, device, lockstep: int | None = None,
             seed: int | None = None, prefix_cache=None, decoder=None, whole_weights: bool = False,
             between_batches: Callable[[list[list[dict]]], None] | None = None) -> list[list[dict]]:
    """Per prompt, ``num_return_sequences`` dicts with ``text``, ``tokens`` and ``logprobs``.

    ``lockstep`` (None: the ranks of the LLM decode independently) is the number of throw-away generate calls to
    run after the real ones, when every rank of a ZeRO-3 group must call generate the same number of times.
    ``prefix_cache`` (a :class:`~llmrl.engine.model.reuse.prefix_cache.CacheUse`) is the cache across calls: causal
    greedy decoding and
    sampling read held prompt prefixes from it and hold what they encoded and generated
    (:mod:`llmrl.engine.model.reuse.generation_prefix`); not under lockstep. ``decoder`` (a
    :class:`~llmrl.engine.model.decoding.runtime.Decoder`) runs the batches in llmrl's own loop where it takes the
    request; otherwise Hugging Face's ``generate`` runs them. ``whole_weights``: ZeRO-3's weights are gathered for
    the call (:func:`~llmrl.engine.model.zero3_gather.gathered_weights`), so the model runs as a plain module: no
    layer gathers anything, replicas need no lockstep (nor throw-away batches), and llmrl's loop takes the request.
    ``between_batches(results)`` is called before each batch but the first, with the samples drawn so far: it may
    write new weights in place (an in-flight weight sync), which the batches after it read. Not with prompt
    log-probs (computed after the batches) nor under lockstep (refused). ``plan.row_adapters``: each prompt reads
    its own LoRA adapter, in batches that mix them (the caller hooks them into the model:
    :meth:`~llmrl.engine.model.row_adapters.RowAdapters.hooked`); no cache across calls then.
    """
    synced, extra_batches = lockstep is not None, lockstep or 0
    if between_batches is not None and (synced or plan.prompt_logprobs):
        raise ValueError("weights written between batches need a call without prompt log-probs, outside lockstep")
    rows = plan.row_adapters
    use = prefix_cache if prefix_cache is not None and kind == "causal" and not synced and rows is None else None
    if whole_weights:
        synced, extra_batches = False, 0
    kwargs = plan.kwargs
    eos = _eos_ids(model, tokenizer, kwargs)
    stepwise = _reads_logprobs_stepwise(model, kwargs)
    loop = decoder if decoder is not None and decoder.choose_and_count(
        kind, kwargs, stepwise=stepwise, synced=synced, zero3=_partitioned(model) and not whole_weights,
        recurrent=keeps_state_outside_attention(model.config),
        configured=config_fields(model.generation_config)) else None
    results: list[list[dict]] = [[] for _ in plan.prompts]
    if seed is not None:
        torch.manual_seed(seed)
    batches = loop.batches(model, plan, plan.token_budget, plan.max_rows) if loop is not None else plan.batches
    if loop is not None:
        loop.new_call()
    try:
        for number, (batch, rows_each) in enumerate(batches):  # (a prompt cut into runs of its rows gets its
            # samples run after run)
            if number and between_batches is not None:
                between_batches(results)
            if rows is not None:
                rows.use_batch(batch)
            _generate_batch(model, tokenizer, kind, [plan.prompts[i] for i in batch], kwargs, device, synced, eos,
                            rows_each, [results[i] for i in batch], plan, use, loop)
    finally:
        if loop is not None:
            loop.end_call()
    dummy = [[tokenizer.pad_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id]]
    for _ in range(extra_batches):
        if rows is not None:
            rows.use_batch(None)
        _generate_batch(model, tokenizer, kind, dummy, {**kwargs, "num_return_sequences": 1}, device, synced, eos, 1,
                        [[]], plan)
    if plan.prompt_logprobs:
        # one prompt per model call (its logits are width x vocabulary), except under lockstep, where every rank
        # of a ZeRO-3 group makes the same calls: the planned batches, then the throw-away ones
        groups = [*(b for b, _ in plan.batches), *[None] * extra_batches] if synced else \
            [[i] for i in dict.fromkeys(i for b, _ in plan.batches for i in b)]  # each prompt once
        for batch in groups:
            if rows is not None:
                rows.use_batch(batch)
            prompts = dummy if batch is None else [plan.prompts[i] for i in batch]
            for k, logprobs in enumerate(prompt_token_logprobs(model, prompts, tokenizer.pad_token_id, device)):
                for sample in ([] if batch is None else results[batch[k]]):
                    sample["prompt_logprobs"] = logprobs
    return results


def prompt_token_logprobs(model, prompts: list[list[int]], pad_id: int, device) -> list[torch.Tensor]:
    """Per prompt, the raw log-prob of each of its tokens but the first given those before it (right-padded, so
    positions are those of the prompt alone)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)], mask[r, :len(p)] = torch.tensor(p), 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
    out = []
    for r, p in enumerate(prompts):
        rows = logits[r, :len(p) - 1]
        target = torch.tensor(p[1:], device=rows.device)[:, None]
        out.append((rows.gather(-1, target).squeeze(-1) - torch.logsumexp(rows, -1)).cpu())
    return out


def _partitioned(model) -> bool:
    """Whether ZeRO-3 partitions the weights (a partitioned parameter carries DeepSpeed's ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _generate_batch(model, tokenizer, kind, prompts, kwargs, device, synced, eos, num_return, sinks,
                    plan: GenerationPlan, use=None, loop=None) -> None:
    stop = plan.stop
    if "num_return_sequences" in kwargs:  # this batch's rows per prompt (a prompt's samples may run in runs)
        kwargs = {**kwargs, "num_return_sequences": num_return}
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        if kind == "causal":  # left padding: every prompt ends where generation starts
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        else:
            ids[r, : len(p)] = torch.tensor(p)
            mask[r, : len(p)] = 1
    if loop is not None:  # llmrl's own decoding loop (causal models: generation starts at the padded width)
        recorder = StopRecorder(tokenizer, *stop, rows=len(prompts) * num_return, start=width) \
            if stop[0] or stop[1] else None
        past = cached_past(use, prompts, num_return, repeat_rows=False)[0] if use is not None else None
        decoded = loop.decode(model, ids.to(device), mask.to(device), DecodeOptions(
            cache_name=cache_kwarg(model), generate_kwargs=kwargs, pad_id=tokenizer.pad_token_id, eos=eos,
            num_return=num_return, recorder=recorder, past=past, keep_cache=use is not None,
            mixed_adapters=plan.row_adapters is not None))
        kept = _keep_samples(tokenizer, prompts, num_return, sinks, stop, recorder, eos, decoded.tokens,
                             decoded.logprobs, decoded.sampling_logprobs, None, causal=True)
        if use is not None:
            keep_generated(use, kept, decoded.cache, width)
        return
    stepwise = _reads_logprobs_stepwise(model, kwargs)
    use = use if stepwise else None
    past = cached_past(use, prompts, num_return)[0] if use is not None else None
    if past is not None:  # Hugging Face does not repeat a given cache for num_return_sequences: rows repeated here
        ids, mask = ids.repeat_interleave(num_return, 0), mask.repeat_interleave(num_return, 0)
        kwargs = {**kwargs, "num_return_sequences": 1, cache_kwarg(model): past}
    chosen = ChosenLogprobs(model) if stepwise else None
    start = width if kind == "causal" else 1  # where the generated tokens begin in Hugging Face's input_ids
    recorder = StopRecorder(tokenizer, *stop, rows=len(prompts) * num_return, start=start) if stop[0] or stop[1] \
        else None
    try:
        if chosen is not None:
            user_criteria = kwargs.get("stopping_criteria") or []
            added = [chosen] if recorder is None else [recorder, chosen]
            kwargs = {**kwargs, "stopping_criteria": StoppingCriteriaList([*user_criteria, *added]),
                      "output_scores": True}  # each step's processed scores, read and freed by ChosenLogprobs
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), return_dict_in_generate=True,
                             output_logits=not stepwise, synced_gpus=synced, **kwargs)
    finally:
        if chosen is not None:
            chosen.remove()
    sequences = out.sequences[:, width:] if kind == "causal" else out.sequences[:, 1:]
    beam_indices = getattr(out, "beam_indices", None)
    if chosen is not None:
        steps = min(len(chosen.steps), sequences.shape[1])
        sequences = sequences[:, :steps]
        logprobs = torch.stack(chosen.steps[:steps], dim=1).cpu() if steps else torch.zeros(sequences.shape)
        sampled = torch.stack(chosen.sampled[:steps], dim=1).cpu() if steps else torch.zeros(sequences.shape)
    else:
        steps = min(len(out.logits), sequences.shape[1])
        sequences = sequences[:, :steps]
        logprobs = _logprobs_from_logits(out.logits, sequences, beam_indices, steps)
        sampled = None
    sequences = sequences.cpu()
    beam_scores = getattr(out, "sequences_scores", None) if beam_indices is not None else None
    kept = _keep_samples(tokenizer, prompts, num_return, sinks, stop, recorder, eos, sequences, logprobs, sampled,
                         beam_scores, causal=kind == "causal")
    if use is not None and cache_of(out) is not None:
        keep_generated(use, kept, cache_of(out), width)


def _keep_samples(tokenizer, prompts, num_return, sinks, stop, recorder, eos, sequences, logprobs, sampled,
                  beam_scores, causal: bool) -> list[tuple]:
    """Cut each row at its EOS or stop, append its sample dict to its prompt's sink; the (row, prompt, tokens)
    kept."""
    kept = []
    for row in range(sequences.shape[0]):
        tokens = sequences[row].tolist()
        eos_end = next((t + 1 for t, tok in enumerate(tokens) if tok in eos), None)
        stop_end = None if recorder is None or recorder.stopped_at[row] is None else recorder.stopped_at[row] + 1
        ends = [e for e in (eos_end, stop_end) if e is not None]
        end = min([*ends, len(tokens)])
        stopped = stop_end is not None and stop_end <= end
        sample = {
            "text": tokenizer.decode(tokens[:end], skip_special_tokens=True),
            "tokens": torch.tensor(tokens[:end], dtype=torch.long),
            "logprobs": logprobs[row, :end].clone(),
            "stop_reason": "stop" if ends else "length",
            "stop": which_stop(tokenizer, tokens[:end], *stop, prompt=prompts[row // num_return] if causal else ())
            if stopped else None,
        }
        if sampled is not None:
            sample["sampling_logprobs"] = sampled[row, :end].clone()
        if beam_scores is not None:
            sample["beam_score"] = float(beam_scores[row])
        sinks[row // num_return].append(sample)
        kept.append((row, prompts[row // num_return], tokens[:end]))
    return kept


def _logprobs_from_logits(logits: tuple, sequences: torch.Tensor, beam_indices, steps: int) -> torch.Tensor:
    """Each token's raw log-prob from Hugging Face's kept ``output_logits`` (beam search and the rarer modes)."""
    if not steps:
        return torch.zeros(sequences.shape)
    stacked = torch.stack(logits[:steps], dim=1).float()  # (running rows, steps, vocab)
    if beam_indices is not None:  # row r's token t came from running beam beam_indices[r, t] (-1: after its end)
        rows = beam_indices[:, :steps].long().clamp(min=0)
        stacked = stacked[rows, torch.arange(steps, device=rows.device)]
    return (stacked.gather(-1, sequences[..., None]).squeeze(-1) - torch.logsumexp(stacked, dim=-1)).cpu()


def _reads_logprobs_stepwise(model, kwargs: dict) -> bool:
    """Whether this call decodes greedily or by sampling, one row per sequence that never moves (the modes where
    :class:`ChosenLogprobs` applies); beam search, assisted, contrastive and DoLa decoding keep ``output_logits``."""
    config = copy.deepcopy(model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    return mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def _forward_module(model):
    """The Hugging Face model whose ``forward`` ``generate`` calls (inside a PeftModel, its base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class ChosenLogprobs(StoppingCriteria):
    """Each generated token's raw log-prob, read as it is chosen, holding one step's logits at a time.

    A forward hook keeps the last position's raw logits of the step's first model call, the policy's (float32, as
    Hugging Face copies them before any temperature, top-k or top-p processing; a logits processor that calls the
    model again, as steering and classifier-free guidance do, is not read); called as a stopping criterion once the
    step's tokens are appended, it gathers each row's chosen token and subtracts the logsumexp, then drops the
    logits. It never stops a sequence. Steps that Hugging Face later undoes (deferred stop checks) are dropped by
    the caller, which keeps as many steps as there are generated tokens.
    """

    def __init__(self, model):
        self.steps: list[torch.Tensor] = []
        self.sampled: list[torch.Tensor] = []  # log-probs under the processed distribution the token was drawn from
        self._logits: torch.Tensor | None = None
        self._hook = _forward_module(model).register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self._logits is not None:  # a logits processor's own model call (steering, guidance): not the policy's
            return
        logits = output["logits"] if isinstance(output, dict) else output.logits
        self._logits = logits[:, -1].to(copy=True, dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        logits, self._logits = self._logits, None
        if logits is not None:
            chosen = input_ids[:, -1:].to(logits.device)
            self.steps.append(logits.gather(-1, chosen).squeeze(-1) - torch.logsumexp(logits, dim=-1))
            if scores:  # the step's scores after every logits processor (temperature, top-k, top-p, penalties...)
                processed = scores[-1].float()
                self.sampled.append(processed.gather(-1, chosen.to(processed.device)).squeeze(-1)
                                    - torch.logsumexp(processed, dim=-1))
                scores[-1].set_()  # freed: only one step's scores are ever held
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def remove(self) -> None:
        self._hook.remove()
