"""update()'s arguments are refused on the client when any number inside them, however nested, is NaN or infinite:
ragged lists of lists, lists of tensors, numpy arrays, dicts; the error names the argument and the path of the
bad value. Finite arguments of every shape pass. A declared per-sample argument holding a string is refused the
same way."""

from __future__ import annotations

import array
import collections
import decimal

import numpy as np
import pytest
import torch

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.requests.finite import check_finite

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, where", [
    ({"rewards": [[1.0, 2.0], [3.0, 4.0, NAN]]}, "rewards[1][2]"),  # ragged: torch.as_tensor refuses it
    ({"old_logprobs": [torch.zeros(3), torch.tensor([0.0, -INF])]}, "old_logprobs[1][1]"),
    ({"old_logprobs": [np.zeros(2), np.array([[0.0], [INF]])]}, "old_logprobs[1][1][0]"),
    ({"stats": {"a": [1.0], "b": {"c": [0.5, [NAN]]}}}, "stats['b']['c'][1][0]"),
    ({"advantages": torch.tensor([[0.0, 1.0], [NAN, 2.0]])}, "advantages[1][0]"),
    ({"returns": np.array([1.0, INF], dtype=np.float32)}, "returns[1]"),
    ({"beta": NAN}, "beta"),
    ({"beta": np.float64(INF)}, "beta"),
    ({"pairs": [(1.0, 2.0), (3.0, NAN)]}, "pairs[1][1]"),
    ({"mixed": [1, "text", [2.0, NAN]]}, "mixed[2][1]"),
])
def test_a_non_finite_number_anywhere_is_refused_naming_its_path(kwargs, where):
    with pytest.raises(InvalidArgument, match="nothing was sent") as info:
        check_finite(kwargs)
    assert f"at {where} " in str(info.value), str(info.value)
    assert repr(next(iter(kwargs))) in str(info.value)


def test_finite_arguments_of_every_shape_pass():
    check_finite({"rewards": [[1.0, 2.0], [3.0]], "tensors": [torch.zeros(2), torch.ones(3, 2)],
                  "arrays": [np.zeros(2), np.ones((2, 2), dtype=np.float16)], "ints": [1, 2, 3], "flag": True,
                  "names": ["a", "b"], "nested": {"x": [1e38, -1e38]}, "objects": [object()], "none": None,
                  "ids": torch.arange(5), "bools": np.array([True, False])})


# ----------------------------------------------------------------------------- per-sample arguments


def shares(kwargs: dict, declared: dict | None, n: int = 4, candidates=None, whole=None):
    """What each of 2 replicas receives from update.send (no process: the client half only)."""
    from test_replica_split import FakeRun

    from llmrl.engine.requests import update

    run = FakeRun(2, lambda request: request)
    contexts = [f"c{i}" for i in range(n)]
    return update.send(run, "m", contexts, candidates, kwargs, declared, "u", whole).result()


@pytest.mark.parametrize("value, where", [
    ([["a", "b"], [0.0, 1.0]], "ref_logprobs[0][0]"),  # dpo's reference log-probs written as text
    ([[0.0, 1.0], np.array(["x", "y"])], "ref_logprobs[1][0]"),
    ([[0.0, {"chosen": 1.0}], [0.0, 1.0]], "ref_logprobs[0][1]"),
    ([[0.0, np.array("a")], [0.0, 1.0]], "ref_logprobs[0][1]"),  # a 0-d array of text
])
def test_a_declared_per_sample_argument_holding_a_non_number_is_refused_naming_its_path(value, where):
    """It failed on the servers with "could not convert string to float", naming neither the argument nor the
    sample."""
    with pytest.raises(InvalidArgument, match="not a number: the updater 'u' reads it per sample") as info:
        shares({"ref_logprobs": value}, {"ref_logprobs": "candidate"}, n=2, candidates=[["a", "b"], ["c", "d"]])
    assert f"at {where}," in str(info.value)
    numbers = [[0.5, np.float32(1.0)], torch.tensor([0.0, 1.0])]  # numbers of every kind pass
    assert shares({"ref_logprobs": [array.array("f", [0.5, 1.0]), np.array([0.0, 1.0], dtype=object)]},
                  {"ref_logprobs": "candidate"}, n=2, candidates=[["a", "b"], ["c", "d"]])
    assert shares({"ref_logprobs": numbers}, {"ref_logprobs": "candidate"}, n=2, candidates=[["a", "b"], ["c", "d"]])


def test_a_declared_argument_of_the_wrong_length_is_refused_naming_it():
    declared = {"rewards": "candidate", "advantages": "sample"}
    with pytest.raises(InvalidArgument, match=r"'advantages' has 5 entries, but the call has 4 contexts.*'u'"):
        shares({"advantages": [0.0] * 5}, declared)
    with pytest.raises(InvalidArgument, match=r"'advantages' is a float, but the call has 4 contexts"):
        shares({"advantages": 0.5}, declared)
    candidates = [[" a", " b"], [" a"], [" a", " b"], [" a", " b", " c"]]
    with pytest.raises(InvalidArgument, match=r"'rewards'\[3\] holds 2 values, but context 3 has 3 candidate"):
        shares({"rewards": [[1.0, 2.0], 0.5, [1.0, 2.0], [1.0, 2.0]]}, declared, candidates=candidates)
    ids = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8]], [[9], [10], [11]]]
    good = [[[0.0, 0.0], [0.0]], [[0.0, 0.0, 0.0]], [[0.0], [0.0]], [[0.0], [0.0], [0.0]]]
    shares({"old_logprobs": good}, {"old_logprobs": "token"}, candidates=ids)
    bad = [good[0], [[0.0, 0.0]], good[2], good[3]]
    with pytest.raises(InvalidArgument, match=r"'old_logprobs'\[1\]\[0\] holds 2 values, but candidate 0 of context 1"):
        shares({"old_logprobs": bad}, {"old_logprobs": "token"}, candidates=ids)


def test_a_sample_level_argument_holding_a_sequence_per_context_is_refused():
    """An (n, 1) array (a column of advantages, say) would broadcast against the updater's per-sample tensors into an
    n x n loss; one value per context is what the sample level reads: numbers, numpy's and torch's included."""
    declared = {"advantages": "sample"}
    for column in (np.array([[1.0], [-1.0], [2.0], [0.5]]), torch.ones(4, 1), [[1.0], [2.0], [3.0], [4.0]]):
        with pytest.raises(InvalidArgument, match=r"'advantages'\[0\] holds 1 values, but the updater 'u' reads one "
                                                  r"value per context .*flat sequence of 4 numbers"):
            shares({"advantages": column}, declared)
    for flat in (np.array([1.0, -1.0, 2.0, 0.5]), torch.ones(4), [1, 2.5, np.float32(3), torch.tensor(4.0)]):
        shares({"advantages": flat}, declared)


def test_declared_arguments_are_sliced_by_the_declaration_and_the_others_go_whole():
    """A length-4 argument the updater does not declare reaches both replicas whole (the length rule would have cut
    it); the declared one is cut 2/2; both replicas learn which were cut."""
    got = shares({"advantages": [0.0, 1.0, 2.0, 3.0], "table": [9, 9, 9, 9]}, {"advantages": "sample"})
    assert [r.kwargs["advantages"] for r in got] == [[0.0, 1.0], [2.0, 3.0]]
    assert [r.kwargs["table"] for r in got] == [[9, 9, 9, 9]] * 2
    assert [r.per_sample for r in got] == [["advantages"], ["advantages"]]
    rule = shares({"advantages": [0.0, 1.0, 2.0, 3.0], "table": [9, 9, 9]}, None)  # no declaration: length rule
    assert [r.kwargs["advantages"] for r in rule] == [[0.0, 1.0], [2.0, 3.0]]
    assert [r.kwargs["table"] for r in rule] == [[9, 9, 9]] * 2 and rule[0].per_sample == ["advantages"]


def test_per_sample_tensors_and_arrays_are_cut_like_lists_on_every_replica_and_minibatch():
    """Replica 1's share and a later minibatch start past 0: a cut that took the first n entries would pass on
    replica 0 and give replica 1 replica 0's values."""
    from llmrl.plugins.contracts import UpdateBatch

    for value in (torch.tensor([0.0, 1.0, 2.0, 3.0]), np.array([0.0, 1.0, 2.0, 3.0])):
        got = shares({"advantages": value}, {"advantages": "sample"})
        assert [list(map(float, r.kwargs["advantages"])) for r in got] == [[0.0, 1.0], [2.0, 3.0]]
        assert type(got[1].kwargs["advantages"]) is type(value)
    batch = UpdateBatch(contexts=["a", "b", "c"], candidates=None, kwargs={"adv": torch.tensor([5.0, 6.0, 7.0])},
                        indices=[0, 1, 2], global_size=3, replica=0, num_replicas=1, replica_sizes=[3],
                        per_sample_keys=("adv",))
    assert [m.kwargs["adv"].tolist() for m in batch.minibatches(1)] == [[5.0], [6.0], [7.0]]


def test_a_declared_argument_given_as_none_is_not_given():
    """``old_logprobs=lp if cached else None``: the replicas see no such argument (the updaters test presence), and
    the call is not refused for a None that has no entries."""
    got = shares({"advantages": [0.0, 1.0, 2.0, 3.0], "old_logprobs": None},
                 {"advantages": "sample", "old_logprobs": "sample"})
    assert [r.kwargs for r in got] == [{"advantages": [0.0, 1.0]}, {"advantages": [2.0, 3.0]}]
    assert [r.per_sample for r in got] == [["advantages"], ["advantages"]]


def test_an_argument_the_updater_does_not_read_is_refused_when_it_lists_what_it_reads():
    """The built-in updaters list every argument they read (per_sample_args and whole_args): a misspelt one is
    refused by name instead of being ignored; an updater that lists nothing (whole_args None) accepts any."""
    declared = {"rewards": "candidate", "old_logprobs": "sample"}
    with pytest.raises(InvalidArgument, match=r"\['old_logprob'\] are not read by the updater 'u': it reads rewards, "
                                              r"old_logprobs, beta; check the spelling; nothing was sent"):
        shares({"old_logprob": [0.0] * 4}, declared, whole=("beta",))
    assert [r.kwargs["beta"] for r in shares({"beta": 0.5}, declared, whole=("beta",))] == [0.5, 0.5]
    assert [r.kwargs["extra"] for r in shares({"extra": 1}, declared)] == [1, 1]  # whole_args None: accepted
    from llmrl.plugins import dpo, ilql, nlpo, ppo, ppo_tokens, ppo_turns, reward_model, sft
    from llmrl.plugins import grpo as grpo_module

    builtin = [dpo.DPOUpdater, grpo_module.GRPOUpdater, ilql.ILQLUpdater, nlpo.NLPOUpdater, ppo.PPOUpdater,
               ppo_tokens.PPOTokensUpdater, ppo_turns.PPOTurnsUpdater, ppo_turns.GRPOTurnsUpdater,
               reward_model.PairwiseRewardUpdater, sft.SFTUpdater]
    assert all(cls.whole_args == () and cls.per_sample_args is not None for cls in builtin)


def test_minibatches_cut_the_arguments_the_client_cut_not_those_of_the_local_length():
    from llmrl.plugins.contracts import UpdateBatch

    batch = UpdateBatch(contexts=["a", "b"], candidates=None, kwargs={"adv": [1.0, 2.0], "pair": (5, 6)},
                        indices=[0, 1], global_size=4, replica=0, num_replicas=2, replica_sizes=[2, 2],
                        per_sample_keys=("adv",))
    first = next(iter(batch.minibatches(1)))
    assert first.kwargs == {"adv": [1.0], "pair": (5, 6)}  # "pair" is 2 long locally, but went whole


def test_a_bad_declaration_is_refused_at_load():
    from llmrl.plugins.checks import contract_problem
    from llmrl.plugins.contracts import Updater

    class Bad(Updater):
        per_sample_args = {"rewards": "per_prompt"}

        def update(self, batch, trainer):
            return {}

    assert "per_sample_args" in contract_problem("updater", Bad, "bad") and "candidate" in contract_problem(
        "updater", Bad, "bad")


def test_rewards_of_ppo_tokens_may_be_dense_and_their_lengths_are_checked_against_the_token_ids():
    """``candidate_or_token``: per candidate a number, or one number per token id; a dense list of another length is
    refused naming the argument, the context, the candidate and both lengths."""
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    declared = PPOTokensUpdater.per_sample_args
    ids = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8]], [[9], [10], [11]]]
    good = [[[0.5, 0.5], 1.0], [[0.0, 0.0, 2.0]], [0.0, [1.0]], [1.0, 2.0, [3.0]]]
    got = shares({"rewards": good}, declared, candidates=ids)
    assert [r.kwargs["rewards"] for r in got] == [good[:2], good[2:]]
    shares({"rewards": [[1.0, 2.0], 3.0, [1.0, 2.0], [0.0, 0.0, 0.0]]}, declared, candidates=ids)  # numbers only
    bad = [good[0], [[0.0, 2.0]], good[2], good[3]]
    with pytest.raises(InvalidArgument, match=r"'rewards'\[1\]\[0\] holds 2 values, but candidate 0 of context 1 has "
                                              r"3 token ids: pass one value per token \(dense\), or one value"):
        shares({"rewards": bad}, declared, candidates=ids)
    with pytest.raises(InvalidArgument, match=r"'rewards'\[0\] holds 3 values, but context 0 has 2 candidate"):
        shares({"rewards": [[1.0, 2.0, 3.0]] + good[1:]}, declared, candidates=ids)


@pytest.mark.parametrize("key, where", [
    ("lr", r"llms\.m\.training\.optimizer\.lr \(a schedule: llms\.m\.training\.lr_schedule\)"),
    ("learning_rate", r"llms\.m\.training\.optimizer\.lr"),
    ("max_grad_norm", r"llms\.m\.training\.gradient_clipping"),
    ("grad_clip", r"llms\.m\.training\.gradient_clipping"),
    ("weight_decay", r"llms\.m\.training\.optimizer\.weight_decay"),
    ("warmup_steps", r"llms\.m\.training\.lr_schedule\.warmup_steps"),
])
def test_optimizer_settings_passed_to_update_are_refused_saying_where_they_go(key, where):
    """trlX and Lamorel scripts pass the learning rate or the clipping norm with the training call; here the
    engine's optimizer reads the config, and an updater would ignore them without a word."""
    for declared in ({"rewards": "candidate"}, None):
        with pytest.raises(InvalidArgument, match=rf"update argument '{key}' would be ignored.*{where}.*nothing was "
                                                  "sent"):
            shares({key: 1e-4, "advantages": [0.0] * 4}, declared)
    got = shares({key: [1.0] * 4}, {key: "sample"})  # an updater that declares it reads it
    assert [r.kwargs[key] for r in got] == [[1.0, 1.0], [1.0, 1.0]]


def test_nlpo_refuses_old_logprobs_however_they_reach_it():
    """The client refuses them first (nlpo does not list them); an updater called another way still refuses them:
    they would be the unmasked model's log-probs, and the ratios silently wrong."""
    from llmrl.plugins.contracts import UpdateBatch
    from llmrl.plugins.nlpo import NLPOUpdater

    batch = UpdateBatch(contexts=["a"], candidates=[[[1, 2]]], kwargs={"rewards": [[1.0]],
                                                                        "old_logprobs": [[[-1.0, -1.0]]]},
                        indices=[0], global_size=1, replica=0, num_replicas=1, replica_sizes=[1])
    with pytest.raises(ValueError, match="leave old_logprobs out"):
        NLPOUpdater().update(batch, trainer=None)


class Labelled:
    """An array-like indexed by label, like a pandas Series of a shuffled frame: ``value[k]`` is the entry labelled
    k, not the k-th; ``__array__`` gives the entries in order."""

    def __init__(self, values, labels):
        self.values, self.labels = list(values), list(labels)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, label):
        return self.values[self.labels.index(label)]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.values, dtype=dtype)


def test_an_array_like_indexed_by_label_is_cut_by_position():
    """A column of a shuffled frame has labels [2, 0, 3, 1]: cutting it by label paired each context with another
    context's advantage (a review's live run trained two twins 1.81 apart)."""
    got = shares({"advantages": Labelled([3.0, 2.0, 0.0, 1.0], [2, 0, 3, 1])}, {"advantages": "sample"})
    assert [list(r.kwargs["advantages"]) for r in got] == [[3.0, 2.0], [0.0, 1.0]]
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"adv": [0.0, 1.0, 2.0, 3.0]}).sample(frac=1, random_state=1)
    got = shares({"advantages": frame.adv}, {"advantages": "sample"})
    assert [x for r in got for x in r.kwargs["advantages"]] == frame.adv.tolist()
    series = pd.Series([1.0, 2.0, 3.0, 4.0], index=["a", "b", "c", "d"])  # labels that are not ints: a KeyError
    assert [list(r.kwargs["advantages"]) for r in shares({"advantages": series}, {"advantages": "sample"})] == [
        [1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("value, where", [
    (array.array("d", [1.0, NAN]), "x[1]"),
    (collections.deque([1.0, INF]), "x[1]"),
    (decimal.Decimal("NaN"), "x"),
    ([collections.deque([1.0]), collections.deque([NAN])], "x[1][0]"),
    (memoryview(array.array("d", [0.0, NAN])), "x[1]"),
    (Labelled([0.0, INF], [1, 0]), "x[1]"),
])
def test_non_finite_numbers_in_any_container_are_found(value, where):
    """These fell through the walk: the call passed the client's checks and a server refused it after a step."""
    with pytest.raises(InvalidArgument, match="nothing was sent") as info:
        check_finite({"x": value})
    assert f"at {where} " in str(info.value)


def test_an_update_of_no_contexts_is_refused():
    """The servers took an optimizer step on no data (Adam's momentum moved the weights 0.034)."""
    with pytest.raises(InvalidArgument, match="update got no contexts"):
        shares({}, {"advantages": "sample"}, n=0)
