"""Policy versions on the client: a sample's ``policy_version`` is kept by the turn of the ``Trajectory`` it joins,
``episode_batch`` hands them to ``update`` per group, per episode, per turn, and the staleness statistics are the
learner's version minus each sample's, worked out here by hand. Bad versions are refused naming the entry at fault.
No server is needed; the server side is tested in ``test_turns_live.py``.
"""

from __future__ import annotations

import pytest

from llmrl import Episode, Trajectory, episode_batch
from llmrl.engine.policy_versions import check_policy_versions, flat_versions, staleness, staleness_stats


class Ids:
    """The few tokenizer attributes a trajectory started from ids reads."""

    all_special_ids = [0]
    eos_token_id = 0
    added_tokens_decoder: dict = {}


def sample(tokens, version):
    return {"tokens": tokens, "logprobs": [-1.0] * len(tokens), "policy_version": version}


def episode(start, turns) -> Episode:
    """An episode of ``turns``: (sampled ids, their version, the environment's reply ids)."""
    trajectory = Trajectory(Ids(), start)
    rewards = []
    for tokens, version, reply in turns:
        trajectory.add_sample(sample(tokens, version))
        trajectory.add_ids(reply)
        rewards.append(1.0)
    return Episode(trajectory, actions=["a"] * len(turns), rewards=rewards)


def test_a_trajectory_keeps_each_turns_version_and_episode_batch_hands_them_over_per_turn():
    counter = 4  # the test's own count of optimizer steps
    first = episode([5, 6], [([7, 8], counter, [9]), ([10], counter + 1, [11, 12])])
    second = episode([5, 6], [([13], counter, [14]), ([15, 16], counter + 2, [])])
    assert first.trajectory.policy_versions == [4, 5]
    assert second.trajectory.policy_versions == [4, 6]
    batch = episode_batch([[first, second]])
    assert batch["policy_versions"] == [[[4, 5], [4, 6]]]
    learner = counter + 2  # the version an update would train from
    assert staleness(learner, batch["policy_versions"]) == [2, 1, 2, 0]
    assert staleness_stats(staleness(learner, batch["policy_versions"])) == {"staleness_mean": 1.25,
                                                                             "staleness_max": 2.0}


def test_episode_batch_leaves_versions_out_when_a_turn_carries_none():
    trajectory = Trajectory(Ids(), [5])
    trajectory.add_sample({"tokens": [7], "logprobs": [-0.5]})  # a chosen action (score) carries no version
    assert trajectory.policy_versions == [None]
    batch = episode_batch([[Episode(trajectory, actions=["a"], rewards=[0.0])]])
    assert "policy_versions" not in batch


def test_versions_are_checked_per_sample_and_flattened_in_order():
    assert flat_versions([3, [4, [5, 6]], (7,)]) == [3, 4, 5, 6, 7]
    assert check_policy_versions([1, [2, 3]], 2, "policy_versions") == [1, [2, 3]]
    with pytest.raises(ValueError, match=r"has 1 entries, but the call has 2 samples"):
        check_policy_versions([1], 2, "policy_versions")
    with pytest.raises(ValueError, match=r"policy_versions\[1\]: float 2.5 is not an int"):
        check_policy_versions([1, [2.5]], 2, "policy_versions")
    with pytest.raises(ValueError, match=r"policy_versions\[0\]: -1 is negative"):
        check_policy_versions([-1], 1, "policy_versions")
    with pytest.raises(ValueError, match=r"policy_versions\[0\]: bool True is not an int"):
        check_policy_versions([True], 1, "policy_versions")
    assert staleness_stats([]) == {}
