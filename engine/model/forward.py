"""One forward pass of a request on one rank: tokenise and plan, agree with the other replicas when they must
move together, run the engine.

:func:`plan_forward` turns contexts, candidates and head keys into a :class:`ForwardPlan` (token plan,
batches, and the number of model calls, decided once by the planner); it may raise on bad input (an input
too long, an unknown head or adapter). :func:`prepare` plans, then takes the one collective step: when the replicas of an
LLM must make the same calls (ZeRO-3 lockstep, or every training forward), each rank says whether its
plan succeeded and how many calls it needs, in a single vote, so that a rank whose input was bad never
leaves the others waiting inside a collective. :func:`run_forward` calls the engine (the module DeepSpeed
wraps), padded with throw-away calls up to the agreed number.

The same path serves ``score`` / ``custom_module_fns`` (without gradients) and the updater's
``trainer.forward`` (with gradients). It knows nothing about sockets or request kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrl.engine.errors import PeerAborted
from llmrl.engine.model.batching import BatchSpec, Needs, plan_batches
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.tokenization import TokenPlan, tokenize
from llmrl.plugins.contracts import ForwardOutputs


@dataclass
class ForwardPlan:
    plan: TokenPlan
    batches: list[BatchSpec]
    needs: Needs
    heads: tuple[str, ...]
    adapter: str | None

    @property
    def model_calls(self) -> int:
        return sum(b.model_calls for b in self.batches)


def plan_forward(served: ServedModel, contexts, candidates, heads=(), adapter: str | None = None,
                 minibatch_size: int | None = None) -> ForwardPlan:
    """Tokenise and plan a forward pass; raises ValueError on bad input (nothing has run yet)."""
    keys = served.check_heads(heads)
    served.check_adapter(adapter)
    needs = served.needs_for(keys)
    llm = served.llm
    # Under lockstep a seq2seq model re-encodes per chunk: every call must be a whole-model call.
    reuse = llm.prefix_reuse and not (llm.lockstep and llm.type == "seq2seq")
    plan = tokenize(served.tokenizer, llm.type, contexts, candidates, max_length=served.max_length,
                    prefix_reuse=reuse)
    batches = plan_batches(plan, llm.token_budget, minibatch_size or llm.minibatch_size, needs, encoder_reuse=reuse)
    return ForwardPlan(plan, batches, needs, keys, adapter)


def prepare(served: ServedModel, contexts, candidates, heads=(), adapter: str | None = None,
            minibatch_size: int | None = None, *, must_agree: bool) -> tuple[ForwardPlan, int]:
    """Plan a forward pass, then, if ``must_agree``, vote with the LLM's other ranks before any collective.

    Returns the plan and the number of throw-away calls to add. Raises this rank's own planning error, or
    :class:`PeerAborted` when another rank's plan failed: every rank raises, none is left in a collective.
    """
    try:
        plan, error = plan_forward(served, contexts, candidates, heads, adapter, minibatch_size), None
    except Exception as err:  # noqa: BLE001 - voted on, then re-raised
        plan, error = None, err
    if not must_agree:
        if error is not None:
            raise error
        return plan, 0
    calls = plan.model_calls if plan is not None else 0
    everyone_ok, most = served.group.agree(error is None, calls)
    if error is not None:
        raise error
    if not everyone_ok:
        raise PeerAborted(f"another rank of LLM {served.llm.name!r} refused its share of the request")
    return plan, most - calls


def run_forward(served: ServedModel, plan: ForwardPlan, extra_calls: int = 0) -> ForwardOutputs:
    """Run a planned forward pass through the engine (gradients follow the caller's grad mode)."""
    with served.adapter(plan.adapter):
        return served.engine(plan=plan.plan, batches=plan.batches, needs=plan.needs, head_keys=plan.heads,
                             extra_calls=extra_calls)
