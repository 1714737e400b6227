"""The module DeepSpeed wraps: the Hugging Face model and its heads, whose forward runs one planned request.

:class:`ModelWithHeads` takes a token plan and its planned batches, runs them
(:func:`llmrl.engine.model.scoring.run.run_batch`), puts candidates and contexts back in request order and
runs the requested heads on the result (each with the per-call keyword arguments its ``forward`` accepts, and the
logits after each context when one asks, :mod:`llmrl.engine.model.scoring.context_logits`), checking
that each head's output has its level's first dimension. It returns one typed result, the
:class:`~llmrl.plugins.contracts.ForwardOutputs` that heads and updaters read. One engine call covers
one request batch or one training micro-batch, so DeepSpeed's hooks (ZeRO-3 gathering, gradient
reduction) see a single forward.

This module does not plan, tokenise or talk to anyone.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from llmrl.engine.errors import plugin_error
from llmrl.engine.graph import graph_zero, plus_zero
from llmrl.engine.model.scoring.context_logits import context_logits
from llmrl.engine.model.scoring.planning import BatchSpec, Needs
from llmrl.engine.model.scoring.results import cat_long
from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
from llmrl.engine.model.scoring.tokenization import TokenPlan
from llmrl.engine.model.scoring.vocab_chunks import applies, hidden_instead_of_logits
from llmrl.engine.model.token_adapters import routing_of
from llmrl.plugins.contracts import ForwardOutputs


class ModelWithHeads(torch.nn.Module):
    """The served model and its heads; ``forward`` scores a planned request and runs the named heads."""

    def __init__(self, model, heads: dict, kind: str, pad_id: int, start_id: int | None,
                 head_plugins: dict[str, str] | None = None):
        super().__init__()
        self.model = model
        self.heads = torch.nn.ModuleDict(heads)
        self.head_plugins = dict(head_plugins or {})
        self.kind = kind
        self.pad_id = pad_id
        self.start_id = start_id
        self.keep_logits = kind == "causal" and accepts_logits_to_keep(model)
        self.prefix_cache = None  # a CacheUse during no-grad scoring with llms.<name>.kv_cache_mb (see forward)
        self.trunk = None  # a Trunk with llms.<name>.trunk_reuse_mb (see llmrl.engine.model.reuse.trunk)
        self.update_pass = False  # set around the updater's passes: they read log-probs from hidden states in chunks

    def forward(self, plan: TokenPlan, batches: list[BatchSpec], needs: Needs, head_keys: tuple = (),
                extra_calls: int = 0, anchor: torch.Tensor | None = None, head_kwargs: dict | None = None,
                source: list[int] | None = None) -> ForwardOutputs:
        """Run the batches, put results in request order, run the heads (``head_kwargs``: the call's keyword
        arguments for them). ``plan`` holds the contexts computed; ``source`` (None: the request's contexts are
        ``plan``'s) gives, for each context of the request, its index in ``plan`` (twins are computed once and
        their outputs handed to every copy, see :func:`llmrl.engine.model.forward.distinct_contexts`).
        ``anchor`` (a zero that depends on every trainable weight, see
        :func:`llmrl.engine.model.forward.gradient_anchor`) is added to every output, so any loss reaches every
        weight. ``self.prefix_cache``, set around no-grad scoring calls only, is the cache that lives across calls
        (an attribute, not an argument: DeepSpeed's tensor-parallel check pickles and compares every argument,
        and each tensor-parallel rank holds its own share of the keys)."""
        device = self.device
        chunked = self.update_pass and applies(self.model, needs.token_logits)
        with hidden_instead_of_logits(self.model) if chunked else contextlib.nullcontext():
            results = [run_batch(self.model, plan, b, needs, self.pad_id, device, self.keep_logits, self.start_id,
                                 prefix_cache=self.prefix_cache, trunk=self.trunk) for b in batches]
        # Put candidates (and contexts) back in request order: batch order -> computed order -> request order.
        ctx_order = [i for b in batches for i in b.contexts]
        starts = _candidate_starts(plan)
        cand_order = [starts[i] + j for i in ctx_order for j in range(len(plan.contexts[i].candidates))]
        source = range(len(plan.contexts)) if source is None else source
        wanted = [starts[u] + j for u in source for j in range(len(plan.contexts[u].candidates))]
        n_cand, n_ctx = len(wanted), len(source)
        cand_perm = _inverse(cand_order, starts[-1], device)[torch.tensor(wanted, dtype=torch.long, device=device)]
        ctx_perm = _inverse(ctx_order, len(plan.contexts), device)[torch.tensor(list(source), dtype=torch.long,
                                                                                device=device)]
        scores = _cat([r.scores for r in results], (0,), device)[cand_perm] if n_cand else torch.zeros(0, device=device)
        counts = cat_long([r.counts for r in results])[cand_perm.cpu()]
        context_of = torch.tensor([i for i, u in enumerate(source) for _ in plan.contexts[u].candidates],
                                  dtype=torch.long)
        tokens = _tokens_in_request_order(results, cand_order, wanted, device) if needs.per_token else {}
        # Zeros that tie every output to the lockstep padding calls and to every trainable weight (see forward.py).
        routing = routing_of(self.model)  # a pass mixing adapters: padding calls run on the base weights
        with routing.throwaway() if routing is not None else contextlib.nullcontext():
            tie = graph_zero(self._throwaway_calls(extra_calls)) if extra_calls else None
        if anchor is not None:
            tie = anchor if tie is None else tie + anchor
        if tie is not None:
            scores = scores + tie
            tokens = {k: plus_zero(v, tie) if k not in ("token_candidate", "token_ids") else v
                      for k, v in tokens.items()}
        context_hidden = (self._layers([r.context_hidden for r in results], needs.layers, ctx_perm)
                          if needs.context_hidden else None)
        candidate_hidden = (self._layers([r.candidate_hidden for r in results], needs.layers, cand_perm)
                            if needs.candidate_hidden else None)
        if anchor is not None:
            context_hidden, candidate_hidden = plus_zero(context_hidden, anchor), plus_zero(candidate_hidden, anchor)
        logits = None
        if any(getattr(self.heads[k], "needs_context_logits", False) for k in head_keys):
            logits = context_logits(self.model, context_hidden[-1])
        outputs = ForwardOutputs(
            kind=self.kind, num_contexts=n_ctx, candidate_scores=scores, candidate_token_counts=counts,
            candidate_context=context_of.to(device),
            context_hidden=None if context_hidden is None else context_hidden[-1],
            candidate_hidden=None if candidate_hidden is None else candidate_hidden[-1],
            heads={}, head_levels={}, context_hidden_layers=context_hidden, candidate_hidden_layers=candidate_hidden,
            context_logits=logits, **tokens)
        unread = sorted(set(head_kwargs or {}) - {k for key in head_keys for k in _accepted(self.heads[key],
                                                                                          head_kwargs)})
        if unread:  # a misspelt argument would leave its head on its default without a word
            raise ValueError(f"head_kwargs {unread} are read by none of the heads {list(head_keys)}; their forward "
                             f"takes {sorted({k for key in head_keys for k in _named(self.heads[key])})}; check the "
                             "spelling")
        for key in head_keys:
            head = self.heads[key]
            plugin = self.head_plugins.get(key, type(head).__name__)
            try:
                value = head(outputs, **_accepted(head, head_kwargs or {}))
            except BaseException as err:  # sys.exit() in a head too: an error of this request, not the rank's end
                raise plugin_error(f"head {key!r} ({plugin}) failed: {type(err).__name__}: {err}", plugin) from err
            level = type(head).level
            _check_head_output(key, plugin, level, value, _rows_of_level(outputs, level))
            outputs.heads[key] = value
            outputs.head_levels[key] = level
        return outputs

    def _layers(self, parts: list[dict | None], layers, perm: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per layer, the batches' hidden states concatenated and put in request order."""
        device = perm.device
        return {layer: _cat([p[layer] for p in parts if p is not None], (0, self.hidden_size), device)[perm]
                for layer in layers}

    def _throwaway_calls(self, n: int) -> torch.Tensor:
        """Model calls whose results count for nothing (lockstep padding); returns a 0-weighted sum."""
        total = torch.zeros((), device=self.device)
        token = torch.tensor([[self.pad_id]], device=self.device)
        for _ in range(n):
            if self.kind == "seq2seq":
                start = torch.tensor([[self.start_id]], device=self.device)
                logits = self.model(input_ids=token, decoder_input_ids=start).logits
            else:
                logits = self.model(input_ids=token).logits
            total = total + logits.float().sum()
        return total

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size


def _candidate_starts(plan: TokenPlan) -> list[int]:
    starts, total = [], 0
    for c in plan.contexts:
        starts.append(total)
        total += len(c.candidates)
    return starts + [total]


def _tokens_in_request_order(results, cand_order: list[int], wanted: list[int], device) -> dict:
    """The batches' per-token outputs as flat tensors sorted by (candidate in request order, position).
    ``cand_order``: the computed candidate of each batch candidate; ``wanted``: that of each request candidate
    (a computed candidate may serve several)."""
    parts = [r.tokens for r in results]
    bases, total = [], 0
    for r in results:
        bases.append(total)
        total += len(r.counts)
    hidden = parts[0].hidden if parts else None
    logits = parts[0].logits if parts else None
    concat = (torch.cat([p.candidate + base for p, base in zip(parts, bases)]) if parts
              else torch.zeros(0, dtype=torch.long))
    candidate = torch.tensor(cand_order, dtype=torch.long)[concat] if len(concat) else concat
    position = cat_long([p.position for p in parts])
    order = torch.argsort(candidate * (int(position.max()) + 1 if len(position) else 1) + position)
    if wanted != list(range(len(cand_order))):  # each request candidate takes the tokens of its computed one
        wanted_t = torch.tensor(wanted, dtype=torch.long)
        per = torch.bincount(candidate, minlength=len(cand_order))
        first = torch.cumsum(per, 0) - per
        lengths = per[wanted_t]
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        order = order[torch.repeat_interleave(first[wanted_t], lengths) + within]
        candidate = torch.repeat_interleave(torch.arange(len(wanted)), lengths)
    else:
        candidate = candidate[order]
    dev_order = order.to(device)
    logprobs = _cat([p.logprobs for p in parts], (0,), device)[dev_order]
    entropy = None
    if parts and parts[0].entropy is not None:
        entropy = _cat([p.entropy for p in parts], (0,), device)[dev_order]
    if hidden is not None:
        hidden = {layer: torch.cat([p.hidden[layer].to(device) for p in parts])[dev_order] for layer in hidden}
    if logits is not None:
        logits = torch.cat([p.logits.to(device) for p in parts])[dev_order]
    return {"token_logprobs": logprobs, "token_candidate": candidate.to(device),
            "token_ids": cat_long([p.ids for p in parts])[order].to(device),
            "token_entropy": entropy, "token_hidden": None if hidden is None else hidden[-1],
            "token_hidden_layers": hidden, "token_logits": logits}


def _accepted(head, kwargs: dict) -> dict:
    """The keyword arguments ``head.forward`` accepts: all of them with ``**kwargs``, else those it names."""
    if not kwargs:
        return {}
    params = inspect.signature(head.forward).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return kwargs
    names = _named(head)
    return {k: v for k, v in kwargs.items() if k in names}


def _named(head) -> set[str]:
    """The keyword arguments ``head.forward`` names (besides the outputs)."""
    params = inspect.signature(head.forward).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"outputs"}


def _rows_of_level(outputs: ForwardOutputs, level: str) -> int:
    if level == "context":
        return outputs.num_contexts
    if level == "candidate":
        return len(outputs.candidate_scores)
    return len(outputs.token_logprobs)


def _check_head_output(key: str, plugin: str, level: str, value, rows: int) -> None:
    """Refuse a head output that is not a tensor (or a dict of tensors) whose first dimension is ``rows``."""
    items = value.items() if isinstance(value, dict) else [(None, value)]
    if isinstance(value, dict) and not value:
        raise plugin_error(f"head {key!r} ({plugin}) returned an empty dict; return a tensor or a dict of tensors",
                           plugin)
    for name, tensor in items:
        where = f"head {key!r} ({plugin}) output" + ("" if name is None else f"[{name!r}]")
        if not isinstance(tensor, torch.Tensor):
            raise plugin_error(f"{where} is a {type(tensor).__name__}; forward must return a tensor or a dict of "
                               "tensors", plugin)
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise plugin_error(f"{where} has shape {tuple(tensor.shape)}; a head of level {level!r} (its `level` "
                               f"attribute) returns {rows} row(s) here: one per {level} of the pass", plugin)


def _inverse(order: list[int], n: int, device) -> torch.Tensor:
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return inverse.to(device)


def _cat(parts, empty_shape, device) -> torch.Tensor:
    """Float parts (None ones skipped) concatenated on ``device``; zeros of ``empty_shape`` when there is none.
    (CPU token ids, positions and counts use :func:`~llmrl.engine.model.scoring.results.cat_long`.)"""
    parts = [p for p in parts if p is not None]
    if not parts:
        return torch.zeros(empty_shape, device=device, dtype=torch.float32)
    return torch.cat([p.to(device) for p in parts])
