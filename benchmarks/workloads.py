"""The benchmark's RL-shaped workloads, made from a tokenizer and a seed: text-game contexts with candidates, episodes
with growing history prompts, and a BabyAI rollout of a random policy.

Used by :mod:`benchmarks.run` and :mod:`benchmarks.profile_scoring`; it measures nothing.
"""

from __future__ import annotations

import random

from benchmarks.kit import ppo_demo

ACTIONS = ["go forward", "turn left", "turn right", "pick up", "drop", "toggle", "open the door", "go to the red ball",
           "pick up the blue key", "go to the green box", "open the yellow door", "put the key next to the ball",
           "look around", "wait", "go back", "close the door"]


COLORS = ["red", "green", "blue", "purple", "yellow", "grey"]


OBJECTS = ["ball", "box", "key", "door", "wall"]


def make_workload(tokenizer, contexts: int, context_tokens: int, candidates: int, seed: int = 0) -> list[dict]:
    """Text-game observations of about ``context_tokens`` tokens, with action candidates of 2-5 tokens."""
    rng = random.Random(seed)
    work = []
    for i in range(contexts):
        text = f"Episode {i}. Your goal: go to the {rng.choice(COLORS)} {rng.choice(OBJECTS)}."
        while len(tokenizer(text)["input_ids"]) < context_tokens:
            text += (f" You see a {rng.choice(COLORS)} {rng.choice(OBJECTS)} {rng.randint(1, 6)} steps "
                     f"{rng.choice(['forward', 'left', 'right'])}.")
        text += " Next action:"
        pool = set()
        while len(pool) < candidates:
            action = rng.choice(ACTIONS)
            if len(pool) >= len(ACTIONS) or action in pool:
                action = f"{rng.choice(['go to', 'pick up', 'open'])} the {rng.choice(COLORS)} {rng.choice(OBJECTS)}"
            pool.add(action)
        work.append({"context": text, "candidates": [" " + a for a in sorted(pool)]})
    return work


def make_episodes(tokenizer, envs: int, steps: int, header_tokens: int, step_tokens: int, candidates: int,
                  seed: int) -> list[tuple[list[str], list[list[str]]]]:
    """The calls of ``envs`` text-game episodes scored in lockstep, one call per step: a static header of about
    ``header_tokens`` tokens, then each step's context is the previous one, the action taken and about
    ``step_tokens`` tokens of new observation (a history-based prompt), with ``candidates`` actions."""
    rng = random.Random(seed)
    header = (f"You are an agent in a grid world (run {seed}). Your goal: go to the {rng.choice(COLORS)} "
              f"{rng.choice(OBJECTS)}. Possible actions: " + ", ".join(ACTIONS[:10]) + ".")
    while len(tokenizer(header)["input_ids"]) < header_tokens:
        header += " Answer with one action."
    histories = [header for _ in range(envs)]
    calls = []
    for step in range(steps):
        contexts, options = [], []
        for e in range(envs):
            start = len(tokenizer(histories[e])["input_ids"])
            text = histories[e] + f" Step {step}:"
            while len(tokenizer(text)["input_ids"]) - start < step_tokens:
                text += (f" you see a {rng.choice(COLORS)} {rng.choice(OBJECTS)} {rng.randint(1, 6)} steps "
                         f"{rng.choice(['forward', 'left', 'right'])};")
            text += " Action:"
            contexts.append(text)
            options.append([" " + a for a in rng.sample(ACTIONS, candidates)])
            histories[e] = text + options[-1][rng.randrange(candidates)] + "."
        calls.append((contexts, options))
    return calls


def babyai_rollout(transitions: int, seed: int) -> tuple[list[str], list[list[str]]]:
    """The prompts and actions of the PPO demo's rollout (``examples/ppo_babyai.py``: its level, prompt, 16
    environments, 24-step episodes, no walls), taken by a uniformly random policy (the untrained model's is nearly
    uniform). States repeat, as they do in the demo: the same view gives the same prompt."""
    ppo_babyai = ppo_demo()
    demo, envs = ppo_babyai.Args(), 16
    env = ppo_babyai.TextVecEnv(demo.level, envs, seeds=[seed + k for k in range(envs)], max_steps=demo.max_steps,
                                seed_stride=envs, walls=demo.walls)
    rng = random.Random(seed)
    obs = env.reset()
    contexts, options = [], []
    for _ in range(transitions // envs):
        contexts += [ppo_babyai.prompt(o) for o in obs]
        options += [ppo_babyai.candidates(o) for o in obs]
        obs, *_ = env.step([rng.choice(o.actions) for o in obs])
    return contexts, options
