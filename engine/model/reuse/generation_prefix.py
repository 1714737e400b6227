"""The cache across calls in text generation: a prompt's held prefix is not encoded again, and what a call encoded and
generated is held for the next turn.

In a multi-turn episode each prompt is the previous prompt, the tokens the model sampled and the environment's reply.
:func:`cached_past` reads, for every prompt of a left-padded batch, its longest held prefix (never its last token,
so every prompt's first logits come from a real pass; entries that an update left stale are a miss) and lays the
keys and values into one Hugging Face cache that covers the first ``C`` columns of every row: ``C`` is the smallest
``padding + held tokens`` over the rows, so a row's covered columns are its padding (zeros, masked out) and the
start of its held prefix. ``generate`` then encodes only the columns after ``C``; positions come from the attention
mask, as the held keys were computed at the same positions (each prompt alone, from 0). :func:`keep_generated`
holds each row's prompt and the tokens it generated but the last (whose keys were never computed), read from the
cache ``generate`` returned, so the next turn's prompt finds them.

Counted in :attr:`PrefixKVCache.generation` (reported with the cache's statistics): prompts, prompt tokens and
prompt tokens encoded. This module decides which columns are reused; the cache is
:class:`~llmrl.engine.model.reuse.prefix_cache.PrefixKVCache`, the generation loop :mod:`llmrl.engine.model.generation`.
"""

from __future__ import annotations

from llmrl.engine.model.reuse.hf_kv import as_cache, empty_layers, lay_pieces


def cached_past(use, prompts: list[list[int]], repeat: int, repeat_rows: bool = True):
    """``(cache, covered)``: a Hugging Face cache holding the first ``covered`` columns of every row of the
    left-padded batch of ``prompts`` (each row repeated ``repeat`` times, in order; with ``repeat_rows`` False,
    each prompt once, for a loop that prefills a prompt once for its ``repeat`` samples), or ``(None, 0)`` when no
    column can be reused. Counts the prompt tokens that will be encoded."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    held = [_fresh_match(use, p) for p in prompts]
    covered = min(pad + hit for pad, (hit, _) in zip(pads, held))
    counts = use.cache.generation
    counts["prompts"] += len(prompts) * repeat
    counts["prompt_tokens"] += sum(len(p) for p in prompts) * repeat
    counts["encoded_tokens"] += sum(len(p) - max(0, covered - pad) for p, pad in zip(prompts, pads)) * \
        (repeat if repeat_rows else 1)
    if covered == 0:
        return None, 0
    sample = next(pieces[0] for hit, pieces in held if hit)
    layers = empty_layers(sample, len(prompts), covered)
    for layer, (keys, values) in enumerate(layers):
        for row, (pad, (_, pieces)) in enumerate(zip(pads, held)):
            if covered > pad:
                lay_pieces(keys, values, row, pad, covered, pieces, layer)
    if repeat > 1 and repeat_rows:
        layers = [(k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)) for k, v in layers]
    return as_cache(layers), covered


def keep_generated(use, rows: list[tuple[int, list[int], list[int]]], past, width: int) -> None:
    """Hold, for each ``(row, prompt, tokens)`` (a row of the batch ``generate`` returned ``past`` for, its prompt,
    and the generated tokens kept for it), the prompt and every kept token but the last. ``width`` is the batch's
    padded prompt width."""
    for row, prompt, tokens in rows:
        first = width - len(prompt)  # the row's first real column

        def kv_of(i, j, row=row, first=first):
            return [(layer.keys[row][:, first + i:first + j], layer.values[row][:, first + i:first + j])
                    for layer in past.layers]

        use.cache.insert(use.namespace, list(prompt) + list(tokens[:-1]), kv_of)


def _fresh_match(use, prompt: list[int]) -> tuple[int, list]:
    """The held prefix of ``prompt`` (at most all tokens but the last) up to its first stale entry."""
    limit = len(prompt) - 1
    usable = use.cache.fresh_length(use.namespace, prompt, limit)
    if usable == 0:
        return 0, []
    return use.cache.match_pieces(use.namespace, prompt, usable)
