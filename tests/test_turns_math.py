"""The multi-turn maths and inputs by hand: turns read from the model-token mask, GAE across turns, the per-turn
inputs checked by name, and :func:`llmrl.episode_batch` building an update from episodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.plugins.ppo_turns import read_turns, spread
from llmrl.plugins.rl_math import turn_gae, turn_spans
from llmrl.plugins.rollouts import PromptRows


def test_turns_are_the_runs_of_model_tokens():
    assert turn_spans(torch.tensor([0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)) == [(1, 3), (5, 6), (7, 8)]
    assert turn_spans(torch.tensor([1, 1, 1], dtype=torch.bool)) == [(0, 3)]
    assert turn_spans(torch.zeros(4, dtype=torch.bool)) == []


def test_gae_across_turns_by_hand():
    # gamma 0.9, lam 0.8; the value after the last turn is 0
    # delta_2 = 2 - (-0.1) = 2.1                      A_2 = 2.1
    # delta_1 = 0 + 0.9 * -0.1 - 0.2 = -0.29          A_1 = -0.29 + 0.72 * 2.1 = 1.222
    # delta_0 = 1 + 0.9 * 0.2 - 0.5 = 0.68            A_0 = 0.68 + 0.72 * 1.222 = 1.55984
    advantages, returns = turn_gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.2, -0.1]), 0.9, 0.8)
    torch.testing.assert_close(advantages, torch.tensor([1.55984, 1.222, 2.1]))
    torch.testing.assert_close(returns, torch.tensor([2.05984, 1.422, 2.0]))
    one, _ = turn_gae(torch.tensor([3.0]), torch.tensor([1.0]), 0.5, 0.5)
    torch.testing.assert_close(one, torch.tensor([2.0]))


def test_per_turn_values_spread_over_their_tokens():
    got = spread([torch.tensor([1.0, -2.0])], [[(1, 3), (4, 5)]], 6)
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 1.0, 0.0, -2.0, 0.0]]))
    starts = spread([torch.tensor([1.0, -2.0])], [[(1, 3), (4, 5)]], 6, at_start=True)
    torch.testing.assert_close(starts, torch.tensor([[0.0, 1.0, 0.0, 0.0, -2.0, 0.0]]))


def rows(lengths: list[int]) -> PromptRows:
    width = max(lengths)
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    return PromptRows(mask, torch.zeros(len(lengths)))


def test_turn_inputs_are_read_per_episode_and_refused_by_name():
    batch = SimpleNamespace(indices=[4], kwargs={"model_mask": [[[0, 1, 1, 0, 1], [1, 0, 0]]],
                                                 "turn_rewards": [[[0.5, 1.0], [2.0]]]})
    prompt = rows([5, 3])
    (rewards,) = read_turns(batch, [prompt], "ppo_turns")
    assert [r.tolist() for r in rewards] == [[0.5, 1.0], [2.0]]
    assert prompt.spans == [[(1, 3), (4, 5)], [(0, 1)]]
    cases = [
        ({"turn_rewards": [[[0.5], [2.0]]]}, r"turn_rewards\[4\]\[0\] holds 1 rewards but episode 0 of start 4 has 2"),
        ({"turn_rewards": [[[0.5, float("nan")], [2.0]]]}, r"turn_rewards\[4\]\[0\] holds a non-finite value"),
        ({"model_mask": [[[0, 2, 1, 0, 1], [1, 0, 0]]]}, r"model_mask\[4\] holds a value other than 0 and 1"),
        ({"model_mask": [[[0, 1, 1, 0, 1], [0, 0, 0]]]}, "episode 1 of start 4 has no model token"),
        ({"model_mask": [[[0, 1, 1, 0], [1, 0, 0]]]}, r"model_mask\[4\]\[0\] has 4 values but continuation 0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            read_turns(SimpleNamespace(indices=[4], kwargs={**batch.kwargs, **change}), [rows([5, 3])], "ppo_turns")
    with pytest.raises(ValueError, match="needs the per-sample keyword argument 'turn_rewards'"):
        read_turns(SimpleNamespace(indices=[4], kwargs={"model_mask": batch.kwargs["model_mask"]}), [rows([5, 3])],
                   "grpo_turns")


class Tokenizer:
    eos_token_id = 0


def episode(start: list[int], turns: list[tuple[list[int], list[float], list[int]]], rewards: list[float]):
    from llmrl import Episode, Trajectory

    trajectory = Trajectory(Tokenizer(), start)
    for tokens, logprobs, reply in turns:
        trajectory.add_sample({"tokens": tokens, "logprobs": logprobs})
        trajectory.add_ids(reply)
    return Episode(trajectory, rewards=rewards)


def test_episode_batch_builds_the_update_of_groups_of_episodes():
    from llmrl import episode_batch

    a = episode([7, 8], [([5, 0], [-0.5, -0.1], [9, 9]), ([6], [-1.0], [])], [0.0, 1.0])
    b = episode([7, 8], [([4, 0], [-0.2, -0.3], [])], [2.0])
    c = episode([3], [([5], [-0.7], [1])], [-1.0])
    got = episode_batch([[a, b], [c]])
    # c's reply after its last turn carries no loss: it is left out
    assert got == {"contexts": [[7, 8], [3]], "candidates": [[[5, 0, 9, 9, 6], [4, 0]], [[5]]],
                   "model_mask": [[[1, 1, 0, 0, 1], [1, 1]], [[1]]],
                   "turn_rewards": [[[0.0, 1.0], [2.0]], [[-1.0]]],
                   "old_logprobs": [[[-0.5, -0.1, 0.0, 0.0, -1.0], [-0.2, -0.3]], [[-0.7]]]}
    with pytest.raises(ValueError, match="the episodes of group 0 start from different ids"):
        episode_batch([[a, c]])
    with pytest.raises(ValueError, match="episode 1 of group 0 has 1 model turns but 2 rewards"):
        episode_batch([[a, episode([7, 8], [([4], [-0.2], [])], [2.0, 1.0])]])


def test_gae_of_a_truncated_episode_bootstraps_from_the_value_after_its_last_turn():
    # as test_gae_across_turns_by_hand, with V after the last turn 0.4 instead of 0:
    # delta_2 = 2 + 0.9 * 0.4 - (-0.1) = 2.46          A_2 = 2.46
    # delta_1 = -0.29                                  A_1 = -0.29 + 0.72 * 2.46 = 1.4812
    # delta_0 = 0.68                                   A_0 = 0.68 + 0.72 * 1.4812 = 1.746464
    advantages, returns = turn_gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.2, -0.1]), 0.9, 0.8,
                                   last_value=0.4)
    torch.testing.assert_close(advantages, torch.tensor([1.746464, 1.4812, 2.46]))
    torch.testing.assert_close(returns, advantages + torch.tensor([0.5, 0.2, -0.1]))
    ended, _ = turn_gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.2, -0.1]), 0.9, 0.8, last_value=0.0)
    torch.testing.assert_close(ended, torch.tensor([1.55984, 1.222, 2.1]))  # a value of 0 is the ended episode's


def test_episode_batch_with_bootstrap_extends_truncated_episodes_to_a_placeholder():
    from llmrl import episode_batch

    a = episode([7, 8], [([5, 0], [-0.5, -0.1], [9, 9]), ([6], [-1.0], [4, 3])], [0.0, 1.0])
    a.truncated = True  # cut short: its trajectory keeps the state it was cut in ([4, 3])
    b = episode([7, 8], [([4, 0], [-0.2, -0.3], [2])], [2.0])  # ended: its reply carries nothing
    got = episode_batch([[a, b]], bootstrap=True)
    assert got == {"contexts": [[7, 8]], "candidates": [[[5, 0, 9, 9, 6, 4, 3, 0], [4, 0]]],
                   "model_mask": [[[1, 1, 0, 0, 1, 0, 0, 0], [1, 1]]], "turn_rewards": [[[0.0, 1.0], [2.0]]],
                   "old_logprobs": [[[-0.5, -0.1, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0], [-0.2, -0.3]]],
                   "bootstrap": [[1, 0]]}
    assert "bootstrap" not in episode_batch([[a, b]])  # without it, a truncated episode ends at its last turn
    assert episode_batch([[a, b]])["candidates"] == [[[5, 0, 9, 9, 6], [4, 0]]]
    long = episode([7, 8], [([5], [-0.5], [4, 4, 4])], [1.0])
    long.truncated, long.cut_by = True, "max_prompt_tokens"  # its last state is longer than the model should read
    assert episode_batch([[long]], bootstrap=True)["candidates"] == [[[5]]]
    assert episode_batch([[long]], bootstrap=True)["bootstrap"] == [[0]]
    c = episode([7, 8], [([5], [-0.5], [])], [1.0])
    c.truncated = True
    with pytest.raises(ValueError, match="episode 0 of group 0 is truncated, but its trajectory stops at its last"):
        episode_batch([[c]], bootstrap=True)


def test_bootstrap_flags_are_checked_by_name():
    batch = SimpleNamespace(indices=[4], kwargs={"model_mask": [[[0, 1, 1, 0, 0], [1, 0, 1]]],
                                                 "turn_rewards": [[[0.5], [2.0, 1.0]]]})
    for flags, message in (([[1, 1]], r"episode 1 of start 4 is marked bootstrap but ends on a model token"),
                           ([[2, 0]], r"bootstrap\[4\]\[0\] is 2: mark each episode 1")):
        with pytest.raises(ValueError, match=message):
            read_turns(SimpleNamespace(indices=[4], kwargs={**batch.kwargs, "bootstrap": flags}), [rows([5, 3])],
                       "ppo_turns")
    for flags in ([[1, 0]], torch.tensor([[1, 0]]), [torch.tensor([True, False])]):  # lists, tensors, booleans
        prompt = rows([5, 3])
        read_turns(SimpleNamespace(indices=[4], kwargs={**batch.kwargs, "bootstrap": flags}), [prompt], "ppo_turns")
        assert prompt.bootstrap == [True, False]
