"""trlX's reward clipping and scaling (plugins/task_rewards.py) against values computed by hand and against trlX's
``RunningMoments`` formulas written out here: a number laid out on the last token, the running standard deviation
merged batch by batch equal to that of everything seen, ``ref`` fixed by the first batch (or given), clip before
scale, a divisor of 0 left out, and the state that checkpoints keep."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.plugins.task_rewards import RewardScaler, RunningMoments, last_token_rows


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32),
                               atol=atol, rtol=0)


def trlx_running_moments(batches: list[list[float]]) -> list[float]:
    """trlX's RunningMoments.update (trlx/utils/modeling.py) on one process, written out: its std after each batch."""
    mean, var, count, out = 0.0, 1.0, 1e-24, []
    for xs in batches:
        x = torch.tensor(xs, dtype=torch.float64)
        xs_var, xs_mean = torch.var_mean(x, unbiased=False)
        delta = float(xs_mean) - mean
        tot = count + len(xs)
        old_sum = var * count + delta ** 2 * count * len(xs) / tot
        mean += delta * len(xs) / tot
        var = (old_sum + float(xs_var) * len(xs)) / tot
        out.append(math.sqrt(var * tot / (tot - 1)))
        count = tot
    return out


def test_a_number_is_laid_out_on_the_last_real_token():
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    close(last_token_rows(torch.tensor([2.0, -1.0, 5.0]), mask), [[0, 0, 2.0], [-1.0, 0, 0], [0, 0, 0]])


def test_running_std_is_the_unbiased_std_of_everything_seen_as_trlx_computes_it():
    batches = [[1.0, 2.0, 4.0], [0.0, -3.0], [10.0, 1.0, 1.0, 2.0]]
    moments, seen = RunningMoments(), []
    for k, xs in enumerate(batches):
        x = torch.tensor(xs, dtype=torch.float64)
        moments.update(len(xs), float(x.mean()), float(x.var(unbiased=False)))
        seen += xs
        assert moments.std == pytest.approx(float(torch.tensor(seen).double().std()), rel=1e-9)
        assert moments.std == pytest.approx(trlx_running_moments(batches)[k], rel=1e-9)
        assert moments.mean == pytest.approx(sum(seen) / len(seen))
    assert RunningMoments().std == 1.0  # nothing seen yet


def test_clip_then_running_scale_by_hand():
    scaler = RewardScaler(clip=1.0, scale="running")
    rows = [torch.tensor([[0.0, 3.0], [0.5, 0.0]]), torch.tensor([[-2.0, 0.0]])]
    clipped = [scaler.clipped(r) for r in rows]
    close(clipped[0], [[0.0, 1.0], [0.5, 0.0]])
    close(clipped[1], [[-1.0, 0.0]])
    # totals 1.0, 0.5, -1.0 (as two replicas would sum them): mean 1/6, unbiased std sqrt(((5/6)^2 + (1/3)^2 +
    # (7/6)^2) / 2) = sqrt(2.1667 / 2)
    stats = RewardScaler.batch_stats(clipped[:1]) + RewardScaler.batch_stats(clipped[1:])
    assert scaler.divisor(stats) == pytest.approx(math.sqrt((25 / 36 + 4 / 36 + 49 / 36) / 2))
    # a second batch moves the running std to that of all 5 totals
    second = RewardScaler.batch_stats([torch.tensor([[4.0], [2.0]])])
    assert scaler.divisor(second) == pytest.approx(float(torch.tensor([1.0, 0.5, -1.0, 4.0, 2.0]).std()))


def test_ref_scale_is_fixed_by_the_first_batch_or_given():
    scaler = RewardScaler(scale="ref")
    assert scaler.divisor(RewardScaler.batch_stats([torch.tensor([[1.0], [3.0]])])) == pytest.approx(math.sqrt(2))
    assert scaler.divisor(RewardScaler.batch_stats([torch.tensor([[100.0], [-50.0]])])) == pytest.approx(math.sqrt(2))
    assert RewardScaler(scale="ref", ref_std=0.5).divisor(RewardScaler.batch_stats([torch.ones(2, 1)])) == 0.5
    assert RewardScaler().divisor(RewardScaler.batch_stats([torch.ones(2, 1)])) == 1.0  # no scaling
    # every total equal: a standard deviation of 0 divides nothing
    assert RewardScaler(scale="running").divisor(RewardScaler.batch_stats([torch.ones(3, 1)])) == 1.0


def test_the_scaler_state_round_trips():
    scaler = RewardScaler(scale="running")
    scaler.divisor(RewardScaler.batch_stats([torch.tensor([[1.0], [2.0], [6.0]])]))
    copy = RewardScaler(scale="running")
    copy.load_state_dict(scaler.state_dict())
    batch = RewardScaler.batch_stats([torch.tensor([[0.0], [1.0]])])
    assert copy.divisor(batch) == scaler.divisor(batch)


def test_a_resume_keeps_a_ref_std_taken_in_the_run_and_the_configs_given_one():
    """A checkpoint's ref_std replaced the one the resumed config gives (a review's resume at 0.5 kept the old 2.0)."""
    taken = RewardScaler(scale="ref")
    taken.divisor(RewardScaler.batch_stats([torch.tensor([[1.0], [3.0]])]))
    resumed = RewardScaler(scale="ref")
    resumed.load_state_dict(taken.state_dict())
    assert resumed.ref_std == pytest.approx(math.sqrt(2))
    given = RewardScaler(scale="ref", ref_std=0.5)
    given.load_state_dict(taken.state_dict())
    assert given.ref_std == 0.5


def test_a_resume_keeps_an_adapted_kl_coef_and_the_configs_fixed_one():
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    adapted = PPOTokensUpdater(kl_coef=0.1, kl_target=6.0)
    adapted.kl.update(12.0, 1000)
    state = adapted.state_dict()
    again = PPOTokensUpdater(kl_coef=0.1, kl_target=6.0)
    again.load_state_dict(state)
    assert again.kl.value == adapted.kl.value != 0.1
    fixed = PPOTokensUpdater(kl_coef=0.5)
    fixed.load_state_dict({**state, "kl_coef": 0.05})
    assert fixed.kl.value == 0.5
