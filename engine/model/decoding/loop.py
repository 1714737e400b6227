"""llmrl's decoding loop: greedy decoding or sampling of a batch of left-padded prompts, with raw log-probs.

For each batch: one prefill of the prompts (each prompt once, however many sequences it returns), then the cache
rows are repeated for ``num_return_sequences`` and each step feeds one token per row. Tokens are chosen exactly as
Hugging Face's ``generate`` chooses them: the logits processors are Hugging Face's own, built from the same
arguments (temperature, top-k, top-p, min_new_tokens, penalties...), sampling draws with ``torch.multinomial`` from
their softmax (unless ``generation.sampler`` says otherwise: :mod:`.sampling`), and rows that ended go on with the
pad token. So greedy outputs equal Hugging Face's, and with the same seed and sampler so do samples wherever the
logits agree to the bit. Each token's raw log-prob (before any processing:
what ``score`` returns) and its log-prob under the processed distribution it was drawn from are read as it is chosen;
one step's logits are held at a time.

The cache is Hugging Face's ``DynamicCache`` (grown each step: the CPU default), or, with a
:class:`~.static_step.StaticDecoder`, a preallocated ``StaticCache`` of bucketed shape whose step may be captured;
not for a model with a sliding window shorter than the bucketed length (Mistral, Gemma 2...), whose static sliding
layers keep only the window: such a call grows a dynamic cache.
On CUDA, whether every row has ended is read back every :data:`CUDA_FINISH_CHECK` steps, not at every step: a
read-back waits for the device, so the host could not queue the next step while the current one runs. Steps run
after every row ended feed pad tokens and are cut with the rows (each row ends at its EOS), so results are the same.
With stop strings (checked on the host at every step anyway) or a cache kept across calls, it reads every step.
With a frozen trunk (``trunk_reuse_mb``) and a dynamic cache, the states entering the trunk's depth of the prompts
and of each token fed back are kept for the update of these samples
(:meth:`~llmrl.engine.model.reuse.trunk.Trunk.record_decoded`).
This module runs the model; it does not plan batches, merge adapters or build responses.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from llmrl.engine.model.decoding.sampling import draw


@dataclass
class Decoded:
    """Per row (prompt-major: prompt i's samples are rows i*n .. i*n+n-1), the generated tokens and log-probs."""

    tokens: torch.Tensor  # (rows, steps) long, on the CPU
    logprobs: torch.Tensor  # (rows, steps) raw log-probs
    sampling_logprobs: torch.Tensor  # (rows, steps) log-probs under the processed distribution
    cache: object = None  # with keep_cache: the cache after the last step (row r of the batch is row r here)


CUDA_FINISH_CHECK = 8  # steps between read-backs of "has every row ended?" on CUDA (see the module's docstring)


def finish_interval(device: torch.device, recorder, keep_cache: bool) -> int:
    """Steps between checks that every row has ended (1: every step)."""
    return CUDA_FINISH_CHECK if device.type == "cuda" and recorder is None and not keep_cache else 1


def _hf_setup(model, ids: torch.Tensor, kwargs: dict, device):
    """The generation config and logits processors Hugging Face's ``generate`` would build for these arguments."""
    config, _ = model._prepare_generation_config(None, **kwargs)
    model._prepare_special_tokens(config, True, device=device)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=ids.shape[1],
                                             encoder_input_ids=ids, device=device, model_kwargs={})
    return config, processors


def _keeps_last_logits_only(model) -> dict:
    accepted = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}


@torch.no_grad()
def decode(model, cache_name: str, ids: torch.Tensor, mask: torch.Tensor, num_return: int, kwargs: dict,
           pad_id: int, eos: set[int], recorder=None, static=None, sampler: str = "multinomial", past=None,
           keep_cache: bool = False, packer=None, owners: dict | None = None, trunk=None) -> Decoded:
    """Decode ``ids`` (prompts x width, left-padded, on the model's device) with Hugging Face ``model``.

    ``kwargs`` are the request's generate arguments (those :mod:`.eligibility` takes); ``recorder`` a
    :class:`~llmrl.engine.model.stops.StopRecorder` or None; ``static`` a
    :class:`~.static_step.StaticDecoder` or None (a dynamic cache, no capture); ``sampler`` how samples are drawn
    (:mod:`.sampling`). ``past``: a Hugging Face cache holding the first columns of every prompt row (the cache
    across calls, :func:`~llmrl.engine.model.reuse.generation_prefix.cached_past`); only the columns after them are
    prefilled. ``keep_cache`` returns the final cache in :attr:`Decoded.cache`. ``packer``: a
    :class:`~.packed_linears.PackedWeights` whose packs the decode steps multiply with (``owners``: the memory it is
    told of, :meth:`~.packed_linears.PackedWeights.for_rows`), or None. ``trunk``: a
    :class:`~llmrl.engine.model.reuse.trunk.Trunk` that keeps the states this batch computes below its depth for the
    update that will score these samples (with a dynamic cache and no ``past`` only), or None."""
    from transformers import DynamicCache

    device = ids.device
    config, processors = _hf_setup(model, ids, {k: v for k, v in kwargs.items() if k != "num_return_sequences"},
                                   device)
    prompts, width = ids.shape
    rows, max_new = prompts * num_return, int(config.max_new_tokens)
    source = torch.arange(prompts, device=device).repeat_interleave(num_return)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    prefill = DynamicCache(config=model.config) if past is None else past
    covered = past.get_seq_length() if past is not None else 0
    keeping = trunk if trunk is not None and past is None and static is None else None
    with keeping.active("record") if keeping is not None else contextlib.nullcontext():
        out = model(input_ids=ids[:, covered:], attention_mask=mask, position_ids=positions[:, covered:],
                    use_cache=True, **{cache_name: prefill}, **_keeps_last_logits_only(model))
        prefill_states = keeping.take_captured() if keeping is not None else None
    fed_states: list[torch.Tensor] = []
    logits = out.logits[:, -1].float()[source]  # indexing copies
    del out
    padded, length = _bucketed(static, rows, width + max_new) if static is not None else (rows, 0)
    if static is not None and _slides_within(model.config, length):
        static = None  # Hugging Face's static sliding layers hold only the window: this call grows a cache instead
    if static is not None:
        into = torch.cat([source, source.new_zeros(padded - rows)])  # extra rows: copies of the first prompt
        cache = static.cache(model, padded, length)
        for index, layer in enumerate(prefill.layers):
            cache.update(layer.keys[into], layer.values[into], index)
        del prefill
        attention = torch.ones((padded, length), dtype=mask.dtype, device=device)
        attention[:, :width] = mask[into]
        step_positions = positions[into, -1:].clone()
    else:
        padded, into, cache = rows, source, prefill
        if num_return > 1:
            cache.batch_repeat_interleave(num_return)
        attention = mask[source]
        step_positions = positions[source, -1:].clone()
    sequences = torch.full((rows, width + max_new), pad_id, dtype=torch.long, device=device)
    sequences[:, :width] = ids[source]
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    raw, sampled = [], []
    check = finish_interval(device, recorder, keep_cache)
    with packer.for_rows(model, padded, owners) if packer is not None else contextlib.nullcontext():
        for step in range(max_new):
            # processors get a copy: the raw logits must stay as the model gave them
            scores = processors(sequences[:, :width + step], logits.clone()) if len(processors) else logits
            if config.do_sample:
                chosen = draw(torch.softmax(scores, dim=-1), sampler)
            else:
                chosen = torch.argmax(scores, dim=-1)
            # Hugging Face's padding of ended rows
            chosen = torch.where(finished, torch.full_like(chosen, pad_id), chosen)
            column = chosen[:, None]
            normaliser = torch.logsumexp(logits, dim=-1)
            raw.append(logits.gather(-1, column).squeeze(-1) - normaliser)
            if scores is not logits:  # without processors the two distributions are one
                normaliser = torch.logsumexp(scores, dim=-1)
            sampled.append(scores.gather(-1, column).squeeze(-1) - normaliser)
            sequences[:, width + step] = chosen
            finished |= torch.isin(chosen, eos_ids)
            if recorder is not None:
                finished |= recorder(sequences[:, :width + step + 1], None).to(device)
            if step + 1 == max_new or ((step + 1) % check == 0 and bool(finished.all())):
                break
            step_positions += 1
            feed = chosen if padded == rows else torch.cat([chosen, chosen.new_full((padded - rows,), pad_id)])
            if static is not None:
                logits = static.step(model, cache_name, cache, feed[:, None], step_positions, attention)[:rows]
            else:
                attention = torch.cat([attention, attention.new_ones((rows, 1))], dim=1)
                with keeping.active("record") if keeping is not None else contextlib.nullcontext():
                    out = model(input_ids=feed[:, None], position_ids=step_positions, attention_mask=attention,
                                use_cache=True, **{cache_name: cache})
                    if keeping is not None:
                        fed_states.append(keeping.take_captured())
                logits = out.logits[:, -1].float()  # a view of this step's own logits (no copy in float32)
                del out
    steps = len(raw)
    if prefill_states is not None and all(state is not None for state in fed_states):
        keeping.record_decoded([ids[p][mask[p].bool()].tolist() for p in range(prompts)], prefill_states, fed_states,
                               sequences[:, width:width + steps], num_return, eos)
    return Decoded(sequences[:, width:width + steps].cpu(), torch.stack(raw, dim=1).cpu(),
                   torch.stack(sampled, dim=1).cpu(), cache if keep_cache else None)


def _bucketed(static, rows: int, length: int) -> tuple[int, int]:
    from llmrl.engine.model.decoding.static_step import bucket

    return bucket(rows, length, static.length_bucket)


def _slides_within(config, length: int) -> bool:
    """Whether some attention layer of the model sees only a sliding window shorter than ``length`` tokens."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "use_sliding_window", True):
        return False
    kinds = getattr(text, "layer_types", None)
    return (kinds is None or "sliding_attention" in kinds) and window < length
