"""What a port from trlX needs, on live servers (2 replicas, LoRA, ZeRO-0, uneven shares 3/2), against plain
PyTorch / PEFT / Hugging Face written out here:

- ``ppo_tokens`` with dense per-token rewards, ``reward_clip`` and ``reward_scale: running`` (trlX's dense reward
  functions, ``cliprange_reward`` and ``scale_reward``): one update equals a plain SGD step whose per-token rewards
  are the clipped dense rewards divided by the standard deviation of every continuation's total reward of both
  updates, plus the KL penalty; the same totals given as numbers train differently (another GAE); the running
  moments are saved in the checkpoint;
- a dense reward list of the wrong length is refused naming ``rewards[i][j]`` and both lengths (on the client for
  token ids, on the servers for text), ``lr`` and ``max_grad_norm`` are refused naming their config keys, and the
  servers keep serving;
- the ``next_token`` head gives the trained policy's logits after each context, as a plain PEFT forward does;
- ``generate(stop_strings=...)`` gives plain Hugging Face's texts (which needs ``tokenizer=`` for it).

Tolerance: 1e-5 on parameters after SGD steps; the update moves most trained parameters by more than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import check_step, peft_model, ppo_tokens_step

pytestmark = pytest.mark.slow

LR = 0.05
PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key", "open the door"]
WORDS = [" go to the red ball", " the key", " open the door", " turn left", " a wall", " pick up", " fridge"]
PPO_ARGS = {"epochs": 1, "clip_eps": 0.2, "value_clip": 0.05, "value_coef": 0.5, "entropy_coef": 0.01,
            "kl_coef": 0.1, "gamma": 0.95, "lam": 0.9, "reward_clip": 1.0, "reward_scale": "running"}


@pytest.fixture(scope="module")
def run(tiny):
    llms = {"ppo": {"model": tiny["llama"], "replicas": 2,
                    "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}],
                    "heads": {"value": {"plugin": "token_value", "args": {"hidden": 16}},
                              "next": {"plugin": "next_token", "args": {"values": "logits"}}},
                    "updater": {"plugin": "ppo_tokens", "args": PPO_ARGS},
                    "training": {"zero_stage": 0, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": 4}}}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["llama"])


def continuations(tok, offset: int) -> list[list[list[int]]]:
    """Token ids of 2 continuations per prompt, of different lengths."""
    return [[tok.encode(WORDS[(i + j + offset) % len(WORDS)], add_special_tokens=False)[: 2 + (i + j) % 4]
             for j in range(2)] for i in range(len(PROMPTS))]


def dense_rewards(conts) -> list[list[list[float]]]:
    """One reward per generated token, some beyond the clip of 1 (which clips them)."""
    return [[[0.4 * (-1) ** (i + j + t) * (1 + t) for t in range(len(c))] for j, c in enumerate(per)]
            for i, per in enumerate(conts)]


def clipped_totals(rewards) -> list[float]:
    """Each continuation's total reward after the clip of 1 (a number, or the sum of its clipped dense rewards)."""
    return [float(torch.tensor(r, dtype=torch.float32).clamp(-1, 1).sum()) for per in rewards for r in per]


def reference_step(tiny, before: dict, conts, rows, old) -> dict:
    """One ppo_tokens update (PPO_ARGS, beta fixed) as plain PyTorch, ``rows[i][j]`` being the task rewards of each
    token (already clipped and scaled): the trained weights after it."""
    return ppo_tokens_step(tiny, before, PROMPTS, conts, rows, old, PPO_ARGS["kl_coef"], PPO_ARGS, LR)[0]


def test_dense_clipped_running_scaled_rewards_equal_a_plain_sgd_step_and_are_checkpointed(run, tiny, tok, tmp_path):
    warm_rewards = [[1.0, -0.5], [0.2, 0.8], [-1.0, 3.0], [0.0, 2.0], [0.5, -0.7]]  # 3.0 and 2.0 are clipped to 1
    first = run.update(PROMPTS, continuations(tok, 3), llm="ppo", rewards=warm_rewards)
    warm = clipped_totals(warm_rewards)
    assert [s["samples"] for s in first] == [3, 2]
    assert first[0]["reward_divisor"] == pytest.approx(float(torch.tensor(warm).std()), rel=1e-5)
    conts = continuations(tok, 0)
    dense = dense_rewards(conts)
    scored = run.score(PROMPTS, conts, llm="ppo", per_token=True)
    old = [[(lp + 0.05 * (-1) ** (i + j)).tolist() for j, lp in enumerate(e["logprobs"])] for i, e in enumerate(scored)]
    before = run.state_dict(llm="ppo")
    stats = run.update(PROMPTS, conts, llm="ppo", rewards=dense, old_logprobs=old)
    # The divisor: the unbiased std of every continuation's clipped total of both updates (20 numbers).
    totals = warm + clipped_totals(dense)
    divisor = float(torch.tensor(totals).std())
    assert stats[0]["reward_divisor"] == pytest.approx(divisor, rel=1e-5) == stats[1]["reward_divisor"]
    assert sum(s["reward"] * s["samples"] for s in stats) / 5 == pytest.approx(
        sum(sum(sum(r) for r in per) for per in dense) / 10, abs=1e-5)  # as given: before clipping and scaling
    rows = [[torch.tensor(r).clamp(-1, 1) / divisor for r in per] for per in dense]
    expected = reference_step(tiny, before, conts, rows, old)
    check_step(run.state_dict(llm="ppo"), expected, before)
    # The same totals as numbers on the last token would have trained otherwise (another GAE).
    last = [[torch.nn.functional.pad(r.sum()[None], (len(r) - 1, 0)) for r in per] for per in rows]
    scalar = reference_step(tiny, before, conts, last, old)
    assert max(float((scalar[k] - expected[k]).abs().max()) for k in expected) > 1e-4
    # The running moments are in the checkpoint: 20 continuations, their mean and std.
    path = run.save(str(tmp_path / "ckpt"))
    saved = torch.load(f"{path}/ppo/state/rank-0.pt", weights_only=False)["updater"]["task_rewards"]
    mean, var, count = saved["moments"]
    assert count == pytest.approx(20) and mean == pytest.approx(sum(totals) / 20, abs=1e-6)
    assert (var * count / (count - 1)) ** 0.5 == pytest.approx(divisor, rel=1e-5)


def test_wrong_dense_lengths_and_optimizer_settings_are_refused_and_the_servers_keep_serving(run, tok):
    from llmrl.engine.errors import InvalidArgument, RequestError

    conts = continuations(tok, 1)
    dense = dense_rewards(conts)
    short = [per if i != 1 else [per[0][:-1], per[1]] for i, per in enumerate(dense)]
    before = run.state_dict(llm="ppo")
    n = len(conts[1][0])
    with pytest.raises(InvalidArgument, match=rf"'rewards'\[1\]\[0\] holds {n - 1} values, but candidate 0 of "
                                              rf"context 1 has {n} token ids"):
        run.update(PROMPTS, conts, llm="ppo", rewards=short)
    texts = [[tok.decode(c) for c in per] for per in conts]  # text: the servers count the tokens
    with pytest.raises(RequestError, match=r"rewards\[\d\]\[\d\] holds \d+ dense rewards but continuation \d of "
                                           r"prompt \d has \d+ generated tokens"):
        run.update(PROMPTS, texts, llm="ppo", rewards=[[[0.0] * 9, 0.0] for _ in PROMPTS])
    with pytest.raises(InvalidArgument, match=r"'lr' would be ignored.*llms\.ppo\.training\.optimizer\.lr"):
        run.update(PROMPTS, conts, llm="ppo", rewards=dense, lr=1e-4)
    with pytest.raises(InvalidArgument, match=r"'max_grad_norm' would be ignored.*llms\.ppo\.training\."
                                              "gradient_clipping"):
        run.update(PROMPTS, conts, llm="ppo", rewards=dense, max_grad_norm=1.0)
    after = run.state_dict(llm="ppo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert [s["samples"] for s in run.update(PROMPTS, conts, llm="ppo", rewards=dense)] == [3, 2]


def test_the_next_token_head_gives_the_policys_logits_after_each_context(run, tiny, tok):
    state = run.state_dict(llm="ppo")
    peft = peft_model(tiny, state)
    out = run.custom_module_fns(["next"], PROMPTS, llm="ppo")
    with_scores = run.score(PROMPTS, [[" a", " b"]] * len(PROMPTS), llm="ppo", additional_module_function_keys=["next"])
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            want = peft(input_ids=torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1].float()
            torch.testing.assert_close(out[i]["next"], want, atol=1e-4, rtol=0)
            torch.testing.assert_close(with_scores[i]["next"], want, atol=1e-4, rtol=0)


def test_generate_with_stop_strings_gives_hugging_faces_texts(run, tiny, tok):
    peft = peft_model(tiny, run.state_dict(llm="ppo"))
    free = run.generate(PROMPTS, llm="ppo", max_new_tokens=12, do_sample=False)
    stops = [tok.decode(group[0]["tokens"][4:6]).strip()[:2] or "a" for group in free]  # reached mid-way
    stopped = 0
    for prompt, stop in zip(PROMPTS, stops):
        (sample,) = run.generate([prompt], llm="ppo", max_new_tokens=12, do_sample=False, stop_strings=[stop])[0]
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = peft.generate(**enc, max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=tok,
                                pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:]
        assert sample["text"] == tok.decode(ids, skip_special_tokens=True), (prompt, stop)
        stopped += sample["stop_reason"] == "stop" and sample["stop"] == stop
    assert stopped >= 2
