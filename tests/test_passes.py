"""The planning of token-bounded training passes (engine/model/training/passes.py), on hand-made token plans:
which rows each pass holds, and where each of its output rows sits in the whole micro-batch's outputs."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.scoring.tokenization import CandidateTokens, ContextTokens, TokenPlan
from llmrl.engine.model.training.passes import (
    DeferredForward,
    form_passes,
    leaf_outputs,
    micro_batch_tokens,
    pass_surrogate,
    row_indices,
    sub_plan,
)
from llmrl.plugins.contracts import ForwardOutputs


def plan() -> TokenPlan:
    """Context 0: a 4-token prefix with candidates of 3, 5 and 2 tokens; context 1: 6 tokens, candidates of 1 and 20
    tokens; context 2: 2 tokens, no candidate."""
    def ctx(n, widths):
        return ContextTokens(list(range(n)), n, [CandidateTokens(list(range(w)), 0) for w in widths])

    return TokenPlan("causal", [ctx(4, [3, 5, 2]), ctx(6, [1, 20]), ctx(2, [])])


def test_passes_hold_at_most_the_budget_in_request_order_and_a_long_row_alone():
    p = plan()
    assert micro_batch_tokens(p) == 4 + 10 + 6 + 21 + 2
    assert form_passes(p, 100) == [[(0, [0, 1, 2]), (1, [0, 1]), (2, [])]]
    # 4+3+5 = 12 (5 more would pass 13); 2 (+4, the prefix again) + 1 (+6) = 13; 20 (+6) alone; then context 2
    assert form_passes(p, 13) == [[(0, [0, 1])], [(0, [2]), (1, [0])], [(1, [1])], [(2, [])]]
    assert form_passes(p, 12) == [[(0, [0, 1])], [(0, [2])], [(1, [0])], [(1, [1])], [(2, [])]]
    seen = [(i, j) for rows in form_passes(p, 12) for i, js in rows for j in js]
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], "every candidate exactly once, in order"


def test_a_pass_plan_keeps_the_contexts_and_their_candidates_of_the_pass():
    p = plan()
    part = sub_plan(p, [(0, [2]), (1, [0])])
    assert [c.ids for c in part.contexts] == [p.contexts[0].ids, p.contexts[1].ids]
    assert [[len(k.rest) for k in c.candidates] for c in part.contexts] == [[2], [1]]


def test_row_indices_point_into_the_whole_outputs():
    p = plan()
    deferred = DeferredForward(p, form_passes(p, 12), [], token_counts=[3, 5, 2, 1, 20], forward_plan=None)
    index = row_indices(deferred, [(0, [2]), (1, [0])])
    assert index["context"].tolist() == [0, 1]
    assert index["candidate"].tolist() == [2, 3]
    assert index["token"].tolist() == [8, 9, 10]  # candidate 2's tokens 8-9, candidate 3's token 10


def test_the_surrogate_gives_each_row_its_gradient_and_a_context_row_once():
    p = plan()
    passes = [[(0, [0, 1])], [(0, [2]), (1, [0, 1])]]
    grads = [torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([[10.0], [20.0], [30.0]])]
    leaves = [(("candidate_scores",), "candidate", None), (("context_hidden",), "context", None)]
    deferred = DeferredForward(p, passes, leaves, token_counts=[3, 5, 2, 1, 20], forward_plan=None)
    done: set[int] = set()
    totals = []
    for k, rows in enumerate(passes):
        n_cand = sum(len(js) for _, js in rows)
        scores = torch.ones(n_cand, requires_grad=True)
        hidden = torch.ones(len(rows), 1, requires_grad=True)
        out = ForwardOutputs("causal", len(rows), scores, torch.zeros(n_cand), torch.zeros(n_cand),
                             context_hidden=hidden)
        pass_surrogate(deferred, k, out, grads, done).backward()
        totals.append((scores.grad.tolist(), hidden.grad.flatten().tolist()))
    assert totals[0] == ([1.0, 2.0], [10.0])
    assert totals[1] == ([3.0, 4.0, 5.0], [0.0, 20.0]), "context 0's gradient was taken in the first pass"


def test_a_second_backward_through_a_spent_forwards_outputs_raises():
    """The first phase's outputs are leaves: a loss reaching them after their forward's passes ran would give them a
    gradient and the model none (an unsplit forward's second backward raises too: its graph is freed)."""
    spent: list = []
    out, leaves = leaf_outputs(ForwardOutputs("causal", 1, torch.ones(3), torch.zeros(3), torch.zeros(3)), spent)
    loss = (out.candidate_scores * 2).sum()
    torch.autograd.grad(loss, [leaf for _, _, leaf in leaves], retain_graph=True)  # the first backward's own call
    spent.append(True)  # its passes ran
    with pytest.raises(RuntimeError, match="a second trainer.backward through the outputs of a forward pass trained"):
        loss.backward()
