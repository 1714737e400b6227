"""verifiers tasks through the OpenAI endpoint (:mod:`llmrl.engine.envs.verifiers_env`), on a scripted stand-in for
``Caller.generate`` (:mod:`testkit.openai_fake`), so that every reply is known: each rollout's reward is the one its
task's ``@vf.reward`` functions give by hand on the same completions (weights applied), and its captured trajectory
holds exactly the ids generate produced, after the chat template's own rendering of each prompt. Three tasks
(:mod:`testkit.verifiers_tasks`): a single-turn question, a guess-a-number game (``respond`` replies), and a task
with one Python tool. A rollout whose ``respond`` raises or hangs ends with its error, and the batch goes on and
counts it."""

from __future__ import annotations

import json
import threading

import pytest

from llmrl import openai_endpoint
from llmrl.engine.envs.verifiers_env import Play, run_verifiers
from testkit.openai_fake import ScriptedCaller, chat_tokenizer, rendered

# ChatML that renders tools and writes tool calls as <tool_call> JSON (as the model wrote them, so no fork)
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m.get('content') or '') }}"
    "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>{\"name\": \"' + c['function']['name'] + "
    "'\", \"arguments\": ' + (c['function']['arguments'] | tojson) + '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
KEY = "llmrl-test-key"


def guess_reply(task, messages):
    guess = messages[-1]["content"]
    return None if guess == "7" else ("higher" if guess.isdigit() and int(guess) < 7 else "lower")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def tasks():
    """:mod:`testkit.verifiers_tasks` (it imports verifiers: here, not when the suite is collected)."""
    pytest.importorskip("verifiers.v1")
    from testkit import verifiers_tasks

    return verifiers_tasks


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return chat_tokenizer(tiny["gpt2"], TEMPLATE)


@pytest.fixture
def served(tokenizer):
    caller = ScriptedCaller(tokenizer)
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        yield caller, endpoint


def sample_ids(caller, text):
    return caller.ids(text)


def test_single_turn_rewards_are_the_tasks_own_and_the_ids_are_generates(served, tokenizer, tasks):
    caller, endpoint = served
    replies = ["4", "5", "four!"]
    caller.replies.extend(replies)
    task = tasks.Sum(tasks.vf.TaskData(prompt="2+2?", system_prompt="Answer with a number."))
    result = run_verifiers(endpoint, [task], Play(k=3, concurrency=1, sampling={"max_tokens": 8}))
    (rollouts,) = result.rollouts
    by_hand = [1.0 * (r == "4") + 0.5 * (len(r) <= 2) for r in replies]  # correct + 0.5 * brief
    assert [r.reward for r in rollouts] == by_hand == [1.5, 0.5, 0.0]
    assert [r.rewards for r in rollouts] == [{"correct": float(r == "4"), "brief": 0.5 * (len(r) <= 2)}
                                             for r in replies]
    prompt = rendered(tokenizer, [{"role": "system", "content": "Answer with a number."},
                                  {"role": "user", "content": "2+2?"}])
    for rollout, reply, (contexts, kwargs) in zip(rollouts, replies, caller.calls):
        assert contexts == [prompt] and kwargs["max_new_tokens"] == 8
        (trajectory,) = rollout.trajectories
        ids = sample_ids(caller, reply)
        assert trajectory.ids == prompt + ids
        assert trajectory.model_mask == [False] * len(prompt) + [True] * len(ids)
        assert trajectory.sampling_logprobs[len(prompt):] == [-0.5 - k / 10 for k in range(len(ids))]
    batch = result.batch()
    assert batch["contexts"] == [prompt]
    assert batch["candidates"] == [[sample_ids(caller, r) for r in replies]]
    assert batch["turn_rewards"] == [[[1.5], [0.5], [0.0]]]
    assert result.stats()["trainable"] == 3 and result.stats()["failed"] == 0


def test_a_guessing_game_is_one_trajectory_per_rollout(served, tokenizer, tasks):
    caller, endpoint = served
    games = [["3", "7"], ["9", "8", "7"]]
    caller.replies.extend(reply for game in games for reply in game)
    task = tasks.Guess(tasks.vf.TaskData(prompt="Guess my number from 1 to 10."))
    result = run_verifiers(endpoint, [task], Play(k=2, concurrency=1, respond=guess_reply))
    for rollout, game in zip(result.rollouts[0], games):
        assert rollout.reward == 1.0 and rollout.metrics == {"guesses": float(len(game))}
        assert [m["content"] for m in rollout.messages if m["role"] == "assistant"] == game
        (trajectory,) = rollout.trajectories
        last_prompt = rendered(tokenizer, rollout.messages[:-1])  # the template's rendering of the whole game
        assert trajectory.ids == last_prompt + sample_ids(caller, "7")
        assert len(trajectory.turns) == len(game)
        for turn, reply in zip(trajectory.turns, game):
            assert trajectory.ids[turn.start:turn.end] == sample_ids(caller, reply)
    assert result.batch()["turn_rewards"] == [[[0.0, 1.0], [0.0, 0.0, 1.0]]]


def test_a_tool_call_runs_the_python_tool_and_its_result_reaches_the_model(served, tokenizer, tasks):
    caller, endpoint = served
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    caller.replies.extend([call, "5", call, "6"])
    result = run_verifiers(endpoint, [tasks.Tool(tasks.vf.TaskData(prompt="What is 2+3? Use the tool."))],
                           Play(k=2, concurrency=1, tools=(add,)))
    assert [r.reward for r in result.rollouts[0]] == [1.0, 0.0], [r.error for r in result.rollouts[0]]
    rollout = result.rollouts[0][0]
    assert [m["role"] for m in rollout.messages] == ["user", "assistant", "tool", "assistant"]
    assert rollout.messages[2]["content"] == "5"
    assert rollout.messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    schema = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    (trajectory,) = rollout.trajectories
    as_sent = json.loads(json.dumps(rollout.messages[:-1]))  # the endpoint gives templates the arguments as a mapping
    as_sent[1]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    second_prompt = rendered(tokenizer, as_sent, [schema])
    assert caller.calls[1][0] == [second_prompt]
    assert trajectory.ids == second_prompt + sample_ids(caller, "5")
    assert [trajectory.ids[t.start:t.end] for t in trajectory.turns] == [sample_ids(caller, call),
                                                                       sample_ids(caller, "5")]


def test_a_failing_or_hanging_environment_ends_its_rollout_and_the_batch_goes_on(served, tasks):
    caller, endpoint = served
    release = threading.Event()

    def respond(task, messages):
        if messages[-1]["content"] == "boom":
            raise RuntimeError("the game broke")
        if messages[-1]["content"] == "hang":
            release.wait(60)
        return None

    caller.replies.extend(["7", "boom", "hang", "7"])
    try:
        result = run_verifiers(endpoint, [tasks.Guess(tasks.vf.TaskData(prompt="Guess."))],
                               Play(k=4, concurrency=1, respond=respond, timeout=2.0))
    finally:
        release.set()
    rollouts = result.rollouts[0]
    assert [r.error is None for r in rollouts] == [True, False, False, True]
    assert "RuntimeError: the game broke" in rollouts[1].error and "timeout" in rollouts[2].error
    stats = result.stats()
    assert (stats["rollouts"], stats["trainable"], stats["failed"], stats["groups"]) == (4, 2, 2, 1)
    assert set(stats["errors"]) == {rollouts[1].rollout_id, rollouts[2].rollout_id}
    assert result.batch()["turn_rewards"] == [[[1.0], [1.0]]]


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="Play.k"):
        Play(k=0)
    with pytest.raises(TypeError, match="not callable"):
        Play(tools=("add",))
