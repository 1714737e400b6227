"""Token-exact trajectories (``llmrl.Trajectory``) under SmolLM2-Instruct's chat template, with a tokenizer whose
``<|im_start|>`` / ``<|im_end|>`` are special tokens (as SmolLM2's are; ``<|im_end|>`` its EOS).

The reference is plain transformers rendering the whole conversation: when every sample is the tokenizer's own
encoding of its text, the trajectory's ids equal the whole conversation rendered and tokenised at once, turn after
turn; a sample in another tokenisation keeps its ids exactly (re-tokenising the history would change them); a
sample cut before its end-of-turn gets the template's whole closing. The datum trains on the model's tokens only.
GRPO's per-turn advantages over a group of episodes, by hand.
"""

from __future__ import annotations

import pytest

from llmrl import Trajectory

# SmolLM2-135M-Instruct's chat template, verbatim (it adds a default system prompt when none is given).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
REPLIES = ["Guess: 512", "Guess: 256", "Guess: 384"]
FEEDBACK = ["Too high", "Too low", "Correct"]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["gpt2"])  # byte-level BPE, no BOS
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = SMOLLM2
    return tok


def rendered(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sample(tokenizer, text: str, eos: bool = True) -> dict:
    tokens = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    return {"tokens": tokens, "sampling_logprobs": [-0.5 - 0.01 * k for k in range(len(tokens))]}


@pytest.mark.parametrize("start", [[{"role": "user", "content": "Guess my number."}],
                                   [{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]])
def test_each_turn_equals_the_whole_conversation_rendered_at_once(tokenizer, start):
    trajectory = Trajectory(tokenizer, start)
    messages = list(start)
    assert trajectory.prompt == rendered(tokenizer, messages)
    for reply, feedback in zip(REPLIES, FEEDBACK):
        before = trajectory.prompt
        trajectory.add_sample(sample(tokenizer, reply))
        trajectory.add_message(feedback)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
        assert trajectory.prompt == rendered(tokenizer, messages)
        assert trajectory.prompt[:len(before)] == before  # each prompt extends the previous one
    assert len(trajectory.turns) == 3 and sum(trajectory.model_mask) == sum(t.end - t.start for t in trajectory.turns)


def test_sampled_ids_are_kept_exactly_where_re_tokenising_would_change_them(tokenizer):
    trajectory = Trajectory(tokenizer, [{"role": "user", "content": "Say hello."}])
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "hello"] + [tokenizer.eos_token_id]  # one id a letter
    assert tokenizer.encode("hello", add_special_tokens=False) != spelled[:-1]  # not how the tokenizer writes it
    turn = trajectory.add_sample({"tokens": spelled, "logprobs": [-1.0] * len(spelled)})
    trajectory.add_message("Again.")
    assert trajectory.ids[turn.start:turn.end] == spelled
    again = rendered(tokenizer, [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"},
                                 {"role": "user", "content": "Again."}])
    assert trajectory.prompt != again and len(trajectory.prompt) > len(again)  # the drift re-tokenising makes
    tail = trajectory.prompt[turn.end:]  # after the sample, the same ids as the re-rendered conversation's
    assert again[len(again) - len(tail):] == tail


def test_a_sample_cut_before_its_end_of_turn_gets_the_templates_whole_closing(tokenizer):
    trajectory = Trajectory(tokenizer, [{"role": "user", "content": "Count."}])
    trajectory.add_sample(sample(tokenizer, "one two", eos=False))  # max_new_tokens reached
    trajectory.add_message("More.")
    assert trajectory.prompt == rendered(tokenizer, [{"role": "user", "content": "Count."},
                                                     {"role": "assistant", "content": "one two"},
                                                     {"role": "user", "content": "More."}])


def test_the_datum_trains_on_the_models_tokens_only(tokenizer):
    trajectory = Trajectory(tokenizer, [{"role": "user", "content": "Guess."}])
    samples = []
    for reply, feedback in zip(REPLIES[:2], FEEDBACK[:2]):
        samples.append(sample(tokenizer, reply))
        trajectory.add_sample(samples[-1])
        trajectory.add_message(feedback)
    datum = trajectory.datum([1.5, -0.5])
    inputs = datum["loss_fn_inputs"]
    assert datum["model_input"] == trajectory.ids[:-1] and inputs["target_tokens"] == trajectory.ids[1:]
    for turn, advantage, s in zip(trajectory.turns, [1.5, -0.5], samples):
        span = slice(turn.start - 1, turn.end - 1)  # target k is ids[k + 1]
        assert inputs["advantages"][span] == [advantage] * len(s["tokens"])
        assert inputs["logprobs"][span] == s["sampling_logprobs"]
    assert sum(a != 0 for a in inputs["advantages"]) == sum(len(s["tokens"]) for s in samples)
    with pytest.raises(ValueError, match="one per turn"):
        trajectory.datum([1.0])
    # for dro, whose penalty reads every position: the given log-probs where the model did not write, its own where
    # it did (zeros there pulled the environment's tokens towards probability 1)
    elsewhere = [-0.25 - k for k in range(len(trajectory.ids) - 1)]
    filled = trajectory.datum([1.5, -0.5], logprobs_elsewhere=elsewhere)["loss_fn_inputs"]["logprobs"]
    wrote = trajectory.model_mask[1:]
    assert [lp for lp, w in zip(filled, wrote) if w] == [lp for lp, w in zip(inputs["logprobs"], wrote) if w]
    assert [lp for lp, w in zip(filled, wrote) if not w] == [e for e, w in zip(elsewhere, wrote) if not w]
    with pytest.raises(ValueError, match="logprobs_elsewhere has 1 values: give one per target token"):
        trajectory.datum([1.5, -0.5], logprobs_elsewhere=[0.0])
    with pytest.raises(ValueError, match="add_message needs a trajectory started from chat messages"):
        Trajectory(tokenizer, [1, 2, 3]).add_message("hi")


def test_group_episode_advantages_by_hand():
    import torch

    from llmrl import Episode, group_episode_advantages
    from llmrl.engine.episode_returns import turn_returns

    returns = turn_returns(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), gamma=0.5).tolist()
    assert returns == [1.0 + 0.5 * 0.0 + 0.25 * 2.0, 0.0 + 0.5 * 2.0, 2.0]
    episodes = [Episode(trajectory=None, rewards=r) for r in ([1.0, 0.0, 2.0], [0.0, 0.0], [0.0, 1.0])]
    # returns with gamma 0.5: 1.5, 0.0, 0.5; mean 2/3; unbiased std sqrt(((5/6)^2 + (2/3)^2 + (1/6)^2) / 2)
    mean, std = 2 / 3, ((25 / 36 + 16 / 36 + 1 / 36) / 2) ** 0.5
    got = group_episode_advantages(episodes, gamma=0.5, eps=0.0)
    want = [[(g - mean) / std] * n for g, n in ((1.5, 3), (0.0, 2), (0.5, 2))]
    for row, expected in zip(got, want):
        assert row == pytest.approx(expected, abs=1e-12)
    assert group_episode_advantages(episodes, gamma=0.5, scale=False)[1] == pytest.approx([-2 / 3, -2 / 3])
    # equal returns: 0 for every turn (a later turn's return-to-go is never set against the episode returns)
    equal = [Episode(trajectory=None, rewards=[0.0, 0.0, 1.0]) for _ in range(3)]
    assert group_episode_advantages(equal, gamma=0.9) == [[0.0] * 3] * 3
    with pytest.raises(ValueError, match="at least 2 episodes"):
        group_episode_advantages(episodes[:1])


@pytest.mark.parametrize("start", [[{"role": "user", "content": "Call the tool."}],
                                   [{"role": "system", "content": "Play."}]])
def test_two_messages_in_a_row_render_as_the_template_does(tokenizer, start):
    """A tool's output then the user's message (after a sample), or a system-only start then the first message: the
    generation prompt the first one ended with gives way to the second, as in the whole conversation rendered."""
    trajectory, messages = Trajectory(tokenizer, start), list(start)
    if start[0]["role"] == "user":
        trajectory.add_sample(sample(tokenizer, "calling"))
        messages.append({"role": "assistant", "content": "calling"})
        trajectory.add_message("42", role="tool")
        messages.append({"role": "tool", "content": "42"})
    trajectory.add_message("Now answer.")
    messages.append({"role": "user", "content": "Now answer."})
    assert trajectory.prompt == rendered(tokenizer, messages)
    assert len(trajectory.model_mask) == len(trajectory.ids) == len(trajectory.sampling_logprobs)


# Gemma's chat template (roles, <start_of_turn> / <end_of_turn>), shortened: a turn ends with a special token that is
# not the tokenizer's EOS (generate stops on both: Gemma's generation config lists them).
GEMMA = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
         "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.fixture(scope="module")
def gemma_tokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["gpt2"])
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "eos_token": "<eos>",
                            "bos_token": "<bos>"})
    tok.chat_template = GEMMA
    return tok


def test_a_turn_ended_by_an_end_of_turn_token_other_than_eos_is_closed_once(gemma_tokenizer):
    tok = gemma_tokenizer
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn != tok.eos_token_id
    start = [{"role": "user", "content": "Guess my number."}]
    trajectory, messages = Trajectory(tok, start), list(start)
    for reply, feedback in zip(REPLIES, FEEDBACK):
        trajectory.add_sample({"tokens": tok.encode(reply, add_special_tokens=False) + [end_of_turn]})
        trajectory.add_message(feedback)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
        assert trajectory.prompt == rendered(tok, messages)


# Qwen2.5's handling of tool calls and tool responses, shortened, in ChatML.
TOOLS = ("{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls is defined %}"
         "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
         "{%- for call in message.tool_calls %}{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", "
         "\"arguments\": ' }}{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}"
         "{{- '<|im_end|>\n' }}{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + "
         "message.content + '\n</tool_response><|im_end|>\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\n' + "
         "message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
         "{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_messages_keep_their_tool_calls_and_other_keys(tokenizer):
    from llmrl.engine.client.chat import check_messages

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "18C", "name": "get_weather", "tool_call_id": "c1"}]
    kept = check_messages(messages, "contexts[0]")
    assert kept == messages and kept[1] is not messages[1]
    tokenizer.chat_template, before = TOOLS, tokenizer.chat_template
    try:
        want = rendered(tokenizer, messages)
        assert "<tool_call>" in tokenizer.decode(want)
        assert Trajectory(tokenizer, messages).prompt == want
        trajectory = Trajectory(tokenizer, messages[:1])
        trajectory.add_sample(sample(tokenizer, ""))
        trajectory.messages[-1] = messages[1]  # the script parses its sample into the call it made
        trajectory.add_message("18C", role="tool", name="get_weather", tool_call_id="c1")
        assert trajectory.messages[-1] == messages[2]
    finally:
        tokenizer.chat_template = before
    with pytest.raises(TypeError, match=r"contexts\[0\]\[1\]\['content'\]"):
        check_messages([messages[0], {"role": "assistant", "content": None}], "contexts[0]")


def test_the_end_of_turn_token_is_the_one_the_template_closes_a_model_turn_with(tokenizer, gemma_tokenizer):
    """What choose mode appends to each action: ChatML's <|im_end|>, Gemma's <end_of_turn> (not its EOS); a
    trajectory started from ids has only the EOS to go by."""
    start = [{"role": "user", "content": "Go."}]
    assert Trajectory(tokenizer, start).end_of_turn_id() == tokenizer.convert_tokens_to_ids("<|im_end|>")
    gemma = Trajectory(gemma_tokenizer, start).end_of_turn_id()
    assert gemma == gemma_tokenizer.convert_tokens_to_ids("<end_of_turn>") != gemma_tokenizer.eos_token_id
    assert Trajectory(gemma_tokenizer, [5, 6, 7]).end_of_turn_id() == gemma_tokenizer.eos_token_id


def test_a_refused_message_leaves_the_trajectory_as_it_was(tokenizer):
    """A template whose rendering is not an extension refuses the message; the generation prompt the message would
    have replaced is still there, and so is every id, and the next generate reads the same prompt."""
    tokenizer.chat_template, before = (
        "{% for m in messages %}{% if loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% else %}{{ '[' + m['content'] + ']' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"), tokenizer.chat_template
    try:
        trajectory = Trajectory(tokenizer, [{"role": "user", "content": "Go."}])
        prompt = trajectory.prompt
        with pytest.raises(ValueError, match="not an extension"):
            trajectory.add_message("and then?")
        assert trajectory.prompt == prompt and len(trajectory.model_mask) == len(prompt)
        assert len(trajectory.messages) == 1
    finally:
        tokenizer.chat_template = before
