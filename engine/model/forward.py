"""One forward pass of a request on one rank: tokenise and plan, agree with the other replicas when they must
move together, run the engine.

:func:`plan_forward` turns contexts, candidates and head keys into a :class:`ForwardPlan` (token plan, batches over
its distinct contexts, and the number of model calls, decided once by the planner); it may raise on bad input (an
input too long, an unknown head or adapter). :func:`plan_and_agree` plans, then takes the one collective step: when
the replicas of an LLM must make the same calls (ZeRO-3 lockstep, or every training forward), each rank says whether
its plan succeeded and how many calls it needs, in a single vote, so that a rank whose input was bad never leaves
the others waiting inside a collective. :func:`run_forward` calls the engine (the module DeepSpeed wraps), padded
with throw-away calls up to the agreed number.

The same path serves ``score`` / ``custom_module_fns`` (without gradients) and the updater's
``trainer.forward`` (with gradients). It knows nothing about sockets or request kinds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from llmrl.engine.errors import PeerAborted
from llmrl.engine.model.cpu_matmul import frozen_linears
from llmrl.engine.model.scoring.planning import BatchSpec, Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import TokenPlan, tokenize
from llmrl.engine.model.served import ServedModel
from llmrl.plugins.contracts import ForwardOutputs


@dataclass
class ForwardPlan:
    plan: TokenPlan  # the request's contexts, in its order
    batches: list[BatchSpec]  # over ``computed``
    needs: Needs
    heads: tuple[str, ...]
    adapter: str | None
    head_kwargs: dict | None = None  # the call's keyword arguments for the heads
    computed: TokenPlan | None = None  # the distinct contexts (None: ``plan`` itself, every context distinct)
    source: list[int] | None = None  # for each request context, its index in ``computed``
    mixed: tuple[str, ...] | None = None  # contexts naming their own adapters: every adapter of the whole call

    @property
    def model_calls(self) -> int:
        return sum(b.model_calls for b in self.batches)


def plan_forward(served: ServedModel, contexts, candidates, heads=(), adapter: str | None = None,
                 minibatch_size: int | None = None, *, per_token: bool = False, entropy: bool = False,
                 add_eos: bool = False, head_kwargs: dict | None = None, prefix_cache=None, logits: bool = False,
                 logprobs: bool = True) -> ForwardPlan:
    """Tokenise and plan a forward pass; raises ValueError on bad input (nothing has run yet). ``per_token`` /
    ``entropy`` keep per-token log-probs / entropies (they change no model call); ``logits`` keeps each scored token's
    logits (``token_logits``); ``logprobs=False`` computes no log-prob (NaN in their place: a pass read for its heads
    and token counts only); ``add_eos`` ends candidates
    with the EOS token; ``head_kwargs`` go to the heads; ``prefix_cache`` (the cache across calls the pass will read)
    lets the planner drop a pass over a common prefix the cache already holds."""
    keys = served.check_heads(heads)
    if head_kwargs is not None and not (isinstance(head_kwargs, dict) and all(isinstance(k, str) for k in head_kwargs)):
        raise ValueError(f"head_kwargs must be a dict with string keys, got {type(head_kwargs).__name__}")
    adapter, mixed = _adapters(served, adapter, len(contexts))
    if entropy and not per_token:
        raise ValueError("entropy=True needs per_token=True (entropies are given per token)")
    if not logprobs and (entropy or logits):
        raise ValueError("logprobs=False computes no distribution: it cannot give entropy or logits")
    needs = served.needs_for(keys)
    needs = replace(needs, per_token=per_token or logits or needs.per_token, entropy=entropy,
                    token_logits=logits or needs.token_logits, logprobs=logprobs)
    llm = served.llm
    reuse = shares_contexts(served)
    plan = tokenize(served.tokenizer, llm.type, contexts, candidates, max_length=served.max_length,
                    prefix_reuse=reuse, add_eos=add_eos, vocab_size=served.info.vocab_size)
    if mixed is not None:
        for ctx, name in zip(plan.contexts, mixed.names):
            ctx.adapter = name
    cached = None
    if prefix_cache is not None and mixed is None:
        namespace = adapter or served.active_adapter()
        cached = lambda ids: prefix_cache.held(namespace, ids)  # noqa: E731
    computed, source = distinct_contexts(plan) if not served.model.training else (None, None)  # see its docstring
    batches = plan_batches(computed or plan, llm.token_budget, minibatch_size or llm.minibatch_size, needs,
                           encoder_reuse=reuse, cached=cached, **packing(served))
    return ForwardPlan(plan, batches, needs, keys, adapter, head_kwargs or None, computed, source,
                       mixed.call if mixed is not None else None)


def _adapters(served: ServedModel, adapter, contexts: int):
    """A pass's ``adapter`` (a name or None, or a :class:`~llmrl.engine.model.token_adapters.ContextAdapters`) as
    (the adapter to activate, the contexts' adapters or None), checked: every name known, one per context, and no
    weight snapshot (it swaps in a whole set of weights) among other adapters."""
    from llmrl.engine.adapter_names import ContextAdapters

    if not isinstance(adapter, ContextAdapters):
        served.check_adapter(adapter)
        return adapter, None
    if len(adapter.names) != contexts:
        raise ValueError(f"peft_adapter lists {len(adapter.names)} adapter name(s) for {contexts} sequence(s)")
    for name in adapter.call:
        served.check_adapter(name)
        if name in served.run_time.weight_snapshots:
            raise ValueError(f"peft_adapter names weight snapshot {name!r} among other adapters: a weight snapshot "
                             "(of a model without LoRA) swaps in a whole set of weights for a call; send its data in "
                             "a call of its own")
    unknown = {name for name in adapter.names if name is not None} - set(adapter.call)
    if unknown:
        raise ValueError(f"peft_adapter names {sorted(unknown)}, not among the call's adapters {list(adapter.call)}")
    return None, adapter


def plan_part(served: ServedModel, whole: ForwardPlan, part: TokenPlan) -> ForwardPlan:
    """The plan of a part of an already planned pass (``part``: some of its contexts and candidates, tokenised as
    in ``whole``), batched as :func:`plan_forward` batches, every context computed (no twin shared)."""
    llm = served.llm
    reuse = shares_contexts(served)
    batches = plan_batches(part, llm.token_budget, llm.minibatch_size, whole.needs, encoder_reuse=reuse,
                           **packing(served))
    return ForwardPlan(part, batches, whole.needs, whole.heads, whole.adapter, whole.head_kwargs, mixed=whole.mixed)


def distinct_contexts(plan: TokenPlan) -> tuple[TokenPlan | None, list[int] | None]:
    """The plan's distinct contexts (same token ids, same candidates) and, for each context, the index of its
    twin among them; ``(None, None)`` when all are distinct. A rollout of a small world repeats its states, and
    the model runs in evaluation mode (no dropout): twins get the very same outputs, so each is computed once
    and its outputs are handed to every copy (gradients of the copies add up, as they would if computed apart)."""
    index: dict[tuple, int] = {}
    source = []
    for ctx in plan.contexts:
        key = (tuple(ctx.ids), ctx.shared, tuple((tuple(c.rest), c.first_scored) for c in ctx.candidates),
               ctx.adapter)
        source.append(index.setdefault(key, len(index)))
    if len(index) == len(plan.contexts):
        return None, None
    first = {u: i for i, u in reversed(list(enumerate(source)))}
    return TokenPlan(plan.kind, [plan.contexts[first[u]] for u in range(len(index))]), source


def shares_contexts(served: ServedModel) -> bool:
    """Whether a context is encoded once for all its candidates (``prefix_reuse``): not under lockstep for a seq2seq
    model (it re-encodes per chunk: every call must be a whole-model call), nor for a model whose cache cannot repeat
    a context's rows (:func:`~llmrl.engine.model.attention_span.keeps_state_outside_attention`)."""
    from llmrl.engine.model.attention_span import keeps_state_outside_attention

    llm = served.llm
    return llm.prefix_reuse and not (llm.lockstep and llm.type == "seq2seq") \
        and not keeps_state_outside_attention(served.model.config)


def packs(served: ServedModel) -> bool:
    """Whether this LLM's passes pack contexts and candidates into one call (:mod:`llmrl.engine.model.scoring.packed`):
    causal models whose attention takes a custom 4-D mask, over the whole context on every layer
    (:func:`~llmrl.engine.model.attention_span.why_not_whole_context`)."""
    from llmrl.engine.model.attention_span import why_not_whole_context
    from llmrl.engine.model.scoring.packed import PACKABLE_ATTENTION

    attention = getattr(served.model.config, "_attn_implementation", None)
    return served.llm.type == "causal" and attention in PACKABLE_ATTENTION \
        and why_not_whole_context(served.model.config) is None


def packing(served: ServedModel) -> dict:
    """:func:`~llmrl.engine.model.scoring.planning.plan_batches`'s ``packed`` and ``attention`` for this LLM: whether it
    may pack (:func:`packs`) and, where it may, a layer's attention work per token and attended column relative to its
    linear work per token, with which the planner chooses between packed and unpacked passes (``packing_pays``)."""
    if not packs(served):
        return {"packed": False, "attention": 0.0}
    from llmrl.engine.model.scoring.packed import attention_per_column

    return {"packed": True, "attention": attention_per_column(served.model.config)}


def scored_token_counts(served: ServedModel, contexts, candidates, add_eos: bool = False) -> torch.Tensor:
    """Each candidate's number of scored tokens, as a forward pass with ``per_token`` counts them, from the
    tokenisation alone: no model call and no collective (long, CPU)."""
    if not contexts:
        return torch.zeros(0, dtype=torch.long)
    plan = plan_forward(served, contexts, candidates, per_token=True, add_eos=add_eos).plan
    return torch.tensor(plan.scored_counts(), dtype=torch.long)


def plan_and_agree(served: ServedModel, contexts, candidates, heads=(), adapter: str | None = None,
            minibatch_size: int | None = None, *, must_agree: bool, position: tuple[int, ...] = (),
            **options) -> tuple[ForwardPlan, int]:
    """Plan a forward pass, then, if ``must_agree``, vote with the LLM's other ranks before any collective.

    ``options`` are :func:`plan_forward`'s (``per_token``, ``entropy``, ``add_eos``, ``head_kwargs``, ``prefix_cache``).
    ``position`` goes with the vote (see :meth:`~llmrl.engine.server.group.GroupChannel.agree`).
    Returns the plan and the number of throw-away calls to add. Raises this rank's own planning error, or
    :class:`PeerAborted` when another rank's plan failed: every rank raises, none is left in a collective.
    """
    try:
        plan, error = plan_forward(served, contexts, candidates, heads, adapter, minibatch_size, **options), None
    except Exception as err:  # noqa: BLE001 - voted on, then re-raised
        plan, error = None, err
    if not must_agree:
        if error is not None:
            raise error
        return plan, 0
    calls = plan.model_calls if plan is not None else 0
    everyone_ok, most = served.group.agree(error is None, calls, position)
    if error is not None:
        raise error
    if not everyone_ok:
        raise PeerAborted(f"another rank of LLM {served.llm.name!r} refused its share of the request")
    return plan, most - calls


def run_forward(served: ServedModel, plan: ForwardPlan, extra_calls: int = 0, prefix_cache=None, *,
                trunk_mode: str | None = None, update_pass: bool = False) -> ForwardOutputs:
    """Run a planned forward pass through the engine (gradients follow the caller's grad mode). ``prefix_cache``, for
    no-grad scoring only, is the :class:`~llmrl.engine.model.reuse.prefix_cache.PrefixKVCache` that lives across calls:
    its namespace is the adapter the pass runs with. ``trunk_mode`` ("record" while scoring, "replay" in the
    updater's passes) drives the frozen-trunk reuse of an LLM with ``trunk_reuse_mb``."""
    if plan.mixed is not None:
        prefix_cache = None  # its entries are per adapter: a pass mixing them neither reads nor adds any
    if prefix_cache is not None:
        from llmrl.engine.model.reuse.prefix_cache import CacheUse

        prefix_cache = CacheUse(prefix_cache, plan.adapter or served.active_adapter())
    with served.adapter(plan.adapter), _routed(served, plan.mixed):
        anchor = gradient_anchor(served) if torch.is_grad_enabled() else None
        if served.llm.lockstep:
            forget_zero3_trace(served.engine)
        trunk = served.module.trunk
        served.module.prefix_cache = prefix_cache
        served.module.update_pass = update_pass
        try:
            with (trunk.active(trunk_mode) if trunk is not None and trunk_mode else contextlib.nullcontext(),
                  frozen_linears(served.module)):  # oneDNN's products where this rank uses it (cpu_matmul)
                return served.engine(plan=plan.computed or plan.plan, batches=plan.batches, needs=plan.needs,
                                     head_keys=plan.heads, extra_calls=extra_calls, anchor=anchor,
                                     head_kwargs=plan.head_kwargs, source=plan.source)
        finally:
            served.module.prefix_cache = None
            served.module.update_pass = False


@contextlib.contextmanager
def _routed(served: ServedModel, mixed: tuple[str, ...] | None):
    """Inside, a pass whose contexts name their own adapters (``mixed``: the whole call's) runs each token on its
    context's adapter (:mod:`llmrl.engine.model.token_adapters`)."""
    if mixed is None:
        yield
        return
    from llmrl.engine.model.token_adapters import TokenAdapters

    with TokenAdapters(mixed).hooked(served.module.model):
        yield


def forget_zero3_trace(engine) -> None:
    """Drop ZeRO-3's recorded order of submodules before a forward pass, on every replica alike.

    ZeRO-3 records the order in which submodules run and prefetches weights along it; when a pass deviates, the
    rank drops its record, and the next pass starts with a collective check that only the ranks without a record
    take. Our passes change shape with every request and differ between replicas, so records would be dropped
    on one replica and not another, and the replicas would wait on each other forever. Dropped before every
    pass on every replica, the record is always empty and the check always matches."""
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    coordinator = offload.get_param_coordinator() if hasattr(offload, "get_param_coordinator") else None
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()


def gradient_anchor(served: ServedModel) -> torch.Tensor | None:
    """A zero that depends on every trainable weight, made before the forward pass and added to its outputs.

    Under ZeRO-2 each replica hands its gradients to DeepSpeed as they become ready and DeepSpeed packs them
    into reduction buckets in that order, so replicas whose forward passes differ in shape (a replica with
    two contexts sharing a prefix, another with one) would sum different weights' gradients together. Made
    first, the anchor's backward runs last: every weight's gradient becomes ready at the very end of backward,
    in the same order on every replica, whatever the shape of the pass. (ZeRO-3 partitions the weights
    themselves and reduces per module; the anchor is not needed, nor possible, there.)

    Its value is exactly 0 and its gradient exactly 0 whatever the weights hold: it reaches every adapter's
    weights, and one adapter's NaN (``NaN * 0`` is NaN) must reach no other adapter's loss or gradients.
    """
    if served.engine.zero_optimization_partition_weights():
        return None
    weights = [p for p in served.module.parameters() if p.requires_grad]
    if not weights:
        return None
    return _ExactZero.apply(*(p.reshape(-1)[:1] for p in weights))


class _ExactZero(torch.autograd.Function):
    """A zero tied to its inputs: the value 0 and zero gradients, whatever the inputs or the incoming gradient hold."""

    @staticmethod
    def forward(ctx, *values):
        ctx.like = [(v.shape, v.dtype, v.device) for v in values]
        return torch.zeros((), dtype=values[0].dtype, device=values[0].device)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)
