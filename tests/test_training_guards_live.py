"""The trainer's guards, live with 2 replicas under ZeRO 0 and 2 (Adam): a non-finite loss or gradient from finite
arguments skips the optimizer step on every replica, leaves weights and optimizer state as they were and names
the step and the statistic; replicas whose updaters step per local sample (Lamorel's loop) over uneven shares
fail at once naming each replica's calls, instead of waiting for the collective timeout; ``loss.backward()``
and a ``Categorical`` over an empty minibatch's outputs get errors that say what to do. After each, the
servers keep serving, and the next good update continues plain Adam as if the refused one had never been
made."""

from __future__ import annotations

import pytest
import torch
from test_training_live import CANDIDATES, CONTEXTS, reference_training

from llmrl.engine.errors import RequestError
from testkit import LiveRun

pytestmark = pytest.mark.slow
ADAM = {"type": "adam", "lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-5}
GOOD = {"actions": [1, 0, 1, 0, 2, 1, 0, 2], "weights": [1.0, -0.5, 2.0, 0.3, -1.0, 0.7, 1.5, -0.2]}


@pytest.fixture(scope="module")
def run(tiny):
    GOOD_UPDATES.clear()
    llms = {f"z{zero}": {"model": tiny["llama"], "replicas": 2, "updater": "llmrl_test_plugins:MisbehavingUpdater",
                         "training": {"zero_stage": zero, "optimizer": ADAM, "micro_batch_size": 4,
                                      "gradient_accumulation_steps": 1}} for zero in (0, 2)}
    # A hang would end at this timeout with another message; every test expects its own error well before.
    live = LiveRun({"llms": llms, "threads_per_rank": 1, "timeouts": {"collective": 120}})
    yield live
    assert live.close() == 0


def refused(run, llm: str, *patterns: str, n: int = len(CONTEXTS), **kwargs) -> None:
    """The update is refused with an error holding every pattern, and no weight moved."""
    before = run.state_dict(llm=llm)
    with pytest.raises(RequestError) as info:
        run.update(CONTEXTS[:n], CANDIDATES[:n], llm=llm, **{k: v[:n] if isinstance(v, list) else v
                                                               for k, v in {**GOOD, **kwargs}.items()})
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    after = run.state_dict(llm=llm)
    assert all(torch.equal(before[k], after[k]) for k in before), "no replica may step"


GOOD_UPDATES = {}  # llm -> (weights before its first update, good updates so far)


def good_update_continues_plain_adam(run, tiny, llm: str) -> None:
    """The weights, moments and step counts are untouched by what was refused: after the next good update, the
    weights equal plain Adam's after as many steps (one per good update) from the weights at the start."""
    start, count = GOOD_UPDATES.get(llm) or (run.state_dict(llm=llm), 0)
    run.update(CONTEXTS, CANDIDATES, llm=llm, **GOOD)
    GOOD_UPDATES[llm] = start, count + 1
    after = run.state_dict(llm=llm)
    expected = reference_training(tiny, start, [list(range(len(CONTEXTS)))] * (count + 1), ADAM, batch=GOOD,
                                  head=False)
    for key, want in expected.items():
        torch.testing.assert_close(after[key], want, atol=2e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("llm", ["z0", "z2"])
def test_a_non_finite_loss_from_finite_arguments_skips_the_step_on_every_replica(run, tiny, llm):
    weights = list(GOOD["weights"])
    weights[0] = 3e38  # finite in float32; -3e38 x a log-prob of about -5 is not
    refused(run, llm, "loss of backward call 1 was not finite on replica 0", "optimizer step 1 was skipped",
            weights=weights)
    good_update_continues_plain_adam(run, tiny, llm)


@pytest.mark.parametrize("llm", ["z0", "z2"])
def test_an_infinite_gradient_behind_a_finite_loss_skips_the_step_on_every_replica(run, tiny, llm):
    refused(run, llm, "optimizer step 1", "not finite", "skipped", mode="nan_gradient", bad_replica=1)
    good_update_continues_plain_adam(run, tiny, llm)


def test_replicas_stepping_per_local_sample_over_uneven_shares_fail_at_once_naming_their_calls(run):
    """Both replicas step on their first sample together; then replica 1 has no sample left. Every replica raises
    at that first vote, and no replica took a step the other did not."""
    with pytest.raises(RequestError) as info:
        run.update(CONTEXTS[:3], CANDIDATES[:3], llm="z2", mode="per_sample",
                   **{k: v[:3] for k, v in GOOD.items()})
    for pattern in ("out of step",
                    "replica 0 was about to call trainer.forward after 1 forward, 1 backward and 1 step call(s)",
                    "replica 1 was at the end of the update after 1 forward, 1 backward and 1 step call(s)",
                    "batch.minibatches"):
        assert pattern in str(info.value), str(info.value)
    replicas = [run.state_dict(llm="z2", replica=r) for r in (0, 1)]
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    run.update(CONTEXTS, CANDIDATES, llm="z2", **GOOD)  # still serving
    replicas = [run.state_dict(llm="z2", replica=r) for r in (0, 1)]
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])


def test_loss_backward_is_refused_with_the_fix(run, tiny):
    refused(run, "z0", "call trainer.backward(loss), not loss.backward()", mode="direct_backward")
    good_update_continues_plain_adam(run, tiny, "z0")


def test_backward_without_a_step_is_refused_and_its_gradients_never_reach_the_next_update(run, tiny):
    refused(run, "z0", "called trainer.backward 1 time(s) after its last trainer.step()", mode="no_step")
    good_update_continues_plain_adam(run, tiny, "z0")  # no gradient of the refused update was added to it


def test_a_replica_failing_between_backward_and_step_stops_the_others_before_their_step(run, tiny):
    refused(run, "z0", "this replica failed between its backward and its step", mode="fail_before_step",
            bad_replica=1)
    good_update_continues_plain_adam(run, tiny, "z0")


def test_a_categorical_over_an_empty_minibatch_gets_an_error_that_says_why(run):
    """Minibatches of one sample: both replicas step on their first; replica 1's second minibatch is empty. (It
    steps z0: the tests of plain Adam's continuation on z0 run before it.)"""
    with pytest.raises(RequestError) as info:
        run.update(CONTEXTS[:3], CANDIDATES[:3], llm="z0", mode="categorical", **{k: v[:3] for k, v in GOOD.items()})
    for pattern in ("replica 1's last minibatch was empty", "[2, 1]", "Categorical", "len(minibatch) == 0"):
        assert pattern in str(info.value), str(info.value)

