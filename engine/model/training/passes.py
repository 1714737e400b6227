"""Token-bounded training passes: a micro-batch too long for ``training.max_tokens_per_micro_batch`` is trained on in
passes of at most that many tokens, with exactly the gradient of the whole micro-batch.

Why: a backward pass needs every activation of the forward pass it differentiates. A micro-batch of long samples
(8 prompts x 8 continuations x 561 tokens) would hold all of them at once, whatever the token budget of each model
call, because one updater loss reads them all.

How, in two phases:

1. The trainer runs the micro-batch's forward pass without gradients (each model call within the LLM's
   ``token_budget``, nothing kept but the outputs) and hands the updater outputs whose float tensors are leaves of a
   fresh graph (:func:`leaf_outputs`). The updater computes its loss on them as on any pass: statistics and
   normalisations over the whole micro-batch, a GRPO group spread over several passes included.
2. At ``trainer.backward(loss)``, one autograd call gives d loss / d output for every output row (small tensors).
   The micro-batch then runs again pass by pass (:func:`form_passes`), each pass with gradients, and each pass
   back-propagates ``sum(gradient * output)`` over its own rows only (:func:`pass_surrogate`). By the chain rule
   the sum of those backward passes is the gradient of the loss; one pass's activations are alive at a time.

Passes are formed from the (context, candidate) rows in request order: a context's candidates may be spread over
several passes (the context is then encoded again in each: a prompt's tokens per pass); a candidate longer than the
budget gets a pass of its own; one longer than the model accepts (``max_length``) is refused before any pass, with its
index in the call (:func:`refuse_too_long`): nothing is truncated. A context-level output (the hidden state at a
context's last token, a context head) takes its gradient in the first pass that holds the context.

Cost: one more forward pass over the micro-batch, only when it is split. The model runs in evaluation mode (no
dropout), so the second phase computes what the first computed. What it assumes: every output row depends on its own
row's inputs only, as the engine's outputs and the built-in heads do (a head that mixes rows, a softmax over a
context's candidates for one, would see only a pass's rows: give such a micro-batch a budget it fits in). A forward
with ``head_kwargs`` (the whole call's, while a pass holds only some of its rows) is never split. This module plans and
maps rows; the trainer (:mod:`llmrl.engine.model.training.trainer`) runs the passes and keeps the replicas in step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from llmrl.engine.graph import graph_zero
from llmrl.engine.model.scoring.normalise import at_least_float32
from llmrl.engine.model.scoring.tokenization import ContextTokens, TokenPlan, tokenize
from llmrl.plugins.contracts import ForwardOutputs

# The differentiable fields of ForwardOutputs and the level of their rows (heads carry their own level).
FIELD_LEVELS = {"candidate_scores": "candidate", "context_hidden": "context", "candidate_hidden": "candidate",
                "token_logprobs": "token", "token_entropy": "token", "token_hidden": "token", "token_logits": "token",
                "context_hidden_layers": "context", "candidate_hidden_layers": "candidate",
                "token_hidden_layers": "token", "context_logits": "context"}

PassRows = list[tuple[int, list[int]]]  # one pass: (context index in the request, its candidates in this pass)


def prefix_tokens(context: ContextTokens, kind: str) -> int:
    """Tokens a pass spends on a context besides its candidates' own rows."""
    return len(context.prefix) if kind == "causal" else len(context.ids)


def micro_batch_tokens(plan: TokenPlan) -> int:
    """Tokens of a micro-batch's forward pass: each context's prefix, plus each candidate's row."""
    return sum(prefix_tokens(c, plan.kind) + sum(len(k.rest) for k in c.candidates) for c in plan.contexts)


def form_passes(plan: TokenPlan, budget: int) -> list[PassRows]:
    """Greedy passes of at most ``budget`` tokens, rows in request order (a row wider than the budget alone)."""
    passes: list[PassRows] = []
    current: PassRows = []
    used = 0

    def close():
        nonlocal current, used
        if current:
            passes.append(current)
        current, used = [], 0

    for i, context in enumerate(plan.contexts):
        prefix = prefix_tokens(context, plan.kind)
        if not context.candidates:
            if current and used + prefix > budget:
                close()
            current.append((i, []))
            used += prefix
            continue
        for j, candidate in enumerate(context.candidates):
            opened = bool(current) and current[-1][0] == i
            cost = len(candidate.rest) + (0 if opened else prefix)
            if current and used + cost > budget:
                close()
                opened, cost = False, len(candidate.rest) + prefix
            if not opened:
                current.append((i, []))
            current[-1][1].append(j)
            used += cost
    close()
    return passes


def sub_plan(plan: TokenPlan, rows: PassRows) -> TokenPlan:
    """The token plan of one pass: its contexts, each with its candidates of this pass only."""
    return TokenPlan(plan.kind, [ContextTokens(plan.contexts[i].ids, plan.contexts[i].shared,
                                               [plan.contexts[i].candidates[j] for j in js], plan.contexts[i].adapter)
                                 for i, js in rows])


@dataclass
class DeferredForward:
    """A training forward pass run without gradients, whose backward is replayed in passes."""

    plan: TokenPlan  # the request's contexts (twins computed apart: every row gets its own gradient)
    passes: list[PassRows]
    leaves: list[tuple[tuple, str, torch.Tensor]]  # (path in the outputs, row level, leaf)
    token_counts: list[int]  # scored tokens of each candidate, in request order
    forward_plan: Any  # the ForwardPlan of the first phase (heads, adapter, needs, head keyword arguments)
    without_adapters: bool = False  # run inside trainer.adapters_disabled(): replayed the same way
    spent: list = field(default_factory=list)  # not empty once its passes' backward ran: see leaf_outputs


def leaf_outputs(out: ForwardOutputs, spent: list) -> tuple[ForwardOutputs, list[tuple[tuple, str, torch.Tensor]]]:
    """``out`` with every float tensor replaced by a leaf that requires grad, and the list of those leaves. A
    backward pass that reaches a leaf once ``spent`` is not empty (its forward's passes ran, in an earlier backward)
    raises: it would give the leaf a gradient and the model none, where an unsplit forward's second backward
    raises too (its graph is freed)."""
    leaves = []

    def leaf(path, level, t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        made = t.detach().requires_grad_(True)
        made.register_hook(functools.partial(_unless_spent, spent))
        leaves.append((path, level, made))
        return made

    fields = {}
    for name, level in FIELD_LEVELS.items():
        value = getattr(out, name)
        if isinstance(value, dict):
            fields[name] = {k: leaf((name, k), level, v) for k, v in value.items()}
        else:
            fields[name] = leaf((name,), level, value)
    heads = {}
    for key, value in (out.heads or {}).items():
        level = out.head_levels[key]
        if isinstance(value, dict):
            heads[key] = {k: leaf(("heads", key, k), level, v) for k, v in value.items()}
        else:
            heads[key] = leaf(("heads", key), level, value)
    return out._replace(heads=heads, **fields), leaves


def _unless_spent(spent: list, grad: torch.Tensor) -> torch.Tensor:
    if spent:
        raise RuntimeError("a second trainer.backward through the outputs of a forward pass trained in passes "
                           "(training.max_tokens_per_micro_batch): its model gradient went with the first; put "
                           "every loss of one forward into one trainer.backward")
    return grad


def _at(out: ForwardOutputs, path: tuple):
    value = out.heads if path[0] == "heads" else getattr(out, path[0])
    for key in path[1:]:
        value = None if value is None else value.get(key)
    return value


def row_indices(deferred: DeferredForward, rows: PassRows) -> dict[str, torch.Tensor]:
    """For one pass, the request row of each of its rows, per level (context rows held by an earlier pass: -1)."""
    starts, total = [], 0
    for context in deferred.plan.contexts:
        starts.append(total)
        total += len(context.candidates)
    token_starts = [0]
    for n in deferred.token_counts:
        token_starts.append(token_starts[-1] + n)
    candidates = [starts[i] + j for i, js in rows for j in js]
    tokens = [t for c in candidates for t in range(token_starts[c], token_starts[c + 1])]
    return {"context": torch.tensor([i for i, _ in rows], dtype=torch.long),
            "candidate": torch.tensor(candidates, dtype=torch.long),
            "token": torch.tensor(tokens, dtype=torch.long)}


def pass_surrogate(deferred: DeferredForward, k: int, out: ForwardOutputs, grads: list[torch.Tensor | None],
                   contexts_done: set[int]) -> torch.Tensor:
    """``sum(d loss / d output * output)`` over pass ``k``'s rows of ``out`` (that pass's outputs, with gradients):
    its backward adds pass ``k``'s share of the loss's gradient. ``contexts_done``: contexts whose context-level
    outputs an earlier pass took (updated here)."""
    rows = deferred.passes[k]
    index = row_indices(deferred, rows)
    first = torch.tensor([i not in contexts_done for i, _ in rows], dtype=torch.bool)
    contexts_done.update(i for i, _ in rows)
    total = graph_zero(out.candidate_scores)
    for (path, level, _), grad in zip(deferred.leaves, grads):
        if grad is None:
            continue
        mine = _at(out, path)
        if mine is None:
            raise RuntimeError(f"the replayed pass has no {'.'.join(map(str, path))} while the first phase had it")
        g = grad[index[level].to(grad.device)]
        if level == "context":
            g = g * first.to(g.device).view(-1, *([1] * (g.dim() - 1)))
        if g.shape != mine.shape:
            raise RuntimeError(f"the replayed pass's {'.'.join(map(str, path))} has shape {tuple(mine.shape)}, "
                               f"its rows in the first phase {tuple(g.shape)}")
        total = total + (at_least_float32(mine) * at_least_float32(g.to(mine.device))).sum()
    return total


def refuse_too_long(served, batch) -> None:
    """Refuse, before any pass, a sample longer than the model accepts, naming its index in the call: nothing is
    ever truncated (the updater's passes would refuse it too, but with its index in a minibatch)."""
    if served.max_length is None or not len(batch):
        return
    def check(contexts, candidates):
        tokenize(served.tokenizer, served.llm.type, contexts, candidates, max_length=served.max_length,
                 vocab_size=served.info.vocab_size)

    try:
        check(batch.contexts, batch.candidates)
    except ValueError:
        for k, index in enumerate(batch.indices):
            try:
                check(batch.contexts[k:k + 1], None if batch.candidates is None else batch.candidates[k:k + 1])
            except ValueError as err:
                raise ValueError(f"sample {index} of the update call: {err}; nothing was trained") from None
        raise
