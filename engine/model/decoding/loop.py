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

As gpt-fast's ``generate.py``, the loop is three small functions: :func:`prefill` (the prompts through Hugging Face's
forward), :func:`decode_one_token` (one token per row chosen from a step's logits, with its two log-probs) and
:func:`decode_n_tokens` (the steps until every row ended); :func:`decode` composes them, with its options in one
:class:`~.options.DecodeOptions`. How the key/value cache is held and a step computed is a strategy
(:mod:`.strategies`): Hugging Face's ``DynamicCache`` (grown each step), or with ``llama_step`` (the CPU default) one
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

from llmrl.engine.model.decoding.options import DecodeOptions
from llmrl.engine.model.decoding.sampling import draw, weights_and_normaliser
from llmrl.engine.model.decoding.strategies import PaddedBatch, WrittenOutStrategy, choose


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


@dataclass(frozen=True)
class TokenRule:
    """How each step's token is chosen, and when a row has ended."""

    processors: object  # Hugging Face's LogitsProcessorList for the request
    copy: bool  # the processors get a copy of the raw logits (:func:`_processed`)
    do_sample: bool
    sampler: str  # how samples are drawn (:mod:`.sampling`)
    pad_id: int  # chosen for rows that ended
    eos_ids: torch.Tensor  # the ids that end a row
    recorder: object = None  # stop strings and token ids (:class:`~llmrl.engine.model.stops.StopRecorder`), or None
    check: int = 1  # steps between checks that every row ended (:func:`finish_interval`)


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
def decode(model, ids: torch.Tensor, mask: torch.Tensor, options: DecodeOptions) -> Decoded:
    """Decode ``ids`` (prompts x width, left-padded, on the model's device; ``mask`` their attention mask) with
    Hugging Face ``model`` as ``options`` say (:class:`~.options.DecodeOptions`): the prefill, a cache strategy
    (:func:`~.strategies.choose`), then the steps. Returns each row's tokens and log-probs (and with
    ``options.keep_cache`` the final cache)."""
    device = ids.device
    kwargs = {k: v for k, v in options.generate_kwargs.items() if k != "num_return_sequences"}
    config, processors = _hf_setup(model, ids, kwargs, device, mask.repeat_interleave(options.num_return, dim=0))
    # the trunk keeps the states of a batch without a static cache or a cache across calls
    recording = options.trunk if options.past is None and options.static is None else None
    batch = PaddedBatch(ids, mask, (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0),
                  torch.arange(ids.shape[0], device=device).repeat_interleave(options.num_return),
                  options.num_return, int(config.max_new_tokens), options.pad_id, recording)
    logits, prompts, prompt_states = prefill(model, batch, options)
    strategy = choose(model, batch, options)
    known = _out_of_place()
    rule = TokenRule(processors, not all(type(processor) in known for processor in processors), config.do_sample,
                     options.sampler, options.pad_id, torch.tensor(sorted(options.eos), dtype=torch.long,
                                                                   device=device),
                     options.recorder, finish_interval(device, options.recorder, options.keep_cache))
    packs = options.packer.for_rows(model, strategy.rows(batch), options.owners) if options.packer is not None \
        else contextlib.nullcontext()
    with packs:  # (the written-out step resolves its linear layers within: they call the packs)
        strategy.prefill(model, batch, prompts)
        del prompts  # (the strategy's cache holds the prompts' keys and values now)
        tokens, raw, sampled = decode_n_tokens(strategy, batch, rule, logits)
    if prompt_states is not None and all(state is not None for state in strategy.recorded):
        recording.record_decoded([ids[p][mask[p].bool()].tolist() for p in range(ids.shape[0])], prompt_states,
                                 strategy.recorded, tokens, options.num_return, options.eos)
    return Decoded(tokens.cpu(), torch.stack(raw, dim=1).cpu(), torch.stack(sampled, dim=1).cpu(),
                   strategy.hf_cache() if options.keep_cache else None, isinstance(strategy, WrittenOutStrategy))


def prefill(model, batch: PaddedBatch, options: DecodeOptions):
    """The prompts through Hugging Face's forward (only the columns after those ``options.past`` holds): the first
    step's float32 logits per row, the prompts' cache (one row per prompt) and, with the batch's ``recording``, the
    states the trunk captured (else None)."""
    from transformers import DynamicCache

    past = options.past
    cache = DynamicCache(config=model.config) if past is None else past
    covered = past.get_seq_length() if past is not None else 0
    recording = batch.recording
    with recording.active("record") if recording is not None else contextlib.nullcontext(), \
            _contiguous_head_input(model) if batch.ids.device.type == "cpu" else contextlib.nullcontext():
        out = model(input_ids=batch.ids[:, covered:], attention_mask=batch.mask,
                    position_ids=batch.positions[:, covered:], use_cache=True, **{options.cache_name: cache},
                    **_keeps_last_logits_only(model))
        states = recording.take_captured() if recording is not None else None
    return out.logits[:, -1].float()[batch.source], cache, states  # (indexing copies)


def decode_n_tokens(strategy, batch: PaddedBatch, rule: TokenRule, logits: torch.Tensor):
    """The steps from the prefill's ``logits`` until every row ended or ``batch.max_new`` tokens: the tokens (rows
    x steps, on the device) and each step's raw and sampling log-probs (lists of rows)."""
    width, rows, device = batch.width, batch.rows, batch.ids.device
    sequences = torch.full((rows, batch.length), rule.pad_id, dtype=torch.long, device=device)
    sequences[:, :width] = batch.ids[batch.source]
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    raw, sampled = [], []
    for step in range(batch.max_new):
        chosen, raw_logprob, sampled_logprob = decode_one_token(rule, logits, sequences[:, :width + step], finished)
        raw.append(raw_logprob)
        sampled.append(sampled_logprob)
        sequences[:, width + step] = chosen
        finished |= torch.isin(chosen, rule.eos_ids)
        if rule.recorder is not None:
            finished |= rule.recorder(sequences[:, :width + step + 1], None).to(device)
        if step + 1 == batch.max_new or ((step + 1) % rule.check == 0 and bool(finished.all())):
            break
        logits = strategy.step(chosen)
    return sequences[:, width:width + len(raw)], raw, sampled


def decode_one_token(rule: TokenRule, logits: torch.Tensor, sequences: torch.Tensor, finished: torch.Tensor):
    """One token per row from a step's raw ``logits`` (rows x vocabulary, float32), after ``sequences`` (rows x
    columns so far): chosen as Hugging Face's ``generate`` chooses it (the pad token for ``finished`` rows), with its
    raw log-prob and its log-prob under the processed distribution it was drawn from."""
    scores = _processed(rule.processors, sequences, logits, rule.copy)
    drawn_normaliser = None  # the processed distribution's, where drawing computed it
    if rule.do_sample and rule.sampler == "inverse_cdf":  # drawn from exp(score - max): no softmax
        weights, drawn_normaliser = weights_and_normaliser(scores)
        chosen = draw(weights, rule.sampler)
        del weights
    elif rule.do_sample:
        chosen = draw(torch.softmax(scores, dim=-1), rule.sampler)
    else:
        chosen = torch.argmax(scores, dim=-1)
    chosen = torch.where(finished, torch.full_like(chosen, rule.pad_id), chosen)  # Hugging Face's padding of ended rows
    column = chosen[:, None]
    # without processors the two distributions are one
    normaliser = drawn_normaliser if drawn_normaliser is not None and scores is logits \
        else torch.logsumexp(logits, dim=-1)
    raw = logits.gather(-1, column).squeeze(-1) - normaliser
    if scores is not logits:
        normaliser = drawn_normaliser if drawn_normaliser is not None else torch.logsumexp(scores, dim=-1)
    return chosen, raw, scores.gather(-1, column).squeeze(-1) - normaliser


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
