"""Stop conditions of generation: ``stop`` strings and token-id sequences, where each sequence stopped, and why.

``generate(..., stop=...)`` takes a string, a token id, a list of token ids, or a list mixing those (strings and
token-id sequences). Strings are matched by Hugging Face's own ``StopStringCriteria`` (as
``generate(stop_strings=...)`` uses, so the texts are the same as Hugging Face's: a string counts once it overlaps
the last generated token); token-id sequences match when the generated tokens (never the prompt's) end with them.
:class:`StopRecorder` wraps them as one stopping criterion and remembers, per row, the step at which a stop first
matched: that token is the sequence's last (the stop text stays in the returned tokens), even where Hugging Face
goes on appending padding, or EOS when EOS is the pad token.
:func:`which_stop` names the stop that matched, for the sample's ``stop`` entry.

This module decides where sequences end; it does not run the model (:mod:`llmrl.engine.model.generation` does).
"""

from __future__ import annotations

import numbers

import torch
from transformers import StoppingCriteria
from transformers.generation.stopping_criteria import StopStringCriteria


def parse_stop(value) -> tuple[list[str], list[list[int]]]:
    """``(strings, token_sequences)`` of a ``stop`` argument. Raises ValueError naming what is wrong."""
    if value is None:
        return [], []
    items = [value] if isinstance(value, (str, numbers.Integral)) else value
    if not isinstance(items, (list, tuple)) or (items and all(_is_id(v) for v in items)):
        items = [items] if isinstance(items, (list, tuple)) else None  # a list of ids is one token sequence
    if items is None:
        raise ValueError(f"stop must be a string, a token id, a list of token ids, or a list of those; got "
                         f"{type(value).__name__}")
    strings, sequences = [], []
    for k, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"stop[{k}] is an empty string")
            strings.append(item)
        elif _is_id(item):
            sequences.append([int(item)])
        elif isinstance(item, (list, tuple)) and item and all(_is_id(t) for t in item):
            sequences.append([int(t) for t in item])
        else:
            raise ValueError(f"stop[{k}] must be a string, a token id or a non-empty list of token ids; got {item!r}")
    return strings, sequences


def _is_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


class StopTokens(StoppingCriteria):
    """True for the rows whose generated tokens (those from position ``start`` on) end with one of ``sequences``."""

    def __init__(self, sequences: list[list[int]], start: int):
        self.sequences = [torch.tensor(s, dtype=torch.long) for s in sequences]
        self.start = start

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for seq in self.sequences:
            if input_ids.shape[1] - self.start >= len(seq):
                done |= (input_ids[:, -len(seq):] == seq.to(input_ids.device)).all(dim=1)
        return done


class StopRecorder(StoppingCriteria):
    """The stop criteria of one generate call, recording per row the first step (0: the first generated token) at
    which one matched."""

    def __init__(self, tokenizer, strings: list[str], sequences: list[list[int]], rows: int, start: int):
        self.criteria = ([StopStringCriteria(tokenizer=tokenizer, stop_strings=strings)] if strings else []) + (
            [StopTokens(sequences, start)] if sequences else [])
        self.stopped_at: list[int | None] = [None] * rows
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self.criteria:
            done |= criterion(input_ids, scores).to(done.device)
        for row in torch.nonzero(done).flatten().tolist():
            if row < len(self.stopped_at) and self.stopped_at[row] is None:
                self.stopped_at[row] = self.step
        self.step += 1
        return done


def which_stop(tokenizer, tokens: list[int], strings: list[str], sequences: list[list[int]], prompt=()):
    """The stop string (or token-id list) that ended ``tokens``: a token sequence they end with, else the string
    whose match ends nearest the end of their text; None when none does. A string may begin in ``prompt`` (the
    causal prompt's ids), as Hugging Face's stop strings match: the text searched starts with the prompt's last
    tokens, and a match must end in the generated text."""
    for seq in sequences:
        if tokens[-len(seq):] == seq:
            return seq if len(seq) > 1 else seq[0]
    if not strings:
        return None
    tail = list(prompt)[-max(len(s) for s in strings):] if len(prompt) else []
    before = len(tokenizer.decode(tail, skip_special_tokens=False)) if tail else 0
    text = tokenizer.decode(tail + list(tokens), skip_special_tokens=False)
    found = [(text.rfind(s) + len(s), s) for s in strings if s in text and text.rfind(s) + len(s) > before]
    return max(found)[1] if found else None
