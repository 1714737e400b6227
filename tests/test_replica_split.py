"""How a call is cut across replicas, as data (no process, no model): a context with many candidates, or with
several sampled return sequences, is spread over the replicas in contiguous pieces; pieces of one context on one
replica are one piece; small contexts stay whole; the pieces' entries are joined back in candidate order before
``Finish`` (so ``normalize`` sees the whole candidate list); generate's seeds follow the samples' positions.
The live counterparts (results equal to 1 replica and to plain Hugging Face) are in test_serving_live.py."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests import generate, score
from llmrl.engine.requests.base import Piece, split_by_cost


def covered(shares, sizes):
    """Check the pieces cover every item of every input exactly once, in order; return per input its pieces."""
    per_input = {i: [] for i in range(len(sizes))}
    for share in shares:
        assert len({p.input for p in share}) == len(share), "a replica receives each context once"
        for p in share:
            per_input[p.input].append(p)
    for i, pieces in per_input.items():
        assert pieces and pieces[0].start == 0 and pieces[-1].stop == sizes[i]
        assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    return per_input


@pytest.mark.parametrize("replicas, expected", [(2, [128, 128]), (3, [85, 86, 85]), (4, [64, 64, 64, 64])])
def test_one_context_with_256_candidates_is_spread_evenly(replicas, expected):
    shares = score.plan_shares(["You see a door."], [[f" c{i:03d}" for i in range(256)]], replicas)
    covered(shares, [256])
    assert [[p.input for p in s] for s in shares] == [[0]] * replicas
    assert [s[0].size for s in shares] == expected


def test_one_replica_and_many_small_contexts_keep_contexts_whole():
    contexts = [f"context {i}" for i in range(10)]
    candidates = [[" a", " bb", " ccc"]] * 10
    assert score.plan_shares(contexts, candidates, 1) == [[Piece(i, 0, 3) for i in range(10)]]
    shares = score.plan_shares(contexts, candidates, 2)
    assert shares == [[Piece(i, 0, 3) for i in range(5)], [Piece(i, 0, 3) for i in range(5, 10)]]
    costs = [len(c) + sum(len(x) + len(c) // 8 for x in cands) for c, cands in zip(contexts, candidates)]
    assert [(s[0].input, s[-1].input + 1) for s in shares] == split_by_cost(costs, 2)  # as before splitting


def test_a_large_context_is_cut_and_a_small_one_stays_whole():
    shares = score.plan_shares(["big context", "small"], [[f" c{i:03d}" for i in range(256)], [" xy"] * 3], 2)
    per_input = covered(shares, [256, 3])
    assert len(per_input[0]) == 2 and per_input[1] == [Piece(1, 0, 3)]
    assert shares[1][-1] == Piece(1, 0, 3)
    assert abs(shares[0][0].size - (shares[1][0].size + 3)) <= 2  # balanced by candidates


def test_pieces_of_two_contexts_on_one_replica_stay_one_piece_each():
    shares = score.plan_shares(["first", "second"], [[" x"] * 30, [" y"] * 30], 3)
    per_input = covered(shares, [30, 30])
    assert [len(p) for p in per_input.values()] == [2, 2]
    assert [[p.input for p in s] for s in shares] == [[0], [0, 1], [1]]
    assert [p.size for s in shares for p in s] == [20, 10, 10, 20]


def test_contexts_alone_or_with_one_candidate_are_never_cut():
    for shares in (score.plan_shares(["a long context"], None, 2),
                   score.plan_shares(["a long context"], [[" one"]], 3)):
        assert [p for share in shares for p in share] in ([Piece(0, 0, 0)], [Piece(0, 0, 1)])


def test_merge_concatenates_candidate_values_and_keeps_context_values_once():
    levels = {"value": "context", "q": "candidate", "both": "candidate"}
    pieces = [
        {"scores": torch.tensor([-1.0, -2.0]), "counts": torch.tensor([1, 2]),
         "tokens": [[5], [6, 7]], "logprobs": [torch.tensor([-1.0]), torch.tensor([-0.5, -1.5])],
         "heads": {"value": torch.tensor(0.25), "q": torch.tensor([[1.0], [2.0]]),
                   "both": {"a": torch.tensor([1.0, 2.0])}}},
        {"scores": torch.tensor([-3.0]), "counts": torch.tensor([3]),
         "tokens": [[8, 9, 10]], "logprobs": [torch.tensor([-1.0, -1.0, -1.0])],
         "heads": {"value": torch.tensor(0.25), "q": torch.tensor([[3.0]]), "both": {"a": torch.tensor([3.0])}}},
    ]
    merged = score.merge_entries(pieces, levels)
    assert torch.equal(merged["scores"], torch.tensor([-1.0, -2.0, -3.0]))
    assert torch.equal(merged["counts"], torch.tensor([1, 2, 3]))
    assert merged["tokens"] == [[5], [6, 7], [8, 9, 10]]
    assert [t.tolist() for t in merged["logprobs"]] == [[-1.0], [-0.5, -1.5], [-1.0, -1.0, -1.0]]
    assert merged["heads"]["value"].shape == () and float(merged["heads"]["value"]) == 0.25
    assert torch.equal(merged["heads"]["q"], torch.tensor([[1.0], [2.0], [3.0]]))
    assert torch.equal(merged["heads"]["both"]["a"], torch.tensor([1.0, 2.0, 3.0]))
    assert score.merge_entries(pieces[:1], levels) is pieces[0]


def test_normalize_and_mean_apply_to_the_whole_candidate_list():
    pieces = [{"scores": torch.tensor([-1.0, -2.0]), "counts": torch.tensor([1, 2]), "heads": {}},
              {"scores": torch.tensor([-3.0]), "counts": torch.tensor([3]), "heads": {}}]
    (policy,) = score.Finish(reduction="mean", normalize=True)([score.merge_entries(pieces, {})])
    per_token = torch.tensor([-1.0, -1.0, -1.0])
    torch.testing.assert_close(policy, per_token - torch.logsumexp(per_token, 0))  # log(1/3) each


class FakeRun:
    """The client half's view of a run: replicas of one rank each; submit records the parts and assembles the
    values ``answer(payload)`` gives."""

    def __init__(self, replicas: int, answer, lockstep: bool = False):
        self.config = SimpleNamespace(llms={"m": SimpleNamespace(lockstep=lockstep)})
        self._replicas = [[r + 1] for r in range(replicas)]
        self.answer = answer
        self.parts = []

    def replicas(self, llm):
        return self._replicas

    def submit(self, kind, parts, assemble):
        self.parts = parts
        future = Future()
        future.set_result(assemble({ranks[0]: self.answer(payload) for ranks, payload in parts}))
        return future


def fake_entries(request):
    """Per context, scores equal to minus the candidates' numbers; the heads asked for: "value" (the context's
    length) and "q" (per candidate, its number)."""
    out = []
    for context, cands in zip(request.contexts, request.candidates):
        numbers = torch.tensor([float(c[2:]) for c in cands])
        heads = {"value": torch.tensor(float(len(context))), "q": numbers[:, None]}
        out.append({"scores": -numbers, "counts": torch.ones(len(cands), dtype=torch.long),
                    "heads": {key: heads[key] for key in request.heads}})
    return out


@pytest.mark.parametrize("lockstep", [False, True])
def test_score_send_cuts_a_context_and_joins_it_back(lockstep):
    candidates = [[f" c{i}" for i in range(7)], [" c0"]]
    run = FakeRun(3, fake_entries, lockstep)
    result = score.send(run, "m", score.ScoreRequest(["ctx", "ab"], candidates), score.Finish(normalize=True), {}
                        ).result()
    sent = [payload.candidates for _, payload in run.parts]
    # costs (characters): 3.43 per candidate of context 0 (3 + its share of "ctx"), 5 for context 1; 9.67 each
    assert sent == [[candidates[0][:3]], [candidates[0][3:6]], [candidates[0][6:], candidates[1]]]
    want = -torch.arange(7.0)
    torch.testing.assert_close(result[0], want - torch.logsumexp(want, 0))
    assert float(result[1]) == 0.0
    # With heads every context stays whole (a head may read a context's candidates together)
    run = FakeRun(3, fake_entries, lockstep)
    request = score.ScoreRequest(["ctx", "ab"], candidates, ("value", "q"))
    result = score.send(run, "m", request, score.Finish(normalize=True), {"value": "context", "q": "candidate"}
                        ).result()
    assert [payload.candidates for _, payload in run.parts if payload.contexts] == [[candidates[0]], [candidates[1]]]
    torch.testing.assert_close(result[0]["score"], want - torch.logsumexp(want, 0))
    assert torch.equal(result[0]["q"], torch.arange(7.0)[:, None]) and float(result[0]["value"]) == 3.0
    assert float(result[1]["score"]) == 0.0 and float(result[1]["value"]) == 2.0


def test_score_send_keeps_every_replica_under_lockstep():
    run = FakeRun(3, fake_entries, lockstep=True)
    result = score.send(run, "m", score.ScoreRequest(["x"], [[" c0"]]), score.Finish(), {}).result()
    assert sorted(payload.contexts for _, payload in run.parts) == [[], [], ["x"]]
    assert torch.equal(result[0], torch.tensor([-0.0]))
    run = FakeRun(3, fake_entries)
    score.send(run, "m", score.ScoreRequest(["x"], [[" c0"]]), score.Finish(), {}).result()
    assert len(run.parts) == 1


def test_generate_plan_spreads_sampled_sequences_only():
    assert generate.plan_shares(1, 8, 2, True) == [[Piece(0, 0, 4)], [Piece(0, 4, 8)]]
    assert generate.plan_shares(1, 8, 2, False) == [[Piece(0, 0, 8)], []]
    assert generate.plan_shares(3, 2, 2, True) == [[Piece(0, 0, 2), Piece(1, 0, 1)], [Piece(1, 1, 2), Piece(2, 0, 2)]]
    assert generate.plan_shares(5, 1, 2, True) == generate.plan_shares(5, 1, 2, False)  # contexts whole, 3 + 2
    assert [len(s) for s in generate.plan_shares(5, 1, 2, True)] == [3, 2]
    assert generate.splits_sequences({"do_sample": True})
    assert not generate.splits_sequences({"do_sample": True, "num_beams": 2})
    assert not generate.splits_sequences({})


def fake_samples(request):
    """Per prompt, num_return_sequences samples named after the prompt, the request's seed and the row."""
    k = request.kwargs.get("num_return_sequences", 1)
    return [[{"text": f"{c}/{request.seed}/{j}", "logprobs": torch.zeros(1)} for j in range(k)]
            for c in request.contexts]


def test_generate_send_payloads_seeds_and_order():
    run = FakeRun(2, fake_samples)
    request = generate.GenerateRequest(["p0", "p1", "p2"], {"do_sample": True, "num_return_sequences": 2}, seed=100)
    result = generate.send(run, "m", request).result()
    payloads = [payload for _, payload in run.parts]
    assert [p.contexts for p in payloads] == [["p0", "p0", "p1"], ["p1", "p2", "p2"]]  # one prompt per sample
    assert [p.kwargs["num_return_sequences"] for p in payloads] == [1, 1]
    assert [p.seed for p in payloads] == [100, 103]  # seed + context x k + first sequence
    assert [[s["text"] for s in samples] for samples in result] == [
        ["p0/100/0", "p0/100/0"], ["p1/100/0", "p1/103/0"], ["p2/103/0", "p2/103/0"]]
    run = FakeRun(2, fake_samples)
    request = generate.GenerateRequest(["p"], {"do_sample": True, "num_return_sequences": 8}, seed=7)
    (samples,) = generate.send(run, "m", request).result()
    assert [(p.contexts, p.kwargs["num_return_sequences"], p.seed) for _, p in run.parts] == [
        (["p"], 4, 7), (["p"], 4, 11)]
    assert [s["text"] for s in samples] == [f"p/7/{j}" for j in range(4)] + [f"p/11/{j}" for j in range(4)]


def test_generate_send_keeps_greedy_and_beam_contexts_whole():
    for kwargs in ({"num_return_sequences": 3}, {"num_return_sequences": 3, "do_sample": True, "num_beams": 3}):
        run = FakeRun(2, fake_samples)
        generate.send(run, "m", generate.GenerateRequest(["p"], kwargs, seed=1)).result()
        assert [(p.contexts, p.kwargs, p.seed) for _, p in run.parts] == [(["p"], kwargs, 1)]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_bad_num_return_sequences_is_refused_on_the_client(bad):
    with pytest.raises(InvalidArgument, match="num_return_sequences must be a positive integer"):
        generate.send(FakeRun(2, fake_samples), "m", generate.GenerateRequest(["p"], {"num_return_sequences": bad}))


@pytest.mark.parametrize("name, instead", [("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")])
def test_lengths_counting_the_prompt_are_refused_on_the_client_with_the_argument_to_use(name, instead):
    """generate plans by max_new_tokens (default 20): a max_length was ignored without a word, and a min_length
    counted the left padding, so a sample's minimum depended on the longest prompt beside it."""
    with pytest.raises(InvalidArgument, match=f"{name} .* is not taken: pass {instead}"):
        generate.send(FakeRun(2, fake_samples), "m", generate.GenerateRequest(["p"], {name: 60}))


def test_head_kwargs_per_context_are_sliced_like_the_contexts_and_token_heads_are_cut_per_candidate():
    """A context cut over replicas gives its per-context kwarg entry to each piece; other kwargs go whole; a
    token-level dict output and a candidate-level dict output come back joined, cut per candidate."""
    def answer(request):
        out = []
        for cands, weight in zip(request.candidates, request.head_kwargs["weight"]):
            counts = torch.tensor([len(c) for c in cands])
            flat = torch.cat([torch.arange(float(n)) for n in counts.tolist()])
            out.append({"scores": torch.zeros(len(cands)), "counts": counts, "token_counts": counts,
                        "heads": {"tok": {"v": flat * weight, "w": flat[:, None]},
                                  "cand": {"n": counts.float() + request.head_kwargs["shift"][0]}}})
        return out

    candidates = [[[1] * (i + 1) for i in range(6)], [[5, 6]]]
    request = score.ScoreRequest([[9] * 8, [3]], candidates, ("tok", "cand"),
                                 head_kwargs={"weight": [10.0, 100.0], "shift": [0.5, 0.5, 0.5]})
    run = FakeRun(3, answer)
    result = score.send(run, "m", request, score.Finish(scores=False), {"tok": "token", "cand": "candidate"}).result()
    assert len(run.parts) > 1
    for _, payload in run.parts:
        assert payload.head_kwargs["weight"] == [[10.0, 100.0][c[0] == 3] for c in payload.contexts]
        assert payload.head_kwargs["shift"] == [0.5, 0.5, 0.5]
    first = result[0]
    assert [v.tolist() for v in first["tok"]["v"]] == [[10.0 * t for t in range(i + 1)] for i in range(6)]
    assert [tuple(w.shape) for w in first["tok"]["w"]] == [(i + 1, 1) for i in range(6)]
    assert first["cand"]["n"].tolist() == [i + 1.5 for i in range(6)]
    assert [v.tolist() for v in result[1]["tok"]["v"]] == [[0.0, 100.0]]


def test_generate_send_gives_each_replica_its_contexts_adapters():
    """A list of adapters (one per context) follows the contexts to each replica, one name per prompt sent (a piece
    sent one prompt per sample repeats its context's); a share whose prompts all name one adapter gets that name."""
    run = FakeRun(2, fake_samples)
    request = generate.GenerateRequest(["p0", "p1", "p2"], {"do_sample": True, "num_return_sequences": 2}, seed=1,
                                       peft_adapter=["a", "b", "b"])
    generate.send(run, "m", request).result()
    assert [(p.contexts, p.peft_adapter) for _, p in run.parts] == [
        (["p0", "p0", "p1"], ["a", "a", "b"]), (["p1", "p2", "p2"], "b")]
    run = FakeRun(3, fake_samples, lockstep=True)  # lockstep: each share a list; one with nothing to do: None
    generate.send(run, "m", generate.GenerateRequest(["p0", "p1"], {}, peft_adapter=["a", "b"])).result()
    assert sorted((p.contexts, str(p.peft_adapter)) for _, p in run.parts) == [([], "None"), (["p0"], "['a']"),
                                                                                (["p1"], "['b']")]
    run = FakeRun(2, fake_samples, lockstep=True)  # one adapter for every context: one name, whatever the layout
    generate.send(run, "m", generate.GenerateRequest(["p0", "p1"], {}, peft_adapter=["a", "a"])).result()
    assert [p.peft_adapter for _, p in run.parts] == ["a", "a"]


@pytest.mark.parametrize("adapters, kind, error", [
    (["a"], InvalidArgument, "peft_adapter lists 1 adapter name\\(s\\) for 2 context\\(s\\)"),
    (["a", 3], InvalidArgumentType, "peft_adapter\\[1\\] must be an adapter's name"),
    ({"a": 1}, InvalidArgumentType, "peft_adapter must be an adapter's name, a list"),
])
def test_generate_refuses_adapters_that_do_not_name_one_per_context(adapters, kind, error):
    run = FakeRun(2, fake_samples)
    with pytest.raises(kind, match=error):
        generate.send(run, "m", generate.GenerateRequest(["p0", "p1"], {}, peft_adapter=adapters))
    assert run.parts == []


def fake_token_outputs(request):
    return {"outputs": [{"logprobs": torch.zeros(len(s.tokens) - 1)} for s in request.sequences], "loss": 0.0}


def test_forward_backward_send_gives_each_replica_its_sequences_adapters_and_the_calls():
    """A list of adapters (one per datum) follows the sequences to each replica; every share also carries every
    adapter of the call, in the order first named (each replica runs them all: their gradients reduce together), even
    a share of one adapter. A list naming one adapter is that adapter."""
    from llmrl.engine.requests import forward_backward
    from llmrl.engine.requests.datums import Sequence

    run = FakeRun(2, fake_token_outputs)
    sequences = [Sequence(list(range(n))) for n in (6, 6, 6, 6)]
    forward_backward.send(run, "m", sequences, None, {}, backward=False, adapter=["b", "a", "b", "b"]).result()
    assert [(len(p.sequences), p.adapter, p.call_adapters) for _, p in run.parts] == [
        (2, ["b", "a"], ("b", "a")), (2, ["b", "b"], ("b", "a"))]
    assert [p.first_index for _, p in run.parts] == [0, 2]
    share = run.parts[1][1].adapters()
    assert (share.names, share.call) == (["b", "b"], ("b", "a"))
    forward_backward.send(run, "m", sequences, None, {}, backward=False, adapter=["a"] * 4).result()
    assert [(p.adapter, p.call_adapters, p.adapters()) for _, p in run.parts] == [("a", None, "a")] * 2
    with pytest.raises(InvalidArgument, match="peft_adapter lists 3 adapter name\\(s\\) for 4 datum\\(s\\)"):
        forward_backward.send(run, "m", sequences, None, {}, backward=False, adapter=["a", "b", "a"])
