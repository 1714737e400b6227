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

The cache is Hugging Face's ``DynamicCache`` (grown each step), or with ``llama_step`` (the CPU default) one
preallocated for the batch that :class:`~.llama_step.LlamaStep`'s written-out steps fill in place, or, with a
:class:`~.static_step.StaticDecoder`, a preallocated ``StaticCache`` of bucketed shape whose step may be captured;
not for a model with a sliding window shorter than the bucketed length (Mistral, Gemma 2...), whose static sliding
layers keep only the window: such a call grows a dynamic cache.
On CUDA, whether every row has ended is read back every :data:`CUDA_FINISH_CHECK` steps, not at every step: a
read-back waits for the device, so the host could not queue the next step while the current one runs. Steps run
after every row ended feed pad tokens and are cut with the rows (each row ends at its EOS), so a batch's results are
the same. Those steps still draw from the random generator: in a sampled call split into several batches, the
batches after the first start from another random state than on a CPU (reproducible on the same device, but
not CPU's samples, nor Hugging Face's).
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

from llmrl.engine.model.decoding.eligibility import slides_within
from llmrl.engine.model.decoding.llama_step import LlamaStep
from llmrl.engine.model.decoding.sampling import draw, weights_and_normaliser


@dataclass
class Decoded:
    """Per row (prompt-major: prompt i's samples are rows i*n .. i*n+n-1), the generated tokens and log-probs."""

    tokens: torch.Tensor  # (rows, steps) long, on the CPU
    logprobs: torch.Tensor  # (rows, steps) raw log-probs
    sampling_logprobs: torch.Tensor  # (rows, steps) log-probs under the processed distribution
    cache: object = None  # with keep_cache: the cache after the last step (row r of the batch is row r here)
    llama_step: bool = False  # whether the decode steps ran as :class:`~.llama_step.LlamaStep`


CUDA_FINISH_CHECK = 8  # steps between read-backs of "has every row ended?" on CUDA (see the module's docstring)


def finish_interval(device: torch.device, recorder, keep_cache: bool) -> int:
    """Steps between checks that every row has ended (1: every step)."""
    return CUDA_FINISH_CHECK if device.type == "cuda" and recorder is None and not keep_cache else 1


def _hf_setup(model, ids: torch.Tensor, kwargs: dict, device, row_mask: torch.Tensor):
    """The generation config and logits processors Hugging Face's ``generate`` would build for these arguments.
    ``row_mask``: each row's attention mask (a repetition penalty leaves a row's left padding out, as there)."""
    config, _ = model._prepare_generation_config(None, **kwargs)
    if config.max_new_tokens is not None:  # as generate: processors that read max_length (forced EOS) count from here
        config.max_length = ids.shape[1] + config.max_new_tokens
    model._prepare_special_tokens(config, True, device=device)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=ids.shape[1],
                                             encoder_input_ids=ids, device=device,
                                             model_kwargs={"attention_mask": row_mask})
    return config, processors


def _keeps_last_logits_only(model) -> dict:
    accepted = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}


@torch.no_grad()
def decode(model, cache_name: str, ids: torch.Tensor, mask: torch.Tensor, num_return: int, kwargs: dict,
           pad_id: int, eos: set[int], recorder=None, static=None, sampler: str = "multinomial", past=None,
           keep_cache: bool = False, packer=None, owners: dict | None = None, trunk=None,
           llama_step: bool = False) -> Decoded:
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
    update that will score these samples (with a dynamic cache and no ``past`` only), or None. ``llama_step``: with a
    dynamic cache, the decode steps run as :class:`~.llama_step.LlamaStep` where it takes the model."""
    from transformers import DynamicCache

    device = ids.device
    config, processors = _hf_setup(model, ids, {k: v for k, v in kwargs.items() if k != "num_return_sequences"},
                                   device, mask.repeat_interleave(num_return, dim=0))
    prompts, width = ids.shape
    rows, max_new = prompts * num_return, int(config.max_new_tokens)
    source = torch.arange(prompts, device=device).repeat_interleave(num_return)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    prefill = DynamicCache(config=model.config) if past is None else past
    covered = past.get_seq_length() if past is not None else 0
    keeping = trunk if trunk is not None and past is None and static is None else None
    with keeping.active("record") if keeping is not None else contextlib.nullcontext(), \
            _contiguous_head_input(model) if device.type == "cpu" else contextlib.nullcontext():
        out = model(input_ids=ids[:, covered:], attention_mask=mask, position_ids=positions[:, covered:],
                    use_cache=True, **{cache_name: prefill}, **_keeps_last_logits_only(model))
        prefill_states = keeping.take_captured() if keeping is not None else None
    fed_states: list[torch.Tensor] = []
    logits = out.logits[:, -1].float()[source]  # indexing copies
    del out
    padded, length = _bucketed(static, rows, width + max_new) if static is not None else (rows, 0)
    if static is not None and slides_within(model.config, length):
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
    elif llama_step and max_new > 1 and LlamaStep.why_not(model, width + max_new, trunk) is None:  # (steps to run)
        padded, into, cache = rows, source, prefill  # the steps' cache: built from the prefill's below
        attention = torch.zeros((rows, width + max_new), dtype=torch.bool, device=device)
        attention[:, :width] = mask[source].bool()
        step_positions = positions[source, -1:].clone()
    else:
        llama_step, padded, into, cache = False, rows, source, prefill
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
    known = _out_of_place()
    copy = not all(type(processor) in known for processor in processors)
    with packer.for_rows(model, padded, owners) if packer is not None else contextlib.nullcontext():
        stepper = None
        if static is None and llama_step:  # resolved within the packs' block: its linear layers call the packs
            stepper = LlamaStep(model, cache, source, width + max_new, keeping.depth if keeping is not None else None)
            cache = prefill = None  # its keys and values are in the step's cache now
        for step in range(max_new):
            scores = _processed(processors, sequences[:, :width + step], logits, copy)
            drawn_normaliser = None  # the processed distribution's, where drawing computed it
            if config.do_sample and sampler == "inverse_cdf":  # drawn from exp(score - max): no softmax
                weights, drawn_normaliser = weights_and_normaliser(scores)
                chosen = draw(weights, sampler)
                del weights
            elif config.do_sample:
                chosen = draw(torch.softmax(scores, dim=-1), sampler)
            else:
                chosen = torch.argmax(scores, dim=-1)
            # Hugging Face's padding of ended rows
            chosen = torch.where(finished, torch.full_like(chosen, pad_id), chosen)
            column = chosen[:, None]
            # without processors the two distributions are one
            normaliser = drawn_normaliser if drawn_normaliser is not None and scores is logits \
                else torch.logsumexp(logits, dim=-1)
            raw.append(logits.gather(-1, column).squeeze(-1) - normaliser)
            if scores is not logits:
                normaliser = drawn_normaliser if drawn_normaliser is not None else torch.logsumexp(scores, dim=-1)
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
                logits = static.step(model, cache_name, cache, feed[:, None], step_positions, attention,
                                     width + step + 1)[:rows]
            elif stepper is not None:
                attention[:, stepper.filled] = True
                logits, state = stepper.step(feed, step_positions, attention)
                if keeping is not None:
                    fed_states.append(state)
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
    if stepper is not None and keep_cache:
        cache = stepper.hf_cache(model.config)
    if prefill_states is not None and all(state is not None for state in fed_states):
        keeping.record_decoded([ids[p][mask[p].bool()].tolist() for p in range(prompts)], prefill_states, fed_states,
                               sequences[:, width:width + steps], num_return, eos)
    return Decoded(sequences[:, width:width + steps].cpu(), torch.stack(raw, dim=1).cpu(),
                   torch.stack(sampled, dim=1).cpu(), cache if keep_cache else None, stepper is not None)


def _out_of_place() -> set:
    """Hugging Face logits processors that return a new tensor and never write the one they are given
    (``tests/test_llama_step.py`` checks each against the installed version)."""
    from transformers.generation import logits_process as lp

    names = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TemperatureLogitsWarper",
             "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
    return {getattr(lp, name) for name in names if hasattr(lp, name)}


def _processed(processors, sequences: torch.Tensor, logits: torch.Tensor, copy: bool) -> torch.Tensor:
    """The processed scores of a step. The raw logits must stay as the model gave them: processors get a copy unless
    every one of them is known to work out of place (:func:`_out_of_place`); a write to them is refused loudly."""
    if not len(processors):
        return logits
    version = logits._version
    scores = processors(sequences, logits.clone() if copy else logits)
    if logits._version != version:
        raise RuntimeError("a logits processor wrote the raw logits in place: its raw log-probs would be wrong; "
                           "remove it from llmrl's list of processors that work out of place (loop._out_of_place)")
    return scores


@contextlib.contextmanager
def _contiguous_head_input(model):
    """The output layer's input made contiguous (on a CPU): Hugging Face hands it the last column of every prompt
    (``logits_to_keep``), a strided view that ``torch.matmul`` multiplies as one product per prompt, each reading
    the whole vocabulary's weights (a 49,152-token layer: 24 ms for 8 prompts, against 2 ms as one product)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
    try:
        yield
    finally:
        handle.remove()


def _bucketed(static, rows: int, length: int) -> tuple[int, int]:
    from llmrl.engine.model.decoding.static_step import bucket

    return bucket(rows, length, static.length_bucket)
