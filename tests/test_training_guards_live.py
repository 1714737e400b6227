"""The trainer's guards, live with 2 replicas under ZeRO 0 and 2 (Adam): a non-finite loss or gradient from finite
arguments skips the optimizer step on every replica, leaves weights and optimizer state as they were and names
the step and the statistic; replicas whose updaters step per local sample (Lamorel's loop) over uneven shares
fail at once naming each replica's calls, instead of waiting for the collective timeout; ``loss.backward()``
and a ``Categorical`` over an empty minibatch's outputs get errors that say what to do. After each, the
servers keep serving, and the next good update equals one plain Adam step from the weights before."""

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


def good_update_is_one_plain_adam_step(run, tiny, llm: str) -> None:
    """The weights, moments and step counts are untouched by what was refused: the next update is one plain Adam
    step from the weights before it (moments from zero, step count 1)."""
    before = run.state_dict(llm=llm)
    run.update(CONTEXTS, CANDIDATES, llm=llm, **GOOD)
    after = run.state_dict(llm=llm)
    expected = reference_training(tiny, before, [list(range(len(CONTEXTS)))], ADAM, batch=GOOD, head=False)
    for key, want in expected.items():
        torch.testing.assert_close(after[key], want, atol=2e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("llm", ["z0", "z2"])
def test_a_non_finite_loss_from_finite_arguments_skips_the_step_on_every_replica(run, tiny, llm):
    weights = list(GOOD["weights"])
    weights[0] = 3e38  # finite in float32; -3e38 x a log-prob of about -5 is not
    refused(run, llm, "loss of backward call 1 was not finite on replica 0", "optimizer step 1 was skipped",
            weights=weights)
    good_update_is_one_plain_adam_step(run, tiny, llm)


@pytest.mark.parametrize("llm", ["z0", "z2"])
def test_an_infinite_gradient_behind_a_finite_loss_skips_the_step_on_every_replica(run, tiny, llm):
    refused(run, llm, "optimizer step 1", "not finite", "skipped", mode="nan_gradient", bad_replica=1)
    good_update_is_one_plain_adam_step(run, tiny, llm)


def test_replicas_stepping_per_local_sample_over_uneven_shares_fail_at_once_naming_their_calls(run, tiny):
    refused(run, "z2", "out of step",
            "replica 0 was about to call trainer.forward after 1 forward, 1 backward and 1 step call(s)",
            "replica 1 was at the end of the update after 1 forward, 1 backward and 1 step call(s)",
            "batch.minibatches",
            n=3, mode="per_sample")
    good_update_is_one_plain_adam_step(run, tiny, "z2")


def test_loss_backward_is_refused_with_the_fix(run, tiny):
    refused(run, "z0", "call trainer.backward(loss), not loss.backward()", mode="direct_backward")
    good_update_is_one_plain_adam_step(run, tiny, "z0")


def test_a_categorical_over_an_empty_minibatch_gets_an_error_that_says_why(run):
    refused(run, "z0", "last minibatch was empty", "[2, 1]", "Categorical", n=3, mode="categorical")
