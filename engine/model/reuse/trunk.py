"""Frozen-trunk reuse: the hidden states entering the first trainable layer, kept from scoring for the update.

With LoRA on the top k layers (or the ``freeze`` initializer), every layer below the first trainable one computes
exactly the same thing before and after every update, and adapters never touch it. The rollout's ``score``
calls already ran those layers over the very contexts and candidates that ``update()`` trains on. :class:`Trunk`
keeps, per token path (the token ids from the start of the sequence), the hidden state entering layer
``depth`` in a radix tree (:class:`~llmrl.engine.model.reuse.prefix_cache.PrefixKVCache`, LRU under its own cap), and
during the updater's forward passes replaces the layers below ``depth`` by a pass-through: the state entering
layer ``depth`` is taken from the tree, so forward and backward run through the trainable top only.

A model call is replayed only when the tree holds the state of *every* token the call computes; otherwise it runs whole,
as without reuse, and what it computed is recorded: the trunk of an update over generated tokens is computed once, by
its first pass, or not at all when this LLM generated them: llmrl's decoding loop keeps the states of its prompts and
sampled tokens (:meth:`Trunk.record_decoded`). Replay is off for passes that ask for hidden states of the bottom layers
(they are not computed), and the skipped layers still add a placeholder to the key/value cache so that the cache length
the model derives positions and masks from stays right. The states never need invalidating: what they depend on never
changes. Supported: decoder-only models whose layers sit where their family's record says (``trunk_layers``:
``<model>.model.layers`` unless it says otherwise, :mod:`~llmrl.engine.model.families`) and take the hidden states as
first argument (Llama, Qwen2, Mistral, SmolLM, ...), ZeRO stages 0-2, no tensor parallelism (checked by the backend).

Every model call of a scoring pass goes through :func:`make_caller`, told which token paths each row of the call
computes (:class:`TrunkRow`, built by :func:`common_rows`, :func:`own_rows`, :func:`candidate_rows`); without a
trunk it is the plain model call. This module runs no request and plans no batch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from llmrl.engine.model.families import family_of
from llmrl.engine.model.reuse.hf_kv import cache_kwarg, cache_of, layer_cache
from llmrl.engine.model.reuse.prefix_cache import PrefixKVCache
from llmrl.engine.model.token_adapters import MIXED, routing_of


class TrunkRow(NamedTuple):
    """One token path a model call computes part of."""

    row: int  # the row of the call's input holding those tokens
    path: Sequence[int]  # token ids from the start of the sequence up to the last token this call computes of it
    start: int  # where this call's part of the path starts
    columns: Sequence[int]  # the columns of that part in the row
    adapter: str | None = None  # the LoRA adapter its tokens run on, in a pass mixing adapters (token_adapters)


def common_rows(ctxs, common: int) -> list[TrunkRow]:
    """The pass over the prefix every context of a batch shares (one row)."""
    return [TrunkRow(0, ctxs[0].prefix[:common], 0, list(range(common)), shared_adapter(ctxs))]


def shared_adapter(ctxs) -> str | None:
    """The adapter of a pass every context of ``ctxs`` shares: theirs, or :data:`MIXED` where they differ."""
    adapters = {c.adapter for c in ctxs}
    return adapters.pop() if len(adapters) == 1 else MIXED


def own_rows(ctxs, starts: list[int], remainders: list[list[int]], width: int) -> list[TrunkRow]:
    """A left padded pass over each context's prefix after ``starts[a]`` tokens (``remainders[a]``)."""
    return [TrunkRow(a, c.prefix, start, list(range(width - len(rest), width)) if rest else [], c.adapter)
            for a, (c, start, rest) in enumerate(zip(ctxs, starts, remainders))]


def candidate_rows(ctxs, inputs: list[list[int]], contexts: list[int]) -> list[TrunkRow]:
    """A right padded pass over candidate rows ``inputs[r]``, each after the prefix of ``ctxs[contexts[r]]``."""
    return [TrunkRow(r, ctxs[a].prefix + inputs[r], len(ctxs[a].prefix), list(range(len(inputs[r]))),
                     ctxs[a].adapter) for r, a in enumerate(contexts)]


def make_caller(model, needs, trunk, replayable: bool, calls: Callable[[], list[list[TrunkRow]]]):
    """``call(rows, **kwargs)``: the model call, through the trunk when there is one. ``calls()`` lists the rows
    of every call the batch will make: it is replayed whole when the trunk holds every token they compute. A
    key/value cache given as ``cache`` reaches the model under the name its ``forward`` takes
    (:func:`~llmrl.engine.model.reuse.hf_kv.cache_kwarg`). A model hooked for a pass mixing LoRA adapters
    (:class:`~llmrl.engine.model.token_adapters.TokenAdapters`) is told each call's rows before it runs."""
    token_adapters = routing_of(model)
    if token_adapters is not None:
        plain = _plain_caller(model, needs, trunk, replayable, calls)

        def routed(rows, **kwargs):
            ids = kwargs["input_ids"]
            with token_adapters.model_call(rows, ids.shape, ids.device, kwargs.get("logits_to_keep", 0)):
                return plain(rows, **kwargs)

        return routed
    return _plain_caller(model, needs, trunk, replayable, calls)


def _plain_caller(model, needs, trunk, replayable: bool, calls):
    name = cache_kwarg(model)

    def named(kwargs: dict) -> dict:
        if name != "cache" and "cache" in kwargs:
            kwargs[name] = kwargs.pop("cache")
        return kwargs

    if trunk is None:
        return lambda rows, **kwargs: model(**named(kwargs))
    replay = (trunk.mode == "replay" and replayable and not (needs.hidden and trunk.reads_bottom(needs.layers))
              and trunk.available(calls()))
    return lambda rows, **kwargs: trunk.call(model, named(kwargs), rows, replay)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The index of the decoder layer a parameter or module ``name`` sits in (``...layers.<i>....``), or None."""
    found = _LAYER.search(name + ".")
    return int(found.group(1)) if found else None


def decoder_layers(model):
    """The model's list of decoder layers (under PEFT wrappers), or None when it is not where its family's record
    says (``trunk_layers``: ``model.layers`` for a model type no family claims; None, not served)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = family_of(base).trunk_layers
    if path is None:
        return None
    layers = base
    for name in path.split("."):
        layers = getattr(layers, name, None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0 else None


def trunk_depth(model) -> int:
    """The first layer whose computation can change: holding a trainable parameter or an adapter. 0 when the
    embeddings (or anything outside the layers but before them) are trainable."""
    depth = len(decoder_layers(model) or [])
    for name, param in model.named_parameters():
        adapter = "lora_" in name
        if not (param.requires_grad or adapter):
            continue
        found = _LAYER.search(name)
        if found is None:
            if "embed" in name or "wte" in name or "wpe" in name:
                return 0
            continue  # the final norm, the LM head: above every layer
        depth = min(depth, int(found.group(1)))
    return depth


class Trunk:
    """Hidden states entering layer ``depth``, recorded by any call that runs whole and replayed in the updater's
    passes."""

    def __init__(self, model, depth: int, cap_bytes: int):
        layers = decoder_layers(model)
        if layers is None or not 0 < depth < len(layers):
            raise ValueError(f"no frozen trunk to reuse (first trainable layer {depth})")
        self.layers = layers
        self.depth = depth
        hidden = model.config.get_text_config().hidden_size
        dtype = next(layers[depth].parameters()).dtype
        self.states = PrefixKVCache(cap_bytes, hidden * torch.tensor([], dtype=dtype).element_size())
        self.mode: str | None = None  # "record" while scoring, "replay" in the updater's passes (recording too)
        self.replayed_calls = 0
        self.whole_calls = 0
        self._captured: torch.Tensor | None = None
        self._replacement: torch.Tensor | None = None
        layers[depth].register_forward_pre_hook(self._enter_depth, with_kwargs=True)

    @contextlib.contextmanager
    def active(self, mode: str):
        self.mode = mode
        try:
            yield
        finally:
            self.mode, self._captured, self._replacement = None, None, None

    def _enter_depth(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if self._replacement is not None:
            hidden = self._replacement.to(hidden.dtype)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        if self.mode is not None:  # recorded while scoring, and by an updater's pass that runs whole
            self._captured = hidden.detach()
        return None

    def take_captured(self) -> torch.Tensor | None:
        """The states entering layer ``depth`` of the last model call made inside :meth:`active` (then forgotten)."""
        captured, self._captured = self._captured, None
        return captured

    def record_decoded(self, prompts: list[list[int]], prefill: torch.Tensor, fed: list[torch.Tensor],
                       generated: torch.Tensor, num_return: int, eos: set[int]) -> None:
        """Keep the states a decoding batch computed (llmrl's loop): ``prefill`` (prompts x width x hidden, left-padded:
        prompt ``p``'s states are its last ``len(prompts[p])`` columns), ``fed`` (per decode step, rows x 1 x hidden:
        the state of ``generated[r, k]`` fed back at step ``k``; row ``r`` continues prompt ``r // num_return``).
        Each row is kept up to its first EOS: the tokens an update scores after the prompt."""
        for p, prompt in enumerate(prompts):
            states = prefill[p, prefill.shape[1] - len(prompt):]
            self.states.insert(None, prompt, lambda i, j, states=states: [(states[None, i:j],)])
        if not fed:
            return
        steps = torch.cat(fed, dim=1)
        for r, tokens in enumerate(generated[:, :steps.shape[1]].tolist()):
            prompt = prompts[r // num_return]
            end = next((k + 1 for k, token in enumerate(tokens) if token in eos), len(tokens))
            start = len(prompt)
            if end == 0 or self.states.held(None, prompt) < start:
                continue
            row = steps[r, :end]
            self.states.insert(None, prompt + tokens[:end],
                               lambda i, j, row=row, start=start: [(row[None, i - start:j - start],)])

    # ------------------------------------------------------------------ one model call

    def reads_bottom(self, layers: Sequence[int]) -> bool:
        """Whether hidden states of these ``hidden_states`` indices come from the layers replay skips."""
        count = len(self.layers) + 1
        return any((layer % count) <= self.depth for layer in layers)

    def available(self, calls: Sequence[Sequence[TrunkRow]]) -> bool:
        """Whether the states of every token of every call are held (a batch is replayed whole or not at all: a
        replayed call leaves placeholders where the skipped layers' keys and values would be)."""
        return all(self.states.held(None, path) == len(path) for rows in calls for _, path, _, columns, _ in rows
                   if len(columns))

    def call(self, model, kwargs: dict, rows: Sequence[TrunkRow], replay: bool):
        """``model(**kwargs)``: replayed (``replay``, checked :meth:`available` first), or run whole and recorded,
        while scoring and in an updater's pass alike: an update's first pass over tokens no score call computed
        (generated continuations) records them, and its later passes (the reference with the adapters off, every
        epoch) replay. A row of the call's input may hold several paths (packed contexts and candidates)."""
        if replay:
            with self._replaying(rows, kwargs["input_ids"].shape):
                out = model(**kwargs)
            self.replayed_calls += 1
            return out
        if self.mode == "replay":
            self.whole_calls += 1
        self._captured = None
        out = model(**kwargs)
        if self._captured is not None:
            self._record(rows, self._captured)
        self._captured = None
        return out

    @contextlib.contextmanager
    def _replaying(self, rows, shape):
        """Model calls inside run the layers from ``depth`` up on the held states of ``rows`` (checked as held)."""
        self._replacement = self._lookup(rows, shape)
        if self._replacement is None:  # checked as held, and nothing is evicted while replaying
            raise RuntimeError("frozen-trunk reuse: states checked as held went missing")
        try:
            with self._skipping():
                yield
        finally:
            self._replacement = None

    def _lookup(self, rows, shape) -> torch.Tensor | None:
        """The states of the rows' tokens laid out as the call's input (``shape``), None if any is not held. Only
        each row's own tokens are copied, not the path before them (a candidate row's whole context)."""
        states = None
        for r, path, start, columns, _ in rows:
            if not len(columns):
                continue
            length, pieces = self.states.match_pieces(None, path)
            if length < len(path):
                return None
            own, at = [], 0
            for piece in pieces:
                held = piece[0][0][0]  # [tokens, hidden]
                if at + len(held) > start:
                    own.append(held[max(start - at, 0):])
                at += len(held)
            row = torch.cat(own) if len(own) > 1 else own[0]
            if states is None:
                states = row.new_zeros((shape[0], shape[1], row.shape[-1]))
            states[r, torch.as_tensor(columns, device=states.device)] = row
        return states

    def _record(self, rows, captured: torch.Tensor) -> None:
        for r, path, start, columns, _ in rows:
            if not len(columns):
                continue
            if start > 0 and self.states.held(None, path, limit=start) < start:
                continue  # the part before this call's tokens is not held: nothing to attach them to
            row = captured[r, torch.as_tensor(columns, device=captured.device)]
            self.states.insert(None, path, lambda i, j, row=row, start=start: [(row[None, i - start:j - start],)])

    @contextlib.contextmanager
    def _skipping(self):
        """Layers below ``depth`` pass their input through (adding a placeholder to the key/value cache)."""
        for index in range(self.depth):
            self.layers[index].forward = _pass_through(index)
        try:
            yield
        finally:
            for index in range(self.depth):
                del self.layers[index].forward

    def top_layers_kv(self, model, paths: list[list[int]], keep_logits: bool) -> list[list[tuple] | None]:
        """Keys and values of layers ``depth`` and up for each path (token ids from the start of a sequence),
        computed from the held states through those layers only, or None for a path whose states are not all
        held. This is how the cache across calls gets its top layers back after an update changed them
        (:meth:`~llmrl.engine.model.reuse.prefix_cache.PrefixKVCache.refresh`); no grad, one model call."""
        held = [self.states.held(None, p) == len(p) for p in paths]
        rows = [p for p, ok in zip(paths, held) if ok]
        if not rows:
            return [None] * len(paths)
        device = next(self.layers[self.depth].parameters()).device
        width = max(len(p) for p in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, p in enumerate(rows):
            ids[r, :len(p)] = torch.tensor(p)
            mask[r, :len(p)] = 1
        kwargs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "use_cache": True,
                  "position_ids": torch.arange(width, device=device)[None].expand(len(rows), -1)}
        if keep_logits:
            kwargs["logits_to_keep"] = 1
        spec = [TrunkRow(r, p, 0, list(range(len(p)))) for r, p in enumerate(rows)]
        with torch.no_grad(), self._replaying(spec, ids.shape):
            cache = cache_of(model(**kwargs))
        computed = iter(range(len(rows)))
        out: list[list[tuple] | None] = []
        for p, ok in zip(paths, held):
            if not ok:
                out.append(None)
                continue
            r = next(computed)
            out.append([(layer.keys[r, :, :len(p)], layer.values[r, :, :len(p)])
                        for layer in cache.layers[self.depth:]])
        return out

    def stats(self) -> dict:
        return {**self.states.stats(), "depth": self.depth, "replayed_calls": self.replayed_calls,
                "whole_calls": self.whole_calls}


def _pass_through(index: int):
    def forward(hidden_states, *args, **kwargs):
        cache = layer_cache(kwargs)
        if cache is not None:
            placeholder = hidden_states.new_zeros((hidden_states.shape[0], 1, hidden_states.shape[1], 1))
            cache.update(placeholder, placeholder, index)
        return hidden_states
    return forward
