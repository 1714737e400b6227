"""Token-level training data for ``forward_backward`` and ``forward``: what a datum is, a helper that builds one,
and the checks made on the client before anything is sent.

A datum is one sequence, in Tinker's form: a dict ``{"model_input": ids, "loss_fn_inputs": {...}}`` where
``model_input`` is the model's input token ids (``tokens[:-1]`` of the whole sequence) and ``loss_fn_inputs`` holds
``target_tokens`` (``tokens[1:]``: the token each input position predicts) and the loss's per-token inputs, one
value per target token (``weights`` for ``cross_entropy``; the sampler's ``logprobs`` and the ``advantages`` for
the policy-gradient losses). :func:`completion_datum` builds one from a prompt and a completion.

Targets must be the input shifted by one (the log-prob of target ``t`` is then read in the same forward pass as
every other), with one exception: a position the loss does not read (its weight or advantage 0, see
:data:`llmrl.engine.token_losses.UNREAD_WHEN_ZERO`) may hold any target, as the cookbook's ``rl_loop`` puts ``0`` at
the prompt's positions. Its loss is 0, and its returned log-prob NaN (not computed: the forward reads the next
input token's). Other targets are refused with the position at fault.

This module checks and converts; it sends nothing and computes no loss (:func:`llmrl.engine.token_losses.token_loss`
does, on the servers).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests.inputs import token_ids


@dataclass(frozen=True)
class Sequence:
    """One checked datum: its tokens (``model_input`` followed by the last target) and per-token loss inputs
    (float lists, one value per target token)."""

    tokens: list[int]
    inputs: dict[str, list[float]] = field(default_factory=dict)
    unscored: tuple[int, ...] = ()  # target positions the loss does not read whose target is not the next input

    @property
    def num_targets(self) -> int:
        return len(self.tokens) - 1


def completion_datum(prompt, completion, prompt_logprobs=None, **per_token) -> dict:
    """A datum that trains on ``completion`` given ``prompt`` (both token id lists).

    Each keyword is a per-token loss input for the completion's tokens: a list with one value per completion token
    (a sample's ``logprobs``), or one number for all of them (a sequence's advantage, a weight of 1.0). The prompt's
    target positions get 0 for every input, so that they add nothing to the ``cross_entropy``,
    ``importance_sampling``, ``ppo`` and ``cispo`` losses. ``dro``'s penalty ``beta / 2 * (lp - logprobs)^2`` reads
    every position: give ``prompt_logprobs`` (the prompt's tokens but the first, as ``generate(...,
    prompt_logprobs=True)`` returns them) to fill the prompt's ``logprobs`` with them. Example::

        completion_datum(prompt_ids, sample["tokens"], logprobs=sample["logprobs"], advantages=advantage)
    """
    prompt = token_ids(prompt, "prompt")
    completion = token_ids(completion, "completion")
    if not prompt or not completion:
        raise InvalidArgument("completion_datum needs a prompt of at least one token and a non-empty completion")
    tokens = prompt + completion
    inputs = {}
    for key, value in per_token.items():
        single = isinstance(value, numbers.Real) and not isinstance(value, bool)
        values = [float(value)] * len(completion) if single else _floats(value, key)
        if len(values) != len(completion):
            raise InvalidArgument(f"{key} has {len(values)} values for a completion of {len(completion)} tokens: "
                                  "give one value per completion token, or one number for all")
        inputs[key] = [0.0] * (len(prompt) - 1) + values
    if prompt_logprobs is not None:
        given = _floats(prompt_logprobs, "prompt_logprobs")
        if len(given) != len(prompt) - 1 or "logprobs" not in inputs:
            raise InvalidArgument(f"prompt_logprobs needs logprobs= and one value per prompt token but the first "
                                  f"({len(prompt) - 1}), got {len(given)}")
        inputs["logprobs"][:len(prompt) - 1] = given
    return {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:], **inputs}}


def check_data(data, needed: tuple[str, ...] | None, vocab_size: int | None, max_length: int | None = None,
               what: str = "data", unread_when_zero: tuple[str, ...] = (), optional: tuple[str, ...] = ()
               ) -> list[Sequence]:
    """The checked sequences of ``data`` (a list of datums), whose loss reads the per-token inputs ``needed``
    (None: no loss on the servers; the other inputs are neither read nor sent) and those of ``optional`` a datum
    gives (per-token clip thresholds: ratios, the low ones in [0, 1], the high ones at least 1); ``unread_when_zero``:
    the inputs that, all 0 at a position, make the loss ignore it (there a target may differ from the next input
    token).

    Raises :class:`InvalidArgument` / :class:`InvalidArgumentType` naming the datum and the field at fault: a
    missing field, targets that are not the input shifted by one, an input whose length is not the number of target
    tokens, a non-finite value, a token id beyond the vocabulary, an input the loss does not read."""
    if isinstance(data, (str, bytes, dict)) or not hasattr(data, "__len__"):
        raise InvalidArgumentType(f"{what} must be a list of datums (dicts with model_input and loss_fn_inputs), got "
                                  f"{type(data).__name__}")
    if len(data) == 0:
        raise InvalidArgument(f"{what} is empty: give at least one datum")
    sequences = [_check_datum(datum, f"{what}[{i}]", needed, vocab_size, unread_when_zero, optional)
                 for i, datum in enumerate(data)]
    for i, seq in enumerate(sequences):
        if max_length is not None and seq.num_targets > max_length:
            raise InvalidArgument(f"{what}[{i}] has {seq.num_targets} input tokens; this model accepts at most "
                                  f"{max_length}: nothing was sent")
    return sequences


def _check_datum(datum, where: str, needed: tuple[str, ...] | None, vocab_size: int | None,
                 unread_when_zero: tuple[str, ...], optional: tuple[str, ...] = ()) -> Sequence:
    if not isinstance(datum, dict) or "model_input" not in datum or "loss_fn_inputs" not in datum:
        raise InvalidArgumentType(f"{where} must be a dict with 'model_input' (token ids) and 'loss_fn_inputs' "
                                  f"(target_tokens and per-token inputs), got {_describe(datum)}; "
                                  "llmrl.completion_datum(prompt, completion, ...) builds one")
    model_input = token_ids(datum["model_input"], f"{where}['model_input']")
    if not model_input:
        raise InvalidArgument(f"{where}['model_input'] must be a non-empty list of token ids")
    loss_inputs = datum["loss_fn_inputs"]
    if not isinstance(loss_inputs, dict) or "target_tokens" not in loss_inputs:
        raise InvalidArgument(f"{where}['loss_fn_inputs'] must be a dict holding 'target_tokens' (one per input "
                              "token: the next token of the sequence)")
    targets = token_ids(loss_inputs["target_tokens"], f"{where}['loss_fn_inputs']['target_tokens']")
    if targets is None or len(targets) != len(model_input):
        got = "not a list of token ids" if targets is None else f"{len(targets)} targets"
        raise InvalidArgument(f"{where}: {got} for {len(model_input)} input tokens; give one target per input token "
                              "(target_tokens = tokens[1:] when model_input = tokens[:-1])")
    tokens = model_input + [targets[-1]]
    if vocab_size is not None and max(tokens) >= vocab_size:
        raise InvalidArgument(f"{where} holds token id {max(tokens)}, beyond the vocabulary of the model "
                              f"({vocab_size} tokens)")
    inputs = {}
    for key, value in loss_inputs.items():
        if key == "target_tokens" or needed is None:
            continue
        if key not in needed and key not in optional:
            reads = ", ".join([*needed, *(f"{k} (optional)" for k in optional)]) or "no per-token input"
            raise InvalidArgument(f"{where}['loss_fn_inputs'] holds {key!r}, which this loss does not read (it reads "
                                  f"target_tokens and {reads}); remove it, or pick the loss that reads it")
        values = _floats(value, f"{where}['loss_fn_inputs'][{key!r}]")
        if len(values) != len(targets):
            raise InvalidArgument(f"{where}['loss_fn_inputs'][{key!r}] has {len(values)} values for {len(targets)} "
                                  "target tokens: give one value per target token")
        inputs[key] = values
        bad = next((t for t, v in enumerate(values) if key in optional and not (
            0 <= v <= 1 if key.startswith("clip_low") else v >= 1)), None)
        if bad is not None:
            rule = "in [0, 1] (1 - eps)" if key.startswith("clip_low") else "at least 1 (1 + eps)"
            raise InvalidArgument(f"{where}['loss_fn_inputs'][{key!r}][{bad}] is {values[bad]}: a clip threshold is a "
                                  f"bound on the probability ratio, {rule}, not the epsilon itself")
    missing = [key for key in needed or () if key not in inputs]
    if missing:
        raise InvalidArgument(f"{where}['loss_fn_inputs'] lacks {missing[0]!r}, which this loss reads (one value per "
                              "target token)")
    unscored = []
    for t in range(len(model_input) - 1):
        if targets[t] == model_input[t + 1]:
            continue
        if not unread_when_zero or any(inputs[key][t] != 0.0 for key in unread_when_zero):
            ignored = f", or give {' and '.join(unread_when_zero)} 0 there" if unread_when_zero else ""
            raise InvalidArgument(f"{where}['loss_fn_inputs']['target_tokens'][{t}] is {targets[t]} but the next input "
                                  f"token is {model_input[t + 1]}: targets must be the input shifted by one "
                                  f"(model_input = tokens[:-1], target_tokens = tokens[1:]){ignored}")
        unscored.append(t)
    return Sequence(tokens, inputs, tuple(unscored))


def _floats(value: Any, where: str) -> list[float]:
    """``value`` (a list of numbers, or a 1-D tensor or array) as finite floats."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        if getattr(value, "ndim", 1) != 1:
            raise InvalidArgumentType(f"{where} must be 1-D (one value per token), got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidArgumentType(f"{where} must be a list of numbers, got {_describe(value)}")
    out = []
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidArgumentType(f"{where}[{k}] must be a number, got {_describe(v)}")
        if not math.isfinite(v):
            raise InvalidArgument(f"{where}[{k}] is {v}; every value must be finite (nothing was sent, no weight "
                                  "changed)")
        out.append(float(v))
    return out


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"[:80]
