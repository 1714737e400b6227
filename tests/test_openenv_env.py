"""OpenEnv environments through :class:`llmrl.engine.envs.openenv_env.OpenEnvEnv`, against a guessing game served
by OpenEnv's own server on loopback (:mod:`testkit.openenv_server`): episodes that ``run_episodes`` plays through the
adapter (the model a scripted stand-in whose guesses bisect on the observations it reads in its prompt) give the same
actions, observations, rewards and ends as a hand-driven loop of OpenEnv's ``GenericEnvClient`` with the same
guesses. A text that does not parse ends its episode with the parse penalty and the error recorded, and an
environment that fails on a step ends only its own episode."""

from __future__ import annotations

import re

import pytest

from llmrl.engine.client.episodes import run_episodes
from llmrl.engine.envs.openenv_env import OpenEnvEnv, parse_json_action, render_observation
from testkit.openai_fake import chat_tokenizer

USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def policy(seed: int, observations: list[str]) -> str:
    """Bisection on 1..10 from the observations so far; seed 5 writes no JSON, seed 8 guesses 0 (the server
    raises)."""
    if seed == 5:
        return "I pass"
    if seed == 8:
        return '{"guess": 0}'
    low, high, guess = 1, 10, 5
    for seen in observations[1:]:
        low, high = (guess + 1, high) if seen == "higher" else (low, guess - 1)
        guess = (low + high) // 2
    return f'My guess: {{"guess": {guess}}}'


class BisectingCaller:
    """``generate_async`` answers each prompt with :func:`policy` on the observations it reads in the prompt (the
    first one names the game's seed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_tokenizer(self, llm=None):
        return self.tokenizer

    def generate_async(self, prompts, **kwargs):
        out = []
        for prompt in prompts:
            observations = USER.findall(self.tokenizer.decode(prompt))
            text = policy(int(re.match(r"Game (\d+)", observations[0]).group(1)), observations)
            tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append([{"tokens": tokens, "text": text, "logprobs": [-1.0] * len(tokens)}])
        return _Done(out)


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


@pytest.fixture(scope="module")
def server():
    """OpenEnv's server (imported here, not when the suite is collected: seconds of imports)."""
    pytest.importorskip("openenv")
    from testkit.openenv_server import serve

    with serve() as url:
        yield url


def hand_loop(url: str, seed: int, max_turns: int) -> dict:
    from openenv.core import GenericEnvClient

    with GenericEnvClient(base_url=url).sync() as client:
        first = client.reset(seed=seed)
        observations, actions, rewards, done = [first.observation["text"]], [], [], False
        while not done and len(actions) < max_turns:
            action = policy(seed, observations)
            actions.append(action)
            result = client.step(parse_json_action(action))
            rewards.append(result.reward)
            done = result.done
            observations.append(result.observation["text"])
    return {"observations": observations, "actions": actions, "rewards": rewards, "done": done}


def play(server, seeds, tiny, **kwargs):
    from openenv.core import GenericEnvClient

    envs = [OpenEnvEnv(GenericEnvClient(base_url=server), reset_kwargs={"seed": s}, **kwargs) for s in seeds]
    try:
        return run_episodes(BisectingCaller(chat_tokenizer(tiny["gpt2"])), envs, mode="write", max_turns=4)
    finally:
        for env in envs:
            env.close()


def test_episodes_through_the_adapter_equal_a_hand_driven_loop(server, tiny):
    seeds = [3, 6, 9, 11, 0]
    for seed, episode in zip(seeds, play(server, seeds, tiny)):
        expected = hand_loop(server, seed, 4)
        assert episode.actions == expected["actions"] and episode.rewards == expected["rewards"]
        shown = [m["content"] for m in episode.trajectory.messages if m["role"] == "user"]
        ended = expected["done"]  # the observation after the winning step is not added: no turn follows it
        assert shown == expected["observations"][:len(expected["observations"]) - ended]
        assert episode.done and episode.truncated == (not ended)
        assert all(info["parsed"] and "error" not in info for info in episode.infos)
    assert [len(e.actions) for e in play(server, [4], tiny)] == [1]  # game 4 hides 5: right at once


def test_a_text_that_does_not_parse_or_a_failing_step_ends_only_its_episode(server, tiny):
    episodes = play(server, [5, 8, 3], tiny, parse_penalty=-1.0)
    unparsed, broken, fine = episodes
    assert unparsed.rewards == [-1.0] and unparsed.done and not unparsed.truncated
    assert "'I pass' did not parse" in unparsed.infos[-1]["error"] and unparsed.infos[-1]["parsed"] is False
    assert broken.rewards == [0.0] and broken.done and "guess 0 breaks the game" in broken.infos[-1]["error"]
    assert fine.actions == hand_loop(server, 3, 4)["actions"] and "error" not in fine.infos[-1]


def test_render_and_parse_defaults():
    assert render_observation({"text": "hi", "reward": 1}) == "hi"
    assert render_observation({"board": [1, 2], "done": False}) == '{"board": [1, 2]}'
    assert parse_json_action('x {"a": 1} y') == {"a": 1}
    with pytest.raises(ValueError, match="no JSON object"):
        parse_json_action("{not json")
