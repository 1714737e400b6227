"""What the cache across calls saves in a multi-turn episode: prompt tokens encoded per turn, with and without it.

    .venv/bin/llmrl run --config benchmarks/multiturn-cache.yaml benchmarks/multiturn_cache.py
    .venv/bin/llmrl run --config benchmarks/multiturn-cache.yaml benchmarks/multiturn_cache.py --mode choose

Two LLMs of the same model serve in one run, ``cached`` (``kv_cache_mb``) and ``plain`` (none). The same episodes
(greedy, so identical) are played by each with ``Caller.run_episodes``: ``envs`` environments for ``turns`` turns,
each turn's prompt the whole chat so far. Printed per turn and in total: the sum of the prompts' lengths (what a
cache-less server encodes), the prompt tokens the cached LLM encoded (``write``: from the generation counts of its
``kv_cache`` statistics; ``choose``: the prefix tokens its scoring looked up and did not find held), and each
LLM's seconds, with their ratio. The two LLMs' episodes are checked to be the same actions. It writes nothing.
"""

from __future__ import annotations

import argparse
import time

from llmrl import Caller

ROOMS = ["kitchen", "cellar", "attic", "hall", "study", "garden", "garage", "pantry"]


class Corridor:
    """A text environment that never ends by itself: each reply describes a room and lists four exits."""

    def __init__(self, index: int):
        self.index, self.turn = index, 0

    def _text(self) -> tuple[str, dict]:
        room = ROOMS[(self.index + 3 * self.turn) % len(ROOMS)]
        actions = ["go north", "go south", "go east", "go west"]
        text = (f"You are in the {room}. The walls are painted {['red', 'blue', 'green'][self.turn % 3]} and a lamp "
                f"hangs from the ceiling. Exits: {', '.join(actions)}.")
        return text, {"admissible_actions": actions}

    def reset(self):
        self.turn = 0
        return self._text()

    def step(self, action: str):
        self.turn += 1
        text, info = self._text()
        return text, 0.0, False, info


def counts(caller: Caller, llm: str) -> dict:
    servers, memory = caller.servers(), caller.server_memory()
    ranks = [memory[rank]["kv_cache"] for rank, info in servers.items() if info["llm"] == llm]
    return {"encoded": sum(r["generation"]["encoded_tokens"] for r in ranks),
            "looked_up": sum(r["lookup_tokens"] for r in ranks), "held": sum(r["hit_tokens"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["write", "choose"], default="write")
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    kwargs = {"mode": args.mode, "max_turns": args.turns, "temperature": 0.0,
              "system": "You explore a house. Reply with one exit.",
              "generate_kwargs": {"max_new_tokens": 6, "stop": ["\n"]} if args.mode == "write" else None}
    with Caller() as caller:
        seconds, episodes = {}, {}
        before = counts(caller, "cached")
        for llm in ("plain", "cached"):
            start = time.perf_counter()
            episodes[llm] = caller.run_episodes([Corridor(e) for e in range(args.envs)], llm=llm, **kwargs)
            seconds[llm] = time.perf_counter() - start
        after = counts(caller, "cached")
    same = all(a.actions == b.actions for a, b in zip(episodes["plain"], episodes["cached"]))
    history = 0
    for episode in episodes["cached"]:
        turns = episode.trajectory.turns
        history += sum(turn.start for turn in turns)  # each turn's prompt is everything before its first token
    print(f"{args.envs} episodes x {args.turns} turns ({args.mode}); the same actions with and without the cache: "
          f"{same}")
    if args.mode == "write":
        encoded = after["encoded"] - before["encoded"]
        print(f"prompt tokens: sum of the histories {history}, encoded with the cache {encoded} "
              f"({encoded / history:.1%}; {history / max(encoded, 1):.1f}x fewer)")
    else:  # scoring looks each prefix up (all but its last token, always encoded) before encoding the rest
        looked, held = after["looked_up"] - before["looked_up"], after["held"] - before["held"]
        print(f"prompt tokens: sum of the histories {history}; scoring looked up {looked} prefix tokens and found "
              f"{held} held ({held / max(looked, 1):.1%}), encoding the other {looked - held}")
    print(f"seconds: without the cache {seconds['plain']:.2f}, with it {seconds['cached']:.2f} "
          f"({seconds['plain'] / seconds['cached']:.2f}x)")


if __name__ == "__main__":
    main()
