"""The endpoint's capture, over HTTP on a scripted ``generate`` (:mod:`testkit.openai_fake`): a two-turn chat whose
second prompt extends the first prompt and completion is one ``Trajectory`` whose ids are the tokenizer's own
rendering of the conversation, the model's tokens masked and their sampling log-probs kept; a chat template that
drops earlier reasoning (Qwen3's way) forks the rollout into a second trajectory that says why, instead of training on
ids the model never saw; a completion that comes back in other ids forks too; ``n`` choices are sibling branches.
The rollout id comes from ``X-Rollout-Id`` or ``user`` (two different ones are refused); a rollout is popped once,
and one left alone is dropped after its timeout with a warning."""

from __future__ import annotations

import pytest

from llmrl import Trajectory, openai_endpoint
from llmrl.engine.openai_api.capture import Captures
from testkit.openai_fake import DROPS_REASONING, ScriptedCaller, chat_tokenizer, post, rendered

KEY = "llmrl-test-key"
START = [{"role": "user", "content": "Guess my number."}]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return chat_tokenizer(tiny["gpt2"])


def play(endpoint, caller, replies: list[str], rollout: str, **fields) -> list[dict]:
    """A chat of ``len(replies)`` turns (each user turn answered "Too high"); the messages, last reply included."""
    messages = list(START)
    for reply in replies:
        caller.replies.append(reply)
        status, answer = post(endpoint.base_url, "/v1/chat/completions", {"model": "main", "messages": messages,
                                                                            **fields}, KEY, {"X-Rollout-Id": rollout})
        assert status == 200, answer
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "Too high"}]
    return messages[:-1]


def test_a_two_turn_chat_is_one_trajectory_of_the_templates_ids(tokenizer):
    caller = ScriptedCaller(tokenizer)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        messages = play(endpoint, caller, ["Guess: 512", "Guess: 256"], "ep-1")
        rollout = endpoint.pop("ep-1")
        assert endpoint.rollout_ids() == []
        with pytest.raises(KeyError, match="ep-1"):
            endpoint.pop("ep-1")
    (trajectory,) = rollout.trajectories
    assert isinstance(trajectory, Trajectory) and rollout.reasons == [None] and rollout.calls == 2
    last = caller.ids("Guess: 256")
    assert trajectory.ids == rendered(tokenizer, messages[:-1]) + last  # the second prompt, then the sample
    assert trajectory.ids[:len(caller.calls[1][0][0])] == caller.calls[1][0][0]
    first = caller.ids("Guess: 512")
    turns = [(t.start, t.end) for t in trajectory.turns]
    assert [trajectory.ids[s:e] for s, e in turns] == [first, last]
    assert sum(trajectory.model_mask) == len(first) + len(last)
    for start, end in turns:
        assert trajectory.sampling_logprobs[start:end] == [-0.5 - k / 10 for k in range(end - start)]
        assert trajectory.model_logprobs[start:end] == [-1.0 - k / 10 for k in range(end - start)]


def test_a_template_that_drops_earlier_reasoning_forks_the_rollout(tiny):
    tokenizer = chat_tokenizer(tiny["gpt2"], DROPS_REASONING)
    caller = ScriptedCaller(tokenizer)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        messages = play(endpoint, caller, ["<think>big</think>Guess: 512", "Guess: 256"], "ep-2")
        rollout = endpoint.pop("ep-2")
    first, second = rollout.trajectories
    assert rollout.reasons[0] is None and "reasoning dropped" in rollout.reasons[1]
    assert first.ids == rendered(tokenizer, START) + caller.ids("<think>big</think>Guess: 512")
    assert second.ids == rendered(tokenizer, messages[:-1]) + caller.ids("Guess: 256")
    assert len(first.turns) == len(second.turns) == 1  # the second never claims the first turn's ids


def test_a_completion_that_comes_back_in_other_ids_forks_the_rollout(tokenizer):
    """The model sampled "Guess" letter by letter; the next prompt holds the tokenizer's own ids for it."""
    caller = ScriptedCaller(tokenizer)
    spelled = [t for ch in "Guess" for t in tokenizer.encode(ch, add_special_tokens=False)]
    assert spelled != tokenizer.encode("Guess", add_special_tokens=False)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        play(endpoint, caller, [spelled + [tokenizer.eos_token_id], "Guess: 256"], "ep-3")
        rollout = endpoint.rollout("ep-3")
    assert len(rollout.trajectories) == 2 and "inside the model's last completion" in rollout.reasons[1]
    assert rollout.trajectories[0].ids[-len(spelled) - 1:-1] == spelled  # kept as sampled


def test_n_choices_are_sibling_branches_and_the_next_call_continues_the_one_it_extends(tokenizer):
    caller = ScriptedCaller(tokenizer)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        caller.replies.extend(["A", "B"])
        status, answer = post(endpoint.base_url, "/v1/chat/completions",
                              {"model": "main", "messages": START, "n": 2, "user": "ep-4"}, KEY)
        assert status == 200
        chosen = answer["choices"][1]["message"]  # the agent goes on with the second choice
        caller.replies.append("C")
        messages = START + [chosen, {"role": "user", "content": "Why?"}]
        assert post(endpoint.base_url, "/v1/chat/completions", {"model": "main", "messages": messages,
                                                                 "user": "ep-4"}, KEY)[0] == 200
        rollout = endpoint.pop("ep-4")
    first, second = rollout.trajectories
    assert "choice 1 of the 2" in rollout.reasons[1]
    assert first.ids == rendered(tokenizer, START) + caller.ids("A")
    assert second.ids == rendered(tokenizer, messages) + caller.ids("C") and len(second.turns) == 2


def test_the_header_and_the_user_field_must_name_the_same_rollout(tokenizer):
    caller = ScriptedCaller(tokenizer)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        status, answer = post(endpoint.base_url, "/v1/chat/completions",
                              {"model": "main", "messages": START, "user": "a"}, KEY, {"X-Rollout-Id": "b"})
        assert status == 400 and answer["error"]["param"] == "user"
        caller.replies.append("A")
        assert post(endpoint.base_url, "/v1/chat/completions", {"model": "main", "messages": START}, KEY)[0] == 200
        assert endpoint.rollout_ids() == []  # no rollout id: answered, not captured


def test_a_rollout_left_alone_is_dropped_after_its_timeout_with_a_warning(tokenizer, monkeypatch):
    now = [0.0]
    captures = Captures(timeout=10.0, clock=lambda: now[0])
    warned = []
    monkeypatch.setattr("llmrl.engine.openai_api.capture.logger.warning", lambda *a: warned.append(a[0] % a[1:]))
    sample = {"tokens": [5, 6], "logprobs": [-1.0, -2.0]}
    captures.record("old", "main", [1, 2, 3], [sample])
    now[0] = 8.0
    captures.record("new", "main", [1, 2, 3], [sample])
    assert captures.ids() == ["old", "new"] and warned == []
    now[0] = 12.0
    captures.record("newer", "main", [4], [sample])
    assert captures.ids() == ["new", "newer"]
    assert len(warned) == 1 and "'old'" in warned[0] and "pop" in warned[0]
    (trajectory,) = captures.pop("new", lambda llm: tokenizer).trajectories
    assert trajectory.ids == [1, 2, 3, 5, 6] and trajectory.sampling_logprobs[3:] == [-1.0, -2.0]
