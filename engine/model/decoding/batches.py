"""The batches llmrl's decoding loop runs a ``generate`` request in.

Hugging Face's ``generate`` repeats each prompt ``num_return_sequences`` times and prefills every copy, so its
batches are bounded like a forward pass: rows x (prompt + new tokens) within the LLM's ``token_budget``. The loop
prefills each prompt once and then feeds one token per row, so its batches have two different bounds: the prefill,
each prompt once, within ``token_budget``; and the key/value cache, rows x (prompt + new tokens) entries, within
``generation.cache_mb`` (at the model's bytes per cached token). Rows stay within ``max_rows`` (the LLM's
``minibatch_size``, or the request's). On a GPU a decode step costs about the same for 8 rows as for 64: with the
forward pass's bound, a group of 8 x 8 samples of 512 tokens ran as eight batches of 8 rows.

A prompt whose own ``num_return`` rows exceed the bounds (128 samples of one prompt, or a cache too small for its
rows) is cut into runs of its rows, near-equal, each a batch of its own with its own prefill
(:func:`split_prompt_rows`): so a batch is a list of prompts and the rows each one returns in it.

This module plans; it runs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Batch = tuple[list[int], int]  # prompt indices, and the rows (samples) each of them returns in this batch


def cache_bytes_per_token(config, element_size: int) -> int:
    """Bytes of keys and values one token occupies in every layer of a Hugging Face model of ``config``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * element_size


def decode_batches(lengths: list[int], new_tokens: int, num_return: int, token_budget: int, max_rows: int,
                   cache_tokens: int) -> list[Batch]:
    """Prompt indices grouped (longest first) so that each group's prefill (prompts x widest) stays within
    ``token_budget``, its rows within ``max_rows`` and its cache (rows x (widest + new_tokens)) within
    ``cache_tokens``; a prompt alone always forms a group, whose rows are cut in runs where they alone exceed the
    rows or the cache (:func:`split_prompt_rows`)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for i in order:
        wider = max(widest, lengths[i], 1)
        prompts = len(current) + 1
        rows = prompts * num_return
        if current and (prompts * wider > token_budget or rows > max_rows
                        or rows * (wider + new_tokens) > cache_tokens):
            groups.append(current)
            current, wider = [], max(lengths[i], 1)
        current.append(i)
        widest = wider
    if current:
        groups.append(current)
    return split_prompt_rows(groups, num_return,
                             lambda i: min(max_rows, cache_tokens // (max(lengths[i], 1) + new_tokens)))


def split_prompt_rows(groups: list[list[int]], num_return: int, rows_allowed: Callable[[int], int]) -> list[Batch]:
    """Each group with ``num_return`` rows per prompt, except a group of one prompt ``i`` whose rows exceed
    ``rows_allowed(i)`` (at least 1 is always allowed): its rows are cut into the fewest near-equal runs within it,
    in order, each a batch."""
    out: list[Batch] = []
    for group in groups:
        allowed = max(1, rows_allowed(group[0])) if len(group) == 1 else num_return
        if num_return <= allowed:
            out.append((group, num_return))
            continue
        runs = -(-num_return // allowed)
        out += [(group, num_return // runs + (1 if k < num_return % runs else 0)) for k in range(runs)]
    return out
