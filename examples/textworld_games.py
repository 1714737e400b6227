"""TextWorld games for the multi-turn demo: generated offline, cached on disk, played through llmrl's text
environment protocol (``reset() -> (observation, info)``, ``step(action) -> (observation, reward, done, info)``,
``info["admissible_actions"]``).

The family is TextWorld's *coin collector*: a chain of rooms with a coin at the far end; level ``L`` has ``L``
rooms, so the shortest win takes ``L - 1`` moves and ``take coin``. A game is made from its level and seed with
TextWorld's own generator (no network, about a second each) and kept in ``cache_dir`` as ``coin-L<level>-s<seed>.z8``;
a file already there is used as is. Observations are TextWorld's text without its banner and prompt lines, followed
by the admissible commands, which the agent may only choose from.

This module holds no agent and no training; it needs the ``textworld`` package (the ``textworld`` extra).
"""

from __future__ import annotations

import os
import re

GAME = "tw-coin_collector"


def game_path(cache_dir: str, level: int, seed: int) -> str:
    """The game file of ``(level, seed)``, generated on first use."""
    path = os.path.join(cache_dir, f"coin-L{level}-s{seed}.z8")
    if os.path.exists(path):
        return path
    import textworld
    import textworld.challenges
    from textworld.generator.game import GameOptions

    os.makedirs(cache_dir, exist_ok=True)
    options = GameOptions()
    options.seeds = seed
    options.path = path
    options.file_ext = ".z8"
    _, make, _ = textworld.challenges.CHALLENGES[GAME]
    textworld.generator.compile_game(make({"level": level}, options), options)
    return path


def clean(text: str) -> str:
    """TextWorld's feedback without its prompt lines (``>`` and the status line after it) and runs of blank lines."""
    lines = [line.rstrip() for line in text.splitlines() if not line.lstrip().startswith(">")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class TextWorldEnv:
    """One TextWorld game through llmrl's environment protocol; the reward is the game's score increase (1 for the
    coin), and ``info["won"]`` says whether the episode was won. The first observation starts with the game's
objective (which names the way to the coin) unless ``objective`` is False."""

    def __init__(self, path: str, objective: bool = True):
        import textworld

        self.path, self.objective = path, objective
        self.infos = textworld.EnvInfos(admissible_commands=True, won=True, objective=True, description=True)
        self.env = textworld.start(path, request_infos=self.infos)
        self.actions: list[str] = []
        self._score = 0

    def _observe(self, text: str, state) -> tuple[str, dict]:
        self.actions = sorted(state.admissible_commands or [])
        return f"{text}\nCommands: {', '.join(self.actions)}.", {"admissible_actions": self.actions,
                                                                  "won": bool(state.won)}

    def reset(self) -> tuple[str, dict]:
        state = self.env.reset()
        self._score = 0
        text = clean(state.description)
        return self._observe(f"{state.objective.strip()}\n\n{text}" if self.objective else text, state)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        # The Z-machine reads printable ASCII: a NUL or non-ASCII character (which a model may write) crashes the
        # interpreter, and the whole process with it. Anything else is dropped, and the command kept short.
        action = "".join(ch for ch in action if " " <= ch <= "~")[:200]
        state, score, done = self.env.step(action)
        reward = float(score) - float(self._score)
        self._score = score
        text, info = self._observe(clean(state.feedback), state)
        return text, reward, bool(done or state.won), info

    def close(self) -> None:
        self.env.close()
