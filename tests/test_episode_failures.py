"""An environment that fails (its ``step`` raises, answers in another shape, with an observation that is not text or
a reward that is not finite, or with ``step_timeout`` a ``step`` that does not return) ends its own episode with
``Episode.error``; the other episodes play on exactly as
they play without it, and ``episode_batch`` leaves the failed one out. The Caller is a stand-in that answers every
prompt with the same text (no server)."""

from __future__ import annotations

import math
import threading

import pytest

from llmrl.engine.client.episodes import episode_batch, run_episodes
from testkit.openai_fake import chat_tokenizer


class Counter:
    """Counts to 3 and is done: reward 1 per step; ``fault`` says how it fails at its second step."""

    def __init__(self, fault: str | None = None):
        self.fault, self.steps = fault, 0
        self.release = threading.Event()  # a hanging step returns once the test sets it

    def reset(self):
        self.steps = 0
        if self.fault == "reset hangs":
            self.release.wait()
        return "count", {}

    def step(self, action):
        self.steps += 1
        if self.steps == 2 and self.fault == "raises":
            raise RuntimeError("the game crashed")
        if self.steps == 2 and self.fault == "shape":
            return "next", 1.0
        if self.steps == 2 and self.fault == "observation":
            return {"text": "next"}, 1.0, False, False, {}
        if self.steps == 2 and self.fault == "reward":
            return "next", math.nan, False, False, {}
        if self.steps == 2 and self.fault == "hangs":
            self.release.wait()
        return f"step {self.steps}", 1.0, self.steps == 3, False, {}


class EchoCaller:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_tokenizer(self, llm=None):
        return self.tokenizer

    def generate_async(self, prompts, **kwargs):
        tokens = self.tokenizer.encode("go", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Done([[{"tokens": tokens, "text": "go", "logprobs": [-0.5] * len(tokens)}] for _ in prompts])


class Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


@pytest.mark.parametrize("fault, error", [("raises", "RuntimeError: the game crashed"),
                                          ("shape", "TypeError: envs[1].step() must return"),
                                          ("observation", "TypeError: envs[1].step() returned an observation of type "
                                                          "dict"),
                                          ("reward", "ValueError: envs[1].step() returned the reward nan"),
                                          ("hangs", "TimeoutError: envs[1].step() did not return within 1 s")])
def test_a_failing_environment_ends_its_episode_alone(tiny, fault, error):
    caller = EchoCaller(chat_tokenizer(tiny["gpt2"]))
    alone = run_episodes(caller, [Counter(), Counter()], mode="write", max_turns=5)
    envs = [Counter(), Counter(fault), Counter()]
    timeout = {"step_timeout": 1.0} if fault == "hangs" else {}  # a step that never returns until released
    try:
        episodes = run_episodes(caller, envs, mode="write", max_turns=5, **timeout)
    finally:
        envs[1].release.set()
    failed = episodes[1]
    assert failed.error.startswith(error) and failed.cut_by == "error" and failed.done and failed.truncated
    assert failed.actions == ["go", "go"] and failed.rewards == [1.0, 0.0]  # its failed turn counts nothing
    assert failed.infos[-1] == {"error": failed.error}
    for played, reference in zip([episodes[0], episodes[2]], alone):  # the others, as if it were not there
        assert played.error is None and played.rewards == reference.rewards == [1.0, 1.0, 1.0]
        assert played.trajectory.ids == reference.trajectory.ids
    batch = episode_batch([[episodes[0], failed, episodes[2]]])
    assert batch == episode_batch([[episodes[0], episodes[2]]])
    with pytest.raises(ValueError, match="every episode's environment failed"):
        episode_batch([[failed]])


@pytest.mark.parametrize("step_timeout", [0, -1.0, float("nan"), "5", True])
def test_a_step_timeout_that_is_not_a_positive_number_of_seconds_is_refused(tiny, step_timeout):
    with pytest.raises(ValueError, match="step_timeout must be a number of seconds > 0"):
        run_episodes(EchoCaller(chat_tokenizer(tiny["gpt2"])), [Counter()], step_timeout=step_timeout)


def test_a_reset_that_hangs_past_the_step_timeout_raises_naming_the_environment(tiny):
    envs = [Counter(), Counter("reset hangs")]
    try:
        with pytest.raises(TimeoutError, match=r"envs\[1\]\.reset\(\) did not return within 1 s \(step_timeout\)"):
            run_episodes(EchoCaller(chat_tokenizer(tiny["gpt2"])), envs, step_timeout=1.0)
    finally:
        envs[1].release.set()
