"""The OpenAI endpoint on a live run (one run for the file; the endpoint runs on a thread of its client, reached over
HTTP from here): a chat call's captured prompt ids are the tokenizer's own chat-template rendering, and its sampled
ids and log-probs (in the trajectory and in the answer's ``logprobs``) equal the Caller's ``generate`` on those ids
with the same seed; a two-turn chat whose second prompt extends the first call's ids is one trajectory whose ids are
the template's rendering of the conversation (one whose sample came back in other ids forks, and says so); bad
requests are 400s naming their field, and the endpoint answers the next request; a verifiers task played through
it is scored by its own rewards and captured token for token."""

from __future__ import annotations

import shutil

import pytest

from testkit import LiveRun
from testkit.openai_fake import post, rendered

pytestmark = pytest.mark.slow

# SmolLM2-Instruct's template with the tiny tokenizer's special tokens (<s>, </s>: its EOS) for <|im_start|>, <|im_end|>
TEMPLATE = ("{% for message in messages %}{{'<s>' + message['role'] + '\n' + message['content'] + '</s>' + '\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
START = [{"role": "system", "content": "You play a text game."}, {"role": "user", "content": "You see a door."}]


@pytest.fixture(scope="module")
def chat_model(tiny, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("openai") / "llama-chat"
    shutil.copytree(tiny["llama"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder), tokenizer


@pytest.fixture(scope="module")
def served(chat_model):
    live = LiveRun({"llms": {"chat": {"model": chat_model[0]}}, "threads_per_rank": 1})
    endpoint = live.function("testkit.openai_live:start", api_key="llmrl-live-key")
    yield live, endpoint
    live.function("testkit.openai_live:stop")
    assert live.close() == 0


def chat(endpoint, messages, rollout: str, **fields) -> dict:
    status, answer = post(endpoint["base_url"], "/v1/chat/completions", {"model": "chat", "messages": messages,
                                                                          **fields}, endpoint["api_key"],
                          {"X-Rollout-Id": rollout})
    assert status == 200, answer
    return answer


def test_the_capture_equals_generate_with_the_same_seed_and_prompt(served, chat_model):
    run, endpoint = served
    tokenizer = chat_model[1]
    answer = chat(endpoint, START, "same-seed", seed=11, temperature=0.9, top_p=0.95, max_tokens=6, n=2,
                  logprobs=True)
    prompt = rendered(tokenizer, START)
    (reference,) = run.generate([prompt], llm="chat", seed=11, max_new_tokens=6, do_sample=True, temperature=0.9,
                                top_p=0.95, top_k=0, num_return_sequences=2)
    captured = run.function("testkit.openai_live:pop", "same-seed")
    assert len(captured["trajectories"]) == 2  # the second choice: a sibling branch
    for trajectory, sample, choice in zip(captured["trajectories"], reference, answer["choices"]):
        tokens = sample["tokens"].tolist()
        assert trajectory["ids"] == prompt + tokens
        assert trajectory["sampling_logprobs"][len(prompt):] == sample["sampling_logprobs"].tolist()
        assert trajectory["model_logprobs"][len(prompt):] == sample["logprobs"].tolist()
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == sample["sampling_logprobs"].tolist()
        assert choice["message"]["content"] == sample["text"]


def test_a_two_turn_chat_is_one_trajectory_of_the_templates_ids(served, chat_model):
    """A random model's sample decodes to text that may tokenise into other ids (the rollout then forks, and says
    why): the first seed whose first reply comes back in the same ids gives the one-trajectory case."""
    run, endpoint = served
    tokenizer = chat_model[1]
    forked = None
    for seed in range(12):
        rollout = f"two-turns-{seed}"
        first = chat(endpoint, START, rollout, seed=seed, max_tokens=3)
        messages = START + [first["choices"][0]["message"], {"role": "user", "content": "It opens."}]
        second = chat(endpoint, messages, rollout, seed=seed, max_tokens=3, logprobs=True)
        captured = run.function("testkit.openai_live:pop", rollout)
        prompt = rendered(tokenizer, messages)
        if len(captured["trajectories"]) == 1:
            (trajectory,) = captured["trajectories"]
            assert captured["reasons"] == [None] and len(trajectory["turns"]) == 2
            assert trajectory["ids"][:len(prompt)] == prompt
            start, end = trajectory["turns"][1]
            assert (start, end) == (len(prompt), len(trajectory["ids"]))
            assert trajectory["sampling_logprobs"][start:end] == [t["logprob"] for t in
                                                                  second["choices"][0]["logprobs"]["content"]]
            break
        forked = captured
        assert captured["reasons"][0] is None and "differs from the earlier trajectory" in captured["reasons"][1]
        assert captured["trajectories"][1]["ids"][:len(prompt)] == prompt
    else:
        pytest.fail(f"no seed gave a reply that came back in its own ids; the last fork: {forked}")


def test_a_verifiers_task_on_the_live_model_is_scored_by_its_rewards_and_captured_as_generate_samples(served,
                                                                                                   chat_model):
    """run_verifiers on the live run's model (the endpoint in its client): each rollout's rewards are the task's
    reward functions computed by hand on its reply, and its one trajectory is the template's prompt followed by
    the tokens and log-probs the Caller's generate draws with the same seed."""
    pytest.importorskip("verifiers.v1")
    run, endpoint = served
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+2?"}]
    rollouts = run.function("testkit.openai_live:play_verifiers", "2+2?", "Answer with a number.", k=2,
                            sampling={"max_tokens": 5, "temperature": 0.9, "seed": 3})
    prompt = rendered(chat_model[1], messages)
    ((sample,),) = run.generate([prompt], llm="chat", seed=3, max_new_tokens=5, do_sample=True, temperature=0.9,
                                top_p=1.0, top_k=0)
    for rollout in rollouts:
        assert rollout["error"] is None, rollout
        reply = rollout["reply"]
        assert reply == sample["text"]
        by_hand = {"correct": float(reply == "4"), "brief": 0.5 * (len(reply) <= 2)}  # testkit.verifiers_tasks.Sum
        assert rollout["rewards"] == by_hand and rollout["reward"] == sum(by_hand.values())
        (trajectory,) = rollout["trajectories"]
        assert trajectory["ids"] == prompt + sample["tokens"].tolist()
        assert trajectory["sampling_logprobs"][len(prompt):] == sample["sampling_logprobs"].tolist()


def test_bad_requests_are_400s_naming_the_field_and_the_endpoint_goes_on(served):
    _, endpoint = served
    for fields, param in (({"presence_penalty": 1.0}, "presence_penalty"), ({"n": -1}, "n"),
                          ({"messages": [{"role": "user"}]}, "messages[0].content")):
        status, answer = post(endpoint["base_url"], "/v1/chat/completions",
                              {"model": "chat", "messages": START, **fields}, endpoint["api_key"])
        assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = post(endpoint["base_url"], "/v1/chat/completions", {"model": "chat", "messages": START,
                                                                          "max_tokens": 2}, "wrong-key")
    assert status == 401
    assert chat(endpoint, START, "after", max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")
