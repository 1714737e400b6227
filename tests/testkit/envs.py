"""Tiny text environments for the multi-turn tests: :class:`DoorEnv`, deterministic, with admissible actions (and
its gymnasium-shaped and misshapen variants).

Reward 1 for ``"open door"``, 0 for anything else; the episode ends after ``turns`` steps. Observations name the
room and the last action, so every turn's message differs. :func:`even_length_reward` is a reward the evaluation
harness's live test can send to the run's client by reference. Test code, never shipped.
"""

from __future__ import annotations

ACTIONS = ["open door", "go north", "wait"]


class DoorEnv:
    def __init__(self, room: int, turns: int = 3):
        self.room, self.turns, self.steps = room, turns, 0
        self.log: list[str] = []  # the actions it received, in order

    def reset(self):
        self.steps, self.log = 0, []
        return f"Room {self.room}. A door.", {"admissible_actions": list(ACTIONS)}

    def step(self, action: str):
        self.steps += 1
        self.log.append(action)
        reward = 1.0 if action == "open door" else 0.0
        return f"You chose: {action}.", reward, self.steps >= self.turns, {"admissible_actions": list(ACTIONS)}


class GymnasiumDoorEnv(DoorEnv):
    """:class:`DoorEnv` with gymnasium's 5-value ``step``: it says ``truncated`` (not ``terminated``) after ``cut``
    steps."""

    def __init__(self, room: int, cut: int = 2):
        super().__init__(room, turns=100)
        self.cut = cut

    def step(self, action: str):
        observation, reward, _, info = super().step(action)
        return observation, reward, False, self.steps >= self.cut, info


class ThreeValueEnv(DoorEnv):
    """A misshapen environment: ``step`` returns 3 values."""

    def step(self, action: str):
        return super().step(action)[:3]


def even_length_reward(prompt: str, completion: str) -> float:
    """1.0 for a completion of an even number of characters: a reward that varies with what a random model writes
    (the evaluation harness's live test)."""
    return float(len(completion) % 2 == 0)
