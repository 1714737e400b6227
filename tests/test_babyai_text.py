"""The BabyAI text environment (examples/babyai_text.py) on hand-built grids: the expected sentences are
written out by hand from the positions, not produced by the code under test."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import gymnasium as gym  # noqa: E402
from babyai_text import TextVecEnv, describe, level_actions  # noqa: E402
from minigrid.core.grid import Grid  # noqa: E402
from minigrid.core.world_object import Ball, Box, Door, Key, Wall  # noqa: E402

EAST, SOUTH, WEST, NORTH = 0, 1, 2, 3


@pytest.fixture
def env():
    env = gym.make("BabyAI-GoToRedBallNoDists-v0")
    env.reset(seed=0)
    yield env
    env.close()


def place(env, objects, agent, direction, carrying=None):
    """A 7x7 room walled all round (inside: x, y in 1..5), with ``objects`` = [((x, y), obj)]."""
    grid = Grid(7, 7)
    grid.wall_rect(0, 0, 7, 7)
    for (x, y), obj in objects:
        grid.set(x, y, obj)
    base = env.unwrapped
    base.grid, base.agent_pos, base.agent_dir, base.carrying = grid, agent, direction, carrying
    return env


def test_objects_are_placed_relative_to_the_agent_and_walls_in_three_directions(env):
    # Facing east from (2, 3): forward is +x, left is -y. The ball at (4, 2) is 2 forward, 1 left.
    # Walls: x=6 is 4 forward, y=0 is 3 left, y=6 is 3 right.
    place(env, [((4, 2), Ball("red"))], agent=(2, 3), direction=EAST)
    assert describe(env) == ("You see a red ball 1 step left and 2 steps forward, a wall 4 steps forward, "
                             "a wall 3 steps left, a wall 3 steps right.")
    assert describe(env, walls=False) == "You see a red ball 1 step left and 2 steps forward."


def test_other_headings_and_the_view_limit(env):
    # Facing north from (2, 3): the box at (2, 1) is 2 forward; y=0 is 3 forward; x=0 is 2 left;
    # x=6 is 4 right, outside the 7-cell view (3 cells each side), so not reported.
    place(env, [((2, 1), Box("purple"))], agent=(2, 3), direction=NORTH)
    assert describe(env) == "You see a purple box 2 steps forward, a wall 3 steps forward, a wall 2 steps left."
    # Facing south: y=6 is 3 forward, the right is west, x=0 is 2 right; the box is behind, unseen.
    place(env, [((2, 1), Box("purple"))], agent=(2, 3), direction=SOUTH)
    assert describe(env) == "You see a wall 3 steps forward, a wall 2 steps right."
    # Facing west: x=0 is 2 forward; the left is south (y=6, 3 left), the right is north (y=0, 3 right);
    # the key at (1, 4) is 1 forward and 1 left.
    place(env, [((1, 4), Key("grey"))], agent=(2, 3), direction=WEST)
    assert describe(env) == ("You see a grey key 1 step left and 1 step forward, a wall 2 steps forward, "
                             "a wall 3 steps left, a wall 3 steps right.")


def test_objects_are_sorted_nearest_first(env):
    place(env, [((5, 3), Ball("blue")), ((3, 3), Key("green"))], agent=(2, 3), direction=EAST)
    assert describe(env, walls=False) == "You see a green key 1 step forward, a blue ball 3 steps forward."


def partition(door):
    """A wall across x=4 with ``door`` at (4, 3), and a key behind it at (5, 3)."""
    return [((4, y), Wall()) for y in (1, 2, 4, 5)] + [((4, 3), door), ((5, 3), Key("blue"))]


def test_door_states_and_what_a_closed_door_hides(env):
    place(env, partition(Door("yellow")), agent=(2, 3), direction=EAST)
    assert describe(env, walls=False) == "You see a closed yellow door 2 steps forward."
    place(env, partition(Door("yellow", is_locked=True)), agent=(2, 3), direction=EAST)
    assert describe(env, walls=False) == "You see a locked yellow door 2 steps forward."
    place(env, partition(Door("yellow", is_open=True)), agent=(2, 3), direction=EAST)
    assert describe(env, walls=False) == "You see an open yellow door 2 steps forward, a blue key 3 steps forward."
    # The partition's wall is the nearest wall straight ahead.
    place(env, partition(Door("yellow")), agent=(2, 2), direction=EAST)
    assert "a wall 2 steps forward" in describe(env)


def test_carrying_and_an_empty_view(env):
    place(env, [], agent=(3, 3), direction=EAST, carrying=Ball("green"))
    assert describe(env, walls=False) == "You see nothing. You carry a green ball."


@pytest.mark.parametrize("level, actions", [
    ("BabyAI-GoToRedBallNoDists-v0", ["turn left", "turn right", "go forward"]),
    ("BabyAI-PickupLoc-v0", ["turn left", "turn right", "go forward", "pick up"]),
    ("BabyAI-OpenDoor-v0", ["turn left", "turn right", "go forward", "pick up", "toggle"]),
    ("BabyAI-PutNextLocal-v0", ["turn left", "turn right", "go forward", "pick up", "drop"]),
    ("BabyAI-BossLevel-v0", ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]),
])
def test_level_actions(level, actions):
    assert level_actions(level) == actions


def ball_ahead(env):
    """Put the agent 2 cells from the red ball, facing it, with the cell between empty."""
    base = env.unwrapped
    bx, by = next((x, y) for x in range(base.grid.width) for y in range(base.grid.height)
                  if base.grid.get(x, y) is not None and base.grid.get(x, y).type == "ball")
    for direction, (dx, dy) in enumerate([(1, 0), (0, 1), (-1, 0), (0, -1)]):
        start, middle = (bx - 2 * dx, by - 2 * dy), (bx - dx, by - dy)
        if all(0 < c < base.grid.width - 1 for c in start) and base.grid.get(*start) is None \
                and base.grid.get(*middle) is None:
            base.agent_pos, base.agent_dir = start, direction
            return
    raise AssertionError("no free approach to the ball")


def test_step_success_reward_and_reset_to_the_next_seed():
    vec = TextVecEnv("BabyAI-GoToRedBallNoDists-v0", num_envs=2, seeds=[100, 200], seed_stride=10)
    first = vec.reset()
    assert first[0].goal == "go to the red ball" and first[0].actions == ["turn left", "turn right", "go forward"]
    ball_ahead(vec.envs[0])
    assert "red ball 2 steps forward" in describe(vec.envs[0])
    observations, rewards, dones, infos = vec.step(["go forward", "turn left"])
    assert dones == [True, False] and rewards[0] > 0 and rewards[1] == 0
    end = infos[0]["episode"]
    assert end.success and end.length == 1 and end.seed == 100 and end.episode_return == rewards[0]
    assert infos[1] == {}
    # Environment 0 was reset with its next seed: the same observation as a fresh env with seed 110.
    fresh = gym.make("BabyAI-GoToRedBallNoDists-v0")
    fresh.reset(seed=110)
    assert observations[0].description == describe(fresh)
    vec.close()


def test_timeout_is_a_failure_and_unknown_actions_are_refused():
    vec = TextVecEnv("BabyAI-GoToRedBallNoDists-v0", num_envs=1, seeds=[0], max_steps=2)
    vec.reset()
    _, _, dones, _ = vec.step(["turn left"])
    assert dones == [False]
    _, rewards, dones, infos = vec.step(["turn left"])
    assert dones == [True] and rewards == [0.0]
    assert not infos[0]["episode"].success and infos[0]["episode"].length == 2
    with pytest.raises(ValueError, match="unknown action 'jump'"):
        vec.step(["jump"])
