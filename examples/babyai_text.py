"""BabyAI in words: minigrid's BabyAI levels as text environments for language-model agents.

In the spirit of BabyAI-Text (GLAM, Carta et al., ICML 2023), written for llmrl. Each observation
states the goal and describes what the agent sees, relative to itself:

    goal: "go to the red ball"
    description: "You see a red ball 1 step left and 2 steps forward, a wall 3 steps forward."
    actions: ["turn left", "turn right", "go forward"]

Objects are placed by how many steps forward and how many to the left or right of the agent they are;
walls are reported only straight ahead, left and right (the nearest one in each direction), which is
what navigation needs. Only the actions a level uses are offered. :class:`TextVecEnv` steps several
environments at once and resets each one when its episode ends.

This module knows nothing about llmrl; any agent that reads text can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym

ACTION_IDS = {"turn left": 0, "turn right": 1, "go forward": 2, "pick up": 3, "drop": 4, "toggle": 5}
NAVIGATION = ["turn left", "turn right", "go forward"]
HIDDEN = {"empty", "floor", "unseen"}


def level_actions(level: str) -> list[str]:
    """The actions a BabyAI level needs (its instructions decide which)."""
    name = level.split("-")[1] if level.startswith("BabyAI-") else level
    if name.startswith("GoTo"):
        return list(NAVIGATION)
    if name.startswith("Pickup"):
        return NAVIGATION + ["pick up"]
    if name.startswith(("Open", "Unlock")):
        return NAVIGATION + ["pick up", "toggle"]
    if name.startswith("PutNext"):
        return NAVIGATION + ["pick up", "drop"]
    return list(ACTION_IDS)


def _steps(n: int, direction: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {direction}"


def _name(obj) -> str:
    if obj.type == "door":
        state = "locked" if obj.is_locked else "open" if obj.is_open else "closed"
        return f"{state} {obj.color} door"
    return f"{obj.color} {obj.type}"


def _a(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def describe(env, walls: bool = True) -> str:
    """What the agent sees, in words (``env`` is a minigrid environment, unwrapped or not).

    ``walls=False`` leaves walls out (shorter prompts, for levels where they do not matter)."""
    base = env.unwrapped
    grid, visible = base.gen_obs_grid()
    size = grid.width
    ax, ay = size // 2, size - 1  # the agent's cell in its own view; forward is towards row 0
    things: list[tuple[int, str]] = []
    for j in range(size):
        for i in range(size):
            obj = grid.get(i, j)
            if obj is None or not visible[i, j] or (i, j) == (ax, ay) or obj.type in HIDDEN or obj.type == "wall":
                continue
            forward, lateral = ay - j, i - ax
            where = []
            if lateral:
                where.append(_steps(abs(lateral), "left" if lateral < 0 else "right"))
            if forward:
                where.append(_steps(forward, "forward"))
            things.append((forward + abs(lateral), f"{_a(_name(obj))} {' and '.join(where)}"))
    things.sort(key=lambda t: t[0])
    wall_texts = []
    for label, cells in (("forward", [(ax, ay - k) for k in range(1, size)]),
                         ("left", [(ax - k, ay) for k in range(1, ax + 1)]),
                         ("right", [(ax + k, ay) for k in range(1, size - ax)])):
        for k, (i, j) in enumerate(cells, start=1):
            obj = grid.get(i, j)
            if not visible[i, j]:
                break
            if obj is not None and obj.type == "wall":
                wall_texts.append(f"a wall {_steps(k, label)}")
                break
    seen = [text for _, text in things] + (wall_texts if walls else [])
    sentence = f"You see {', '.join(seen)}." if seen else "You see nothing."
    if base.carrying is not None:
        sentence += f" You carry {_a(_name(base.carrying))}."
    return sentence


@dataclass
class TextObservation:
    goal: str
    description: str
    actions: list[str]


def observe(env, actions: list[str], walls: bool = True) -> TextObservation:
    return TextObservation(goal=env.unwrapped.mission, description=describe(env, walls), actions=list(actions))


@dataclass
class EpisodeEnd:
    """Sent in ``infos`` when an environment's episode ends (before it is reset)."""

    success: bool
    episode_return: float
    length: int
    seed: int


@dataclass
class TextVecEnv:
    """Several BabyAI levels stepped together with text actions; each resets when its episode ends.

    Args:
        level: a BabyAI level id, such as ``BabyAI-GoToRedBallNoDists-v0``.
        num_envs: how many environments.
        seeds: where each environment's seed sequence starts (env k uses seeds[k], seeds[k] + stride, ...).
        max_steps: steps before an episode times out (None: the level's own limit).
        seed_stride: distance between successive seeds of one environment.
        walls: describe the nearest walls (True) or only objects (False: shorter prompts).
    """

    level: str
    num_envs: int
    seeds: list[int]
    max_steps: int | None = None
    seed_stride: int = 1
    walls: bool = True
    envs: list = field(init=False)
    actions: list[str] = field(init=False)

    def __post_init__(self):
        import minigrid  # noqa: F401  (registers the BabyAI levels)

        kwargs = {} if self.max_steps is None else {"max_steps": self.max_steps}
        self.envs = [gym.make(self.level, **kwargs) for _ in range(self.num_envs)]
        self.actions = level_actions(self.level)
        self._next_seed = list(self.seeds)
        self._current_seed = [0] * self.num_envs
        self._returns = [0.0] * self.num_envs
        self._lengths = [0] * self.num_envs

    def _reset_one(self, k: int) -> TextObservation:
        seed = self._next_seed[k]
        self._next_seed[k] += self.seed_stride
        self._current_seed[k] = seed
        self._returns[k], self._lengths[k] = 0.0, 0
        self.envs[k].reset(seed=seed)
        return observe(self.envs[k], self.actions, self.walls)

    def reset(self) -> list[TextObservation]:
        return [self._reset_one(k) for k in range(self.num_envs)]

    def step(self, actions: list[str]):
        """Returns ``(observations, rewards, dones, infos)``; ``infos[k]`` holds an :class:`EpisodeEnd` when
        environment k's episode ended (its observation is then the first of its next episode)."""
        observations, rewards, dones, infos = [], [], [], []
        for k, (env, action) in enumerate(zip(self.envs, actions)):
            if action not in self.actions:
                raise ValueError(f"unknown action {action!r}; this level offers {self.actions}")
            _, reward, terminated, truncated, _ = env.step(ACTION_IDS[action])
            self._returns[k] += float(reward)
            self._lengths[k] += 1
            done = terminated or truncated
            info = {}
            if done:
                info["episode"] = EpisodeEnd(success=bool(terminated and reward > 0), episode_return=self._returns[k],
                                             length=self._lengths[k], seed=self._current_seed[k])
                observations.append(self._reset_one(k))
            else:
                observations.append(observe(env, self.actions, self.walls))
            rewards.append(float(reward))
            dones.append(done)
            infos.append(info)
        return observations, rewards, dones, infos

    def close(self) -> None:
        for env in self.envs:
            env.close()
