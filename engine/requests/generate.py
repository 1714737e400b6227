"""The ``generate`` request kind, behind ``Caller.generate``: sampled or greedy continuations with raw-model
log-probs.

Client half (:func:`plan_shares`): the call's samples (``num_return_sequences`` per context) are split evenly
across the LLM's replicas in contiguous ranges. When sampling (``do_sample=True``, ``num_beams`` 1) with several
return sequences, a context's sequences may be cut between replicas (one prompt with 8 sequences over 2
replicas: 4 each); otherwise each context stays whole (beam search returns the best beams of one search, and
Hugging Face refuses greedy decoding with several return sequences on any layout). A replica whose pieces all
have the same number of sequences receives each prompt once with that ``num_return_sequences``; a replica whose
pieces differ receives each prompt once per sequence with ``num_return_sequences=1`` (Hugging Face expands a
prompt into one row per return sequence anyway, so the work is the same). Each replica seeds its sampling with
the call's seed plus the position of its first sample in the call's samples (context index x
``num_return_sequences`` + index of the piece's first sequence). The pieces of a context are joined back in
order.

What is identical across layouts: greedy and beam-search results (any number of replicas); log-probs are the
raw model's, so every sample's log-probs equal a plain forward's on any layout. What is reproducible: a seeded
call gives the same samples again for the same seed, config (replicas, token budget, minibatch size) and
inputs; with another number of replicas the samples differ (each replica draws from its own seeded stream and
batches differ).

Server half: the backend generates; the replica's leader answers. This module samples nothing itself: it
splits, seeds and joins (:mod:`llmrl.engine.model.generation` generates).
"""

from __future__ import annotations

import math
import numbers
import operator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from llmrl.engine.adapter_names import check_adapters, one_adapter_or_rows
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.requests.base import (
    Kind,
    Piece,
    Run,
    gather_pieces,
    group_pieces,
    piece_parts,
    split_evenly,
)

NAME = "generate"


@dataclass(frozen=True)
class GenerateRequest:
    contexts: list[str | list[int]]  # text, or token ids used as given
    kwargs: dict = field(default_factory=dict)  # Hugging Face generate arguments
    peft_adapter: str | list[str] | None = None  # a list: one adapter per context (multi-LoRA batching)
    seed: int | None = None
    minibatch_size: int | None = None


def num_return_sequences(kwargs: dict) -> int:
    value = kwargs.get("num_return_sequences", 1)
    try:
        k = operator.index(value)
    except TypeError:
        k = 0
    if isinstance(value, bool) or k < 1:
        raise InvalidArgument(f"num_return_sequences must be a positive integer, got {value!r}")
    return k


# Hugging Face generate arguments checked on the client: counts (ints, not bools or floats: 2.7 new tokens would be
# cut to 2) with their least value, and real numbers with their range (NaN passes Hugging Face's own checks).
COUNTS = {"max_new_tokens": 1, "min_new_tokens": 0, "num_beams": 1, "top_k": 0, "no_repeat_ngram_size": 0}
REALS = {"temperature": ("> 0 (for greedy decoding pass do_sample=False)", lambda x: x > 0),
         "top_p": ("in (0, 1]", lambda x: 0 < x <= 1), "min_p": ("in [0, 1]", lambda x: 0 <= x <= 1),
         "typical_p": ("in (0, 1]", lambda x: 0 < x <= 1), "repetition_penalty": ("> 0", lambda x: x > 0),
         "length_penalty": ("a finite number", lambda x: True)}


def check_generate_args(kwargs: dict) -> dict:
    """``kwargs`` with the counts and sampling numbers checked (:class:`InvalidArgument` naming the argument); one of
    them given as None is left out (Hugging Face's default applies, as with Hugging Face)."""
    kwargs = {k: v for k, v in kwargs.items() if not (v is None and (k in COUNTS or k in REALS))}
    for key, least in COUNTS.items():
        if key not in kwargs:
            continue
        value = kwargs[key]
        try:
            count = operator.index(value)
        except TypeError:
            count = None
        if isinstance(value, bool) or count is None or count < least:
            raise InvalidArgument(f"generate's {key} must be an int >= {least}, got {type(value).__name__} {value!r}")
        kwargs[key] = count
    fewest, most = kwargs.get("min_new_tokens"), kwargs.get("max_new_tokens")
    if fewest is not None and most is not None and fewest > most:
        raise InvalidArgument(f"generate's min_new_tokens ({kwargs['min_new_tokens']}) exceeds max_new_tokens "
                              f"({kwargs['max_new_tokens']}): it would never apply")
    for key, (rule, ok) in REALS.items():
        if key not in kwargs:
            continue
        value = kwargs[key]
        if key == "temperature" and value == 0 and not kwargs.get("do_sample", False):
            continue  # greedy: Hugging Face ignores the temperature (a warning, no error)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
            raise InvalidArgument(f"generate's {key} must be a number {rule}, got {type(value).__name__} {value!r}")
    return kwargs


def splits_sequences(kwargs: dict) -> bool:
    """Whether a context's return sequences are independent samples that replicas may share."""
    return bool(kwargs.get("do_sample", False)) and kwargs.get("num_beams", 1) == 1


def plan_shares(n: int, k: int, replicas: int, split_sequences: bool) -> list[list[Piece]]:
    """Each replica's pieces of ``n`` contexts with ``k`` return sequences each: the ``n x k`` samples in even
    contiguous ranges (sizes differ by at most one), or, unless ``split_sequences``, the ``n`` contexts whole."""
    if split_sequences:
        atoms = [Piece(i, j, j + 1) for i in range(n) for j in range(k)]
    else:
        atoms = [Piece(i, 0, k) for i in range(n)]
    return group_pieces(atoms, split_evenly(len(atoms), replicas))


def one_prompt_per_sample(pieces: list[Piece]) -> bool:
    """A replica whose pieces have different numbers of sequences gets one prompt per sequence."""
    return len({p.size for p in pieces}) > 1


def send(run: Run, llm: str, request: GenerateRequest) -> Future:
    request = replace(request, kwargs=check_generate_args(request.kwargs))
    contexts, kwargs = request.contexts, request.kwargs
    for name, instead in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        if name in kwargs:  # counted over padded rows: a sample's bound would depend on its neighbours' prompts
            raise InvalidArgument(f"generate's {name} (prompt plus new tokens) is not taken: pass {instead}, the "
                                  "tokens each sample may add (the prompts of one call have different lengths)")
    k = num_return_sequences(kwargs)
    adapters = one_adapter_or_rows(check_adapters(request.peft_adapter, len(contexts)))
    lockstep = run.config.llms[llm].lockstep  # (every replica's share keeps its list: see of_inputs)
    shares = plan_shares(len(contexts), k, len(run.replicas(llm)), splits_sequences(kwargs))

    def share(pieces: list[Piece]) -> GenerateRequest:
        if not pieces:
            return replace(request, contexts=[], peft_adapter=None if isinstance(adapters, list) else adapters)
        seed = None if request.seed is None else request.seed + pieces[0].input * k + pieces[0].start
        if one_prompt_per_sample(pieces):
            inputs = [p.input for p in pieces for _ in range(p.size)]
            return replace(request, contexts=[contexts[i] for i in inputs],
                           peft_adapter=of_inputs(adapters, inputs, lockstep),
                           kwargs={**kwargs, "num_return_sequences": 1}, seed=seed)
        size, inputs = pieces[0].size, [p.input for p in pieces]
        return replace(request, contexts=[contexts[i] for i in inputs], seed=seed,
                       peft_adapter=of_inputs(adapters, inputs, lockstep),
                       kwargs=kwargs if size == k else {**kwargs, "num_return_sequences": size})

    parts, answering = piece_parts(run, llm, shares, share, keep_empty=run.config.llms[llm].lockstep)

    def per_piece(values: dict) -> dict:
        """Each leader's answer as one list of samples per piece."""
        out = {}
        for leader, pieces in answering:
            if not one_prompt_per_sample(pieces):
                out[leader] = values[leader]
                continue
            flat = iter([s for samples in values[leader] for s in samples])
            out[leader] = [[next(flat) for _ in range(p.size)] for p in pieces]
        return out

    def assemble(values: dict) -> list[list[dict]]:
        pieces = gather_pieces(per_piece(values), answering, len(contexts))
        return [_with_total([s for piece in context for s in piece]) for context in pieces]

    return run.submit(NAME, parts, assemble)


def of_inputs(adapters, inputs: list[int], lockstep: bool = False):
    """A share's ``peft_adapter``: the call's one name, or the names of the contexts it holds: one name where they
    all name the same (the single-adapter path), but under ``lockstep``, where each replica must know that the call
    names several adapters (ZeRO-3 layer by layer refuses them: its replicas would gather different adapters)."""
    if not isinstance(adapters, list):
        return adapters
    names = [adapters[i] for i in inputs]
    return names if lockstep else one_adapter_or_rows(names)


def _with_total(samples: list[dict]) -> list[dict]:
    return [{**s, "logprob": float(s["logprobs"].sum())} for s in samples]


def handle(replica, request: GenerateRequest):
    results = replica.backend.generate(request)
    return results if replica.answers else None


KIND = Kind(name=NAME, payload=GenerateRequest, send=send, handle=handle, backend_method="generate",
            caller_methods=("generate_async", "generate"))
