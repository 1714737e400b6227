"""Chat messages as contexts, the served tokenizer on the client, and token-exact trajectories.

``score`` and ``generate`` given chat messages equal the same calls given the token ids plain transformers renders
with the tokenizer's chat template and generation prompt (scores also equal plain Hugging Face's); string
candidates after a chat context are the tokenizer's encoding of the string alone. ``get_tokenizer()`` on the client
is the served tokenizer (the same ids). A tokenizer without a chat template, and a malformed message, are refused
naming the LLM or the message, and the servers go on. Over a 10-turn ``Trajectory`` whose prompts ``generate``
extends (SmolLM2's template with the tiny model's own special tokens), every generated token's log-prob, scored
again over the whole trajectory in one ``forward``, equals what ``generate`` returned.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from testkit import LiveRun

pytestmark = pytest.mark.slow

# SmolLM2-Instruct's template with the tiny tokenizer's special tokens (<s>, </s>: its EOS) for <|im_start|>,
# <|im_end|>; the first chat has no system message, so the template adds its default one.
SMOLLM2_TINY = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<s>"
                "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face</s>\n' }}{% endif %}"
                "{{'<s>' + message['role'] + '\n' + message['content'] + '</s>' + '\n'}}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
CHATS = [[{"role": "system", "content": "You play a text game."}, {"role": "user", "content": "You see a door."}],
         [{"role": "user", "content": "Goal: go to the red ball"}, {"role": "assistant", "content": "go forward"},
          {"role": "user", "content": "You see a wall."}]]
ACTIONS = [[" open door", "go north"], ["turn left", " turn right", "pick up"]]


@pytest.fixture(scope="module")
def chat_model(tiny, tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat") / "llama-chat"
    shutil.copytree(tiny["llama"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = SMOLLM2_TINY
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def run(chat_model, tiny):
    live = LiveRun({"llms": {"chat": {"model": chat_model}, "plain": {"model": tiny["llama"]}}, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def test_chat_contexts_score_and_generate_as_their_rendered_ids(run, chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in CHATS]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    assert tokenizer.decode(ids[0]).endswith("<s>assistant\n")
    actions = [[tokenizer.encode(a, add_special_tokens=False) for a in row] for row in ACTIONS]
    got = run.score(CHATS, ACTIONS, llm="chat")
    want = run.score(ids, actions, llm="chat")
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    for row, want_row, context, cands in zip(got, want, ids, actions):
        torch.testing.assert_close(row, want_row, atol=0, rtol=0)
        with torch.no_grad():
            for score, cand in zip(row, cands):  # plain Hugging Face on the rendered ids
                logp = torch.log_softmax(model(input_ids=torch.tensor([context + cand])).logits[0].float(), -1)
                plain = sum(float(logp[len(context) + t - 1, tok]) for t, tok in enumerate(cand))
                assert float(score) == pytest.approx(plain, abs=1e-4)
    greedy = {"max_new_tokens": 6, "do_sample": False}
    by_chat, by_ids = run.generate(CHATS, llm="chat", **greedy), run.generate(ids, llm="chat", **greedy)
    for a, b in zip(by_chat, by_ids):
        assert a[0]["tokens"].tolist() == b[0]["tokens"].tolist()
        torch.testing.assert_close(a[0]["logprobs"], b[0]["logprobs"], atol=0, rtol=0)
    client = run.get_tokenizer(llm="chat")  # the served tokenizer, on the client
    assert client.chat_template == SMOLLM2_TINY
    assert client.encode("You see a door.") == tokenizer.encode("You see a door.")


def test_chat_contexts_without_a_template_or_with_a_bad_message_are_refused_by_name(run):
    with pytest.raises(Exception, match="tokenizer of LLM 'plain' has no chat template"):
        run.score(CHATS, ACTIONS, llm="plain")
    with pytest.raises(Exception, match=r"contexts\[1\]\[2\] needs a 'role'"):
        run.generate([CHATS[0], CHATS[1][:2] + [{"content": "no role"}]], llm="chat", max_new_tokens=2)
    with pytest.raises(Exception, match=r"contexts\[0\]\[0\]\['content'\] must be a string"):
        run.generate([[{"role": "user", "content": 3}]], llm="chat", max_new_tokens=2)
    assert len(run.score(CHATS, ACTIONS, llm="chat")) == 2  # the servers go on


def test_a_ten_turn_trajectorys_log_probs_scored_at_once_equal_generates(run, chat_model):
    from transformers import AutoTokenizer

    from llmrl import Trajectory

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    trajectory = Trajectory(tokenizer, [{"role": "system", "content": "Guess."}, {"role": "user", "content": "Go."}])
    samples = []
    for turn in range(10):
        before = trajectory.prompt
        sample = run.generate([before], llm="chat", max_new_tokens=4, do_sample=True, seed=turn)[0][0]
        samples.append(sample)
        trajectory.add_sample(sample)
        trajectory.add_message("low" if turn % 2 else "high")
        assert trajectory.prompt[:len(before)] == before
    out = run.forward([trajectory.datum([0.0] * 10)], llm="chat")["loss_fn_outputs"][0]["logprobs"]
    for turn, sample in zip(trajectory.turns, samples):
        assert trajectory.ids[turn.start:turn.end] == sample["tokens"].tolist()
        torch.testing.assert_close(out[turn.start - 1:turn.end - 1], sample["logprobs"], atol=1e-5, rtol=0)
    assert sum(len(s["tokens"]) for s in samples) >= 10 and len(trajectory.ids) < 512


@pytest.mark.parametrize("mode", ["choose", "write"])
def test_episodes_of_several_environments_are_token_exact_trajectories(run, mode):
    from testkit.envs import ACTIONS, DoorEnv

    envs = [DoorEnv(room, turns=2 + room % 2) for room in range(3)]
    kwargs = {"mode": mode, "max_turns": 3, "seed": 5, "llm": "chat"}
    if mode == "write":
        kwargs["generate_kwargs"] = {"max_new_tokens": 3}
    episodes = run.run_episodes(envs, **kwargs)
    again = run.run_episodes([DoorEnv(room, turns=2 + room % 2) for room in range(3)], **kwargs)
    assert [e.actions for e in again] == [e.actions for e in episodes]  # the same seed: the same episodes
    tokenizer = run.get_tokenizer(llm="chat")
    for room, episode in enumerate(episodes):
        assert len(episode.actions) == 2 + room % 2 == len(episode.trajectory.turns) and episode.done
        assert episode.rewards == [float(a == "open door") for a in episode.actions]
        if mode == "choose":
            assert set(episode.actions) <= set(ACTIONS)
            for turn, action in zip(episode.trajectory.turns, episode.actions):  # the action's ids, then EOS
                ids = episode.trajectory.ids[turn.start:turn.end]
                assert ids == tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id]
        datum = episode.trajectory.datum([1.0] * len(episode.actions))
        scored = run.forward([datum], llm="chat")["loss_fn_outputs"][0]["logprobs"]
        recorded = torch.tensor(episode.trajectory.model_logprobs[1:])  # the model's, as the turn was played
        mask = torch.tensor(episode.trajectory.model_mask[1:])
        torch.testing.assert_close(scored[mask], recorded[mask], atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="mode must be one of"):
        run.run_episodes(envs, mode="act", llm="chat")
    with pytest.raises(Exception, match=r"envs\[2\] is the same object as envs\[0\]"):
        run.run_episodes([envs[0], envs[1], envs[0]], mode=mode, llm="chat")
    with pytest.raises(Exception, match="generate_kwargs set how mode 'write' generates"):
        run.run_episodes(envs, mode="choose", llm="chat", generate_kwargs={"max_new_tokens": 3})
    with pytest.raises(Exception, match="max_turns must be an int >= 1"):
        run.run_episodes(envs, mode=mode, llm="chat", max_turns=0)


def test_gymnasium_environments_truncate_and_misshapen_steps_are_refused_by_name(run):
    """gymnasium's 5-value step: ``truncated`` ends the episode as cut short (``Episode.truncated``), ``terminated``
    as done; a step of another shape ends its own episode with the error naming the environment (``Episode.error``),
    and the other episode plays to its end."""
    from testkit.envs import DoorEnv, GymnasiumDoorEnv, ThreeValueEnv

    episodes = run.run_episodes([GymnasiumDoorEnv(0, cut=2), DoorEnv(1, turns=2)], mode="choose", max_turns=5,
                                seed=1, llm="chat")
    assert [len(e.actions) for e in episodes] == [2, 2] and all(e.done for e in episodes)
    assert [e.truncated for e in episodes] == [True, False] and [e.cut_by for e in episodes] == ["environment", None]
    # the truncated episode keeps the state it was cut in (its last observation, then the next generation prompt:
    # where a critic's value bootstraps from); the ended one stops at its last turn
    cut, ended = (e.trajectory for e in episodes)
    tokenizer = run.get_tokenizer(llm="chat")
    tail = tokenizer.decode(cut.ids[cut.turns[-1].end:])
    assert f"You chose: {episodes[0].actions[-1]}." in tail and tail.endswith("<s>assistant\n"), tail
    assert len(ended.ids) == ended.turns[-1].end
    (by_turns,) = run.run_episodes([DoorEnv(2, turns=9)], mode="choose", max_turns=2, seed=1, llm="chat")
    first = by_turns.trajectory.turns[0].start  # the first prompt's tokens
    (by_length,) = run.run_episodes([DoorEnv(2, turns=9)], mode="choose", max_turns=5, seed=1, llm="chat",
                                    max_prompt_tokens=first + 1)
    assert (len(by_turns.actions), by_turns.truncated, by_turns.cut_by) == (2, True, "max_turns")
    assert (len(by_length.actions), by_length.truncated, by_length.cut_by) == (1, True, "max_prompt_tokens")
    good, misshapen = run.run_episodes([DoorEnv(0), ThreeValueEnv(1)], mode="choose", llm="chat")
    assert misshapen.error.startswith("TypeError: envs[1].step() must return (observation, reward, terminated, ")
    assert misshapen.cut_by == "error" and good.error is None and good.done and good.cut_by is None


def test_a_bare_string_as_a_chat_contexts_candidates_is_refused_not_split_into_characters(run):
    context = [{"role": "user", "content": "You see a door."}]
    with pytest.raises(Exception, match=r"candidates\[0\] must be a list of candidates"):
        run.score([context], ["open door"], llm="chat")
    assert len(run.score([context], [["open door"]], llm="chat")[0]) == 1  # still serving
