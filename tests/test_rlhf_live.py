"""The RLHF updaters on live servers against plain PyTorch on a plain PEFT model, written out here independently:

- ``ppo_tokens`` (2 replicas, ZeRO-2, LoRA, uneven shares 3/2): one update equals a plain SGD step of the whole
  batch: the reference pass with the adapters disabled, the per-token value head, KL-penalised rewards, GAE over
  tokens, advantages whitened over every token of both replicas, clipped policy and value losses, an entropy bonus;
  the adaptive KL coefficient of the next update is the controller's formula on the batch's KL.
- ``grpo`` (2 replicas, ZeRO-3, LoRA, 3 continuations per prompt, token normalisation, KL to the base model):
  one update equals a plain SGD step.
- ``pairwise_reward`` with the ``reward`` head: one update equals a plain SGD step of the Bradley-Terry loss,
  and the trained reward model scores responses as the plain model does.
- ``ppo_tokens`` refuses to whiten a batch of one token (its advantage would be 0), and keeps serving.
- A reward model in the same run as a policy: the policy's samples, scored by the reward model with
  ``custom_module_fns``, train the policy with ``ppo_tokens``.

Tolerance: 1e-5 on parameters after SGD steps; every test checks that most trained parameters moved by more
than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import check_step, peft_model, ppo_tokens_step, token_pass, trainable
from testkit.texts import LORA, PROMPTS, WORDS

pytestmark = pytest.mark.slow

LR = 0.05
PPO_ARGS = {"epochs": 1, "clip_eps": 0.2, "value_clip": 0.05, "value_coef": 0.5, "entropy_coef": 0.01,
            "kl_coef": 0.1, "kl_target": 0.5, "kl_horizon": 20, "gamma": 0.95, "lam": 0.9}
GRPO_ARGS = {"epochs": 1, "clip_eps": 0.2, "kl_coef": 0.1, "loss": "token"}


def sgd(zero: int, micro: int = 4) -> dict:
    return {"zero_stage": zero, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": micro}


@pytest.fixture(scope="module")
def run(tiny):
    llms = {
        "ppo": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                "heads": {"value": {"plugin": "token_value", "args": {"hidden": 16}}},
                "updater": {"plugin": "ppo_tokens", "args": PPO_ARGS}, "training": sgd(2)},
        "grpo": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                 "updater": {"plugin": "grpo", "args": GRPO_ARGS}, "training": sgd(3),
                 "generation": {"merge_adapter": True}},  # ZeRO-3: merged on the weights gathered for the call
        # ZeRO-3 with a compiled step: the weights it reads kept at the same addresses from call to call
        "grpo-kept": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                      "updater": {"plugin": "grpo", "args": GRPO_ARGS}, "training": sgd(3),
                      "generation": {"merge_adapter": True, "compile": True, "length_bucket": 32}},
        # no KL term: given old log-probs, the update runs no gradient-free pass (it counts tokens from the ids)
        "grpo-nokl": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                      "updater": {"plugin": "grpo", "args": {**GRPO_ARGS, "kl_coef": 0.0}}, "training": sgd(2)},
        "rm": {"model": tiny["llama"], "heads": {"reward": "reward"}, "updater": "pairwise_reward",
               "training": sgd(0, micro=8)},
    }
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


# ----------------------------------------------------------------------------- plain references


def continuations(tok, per_prompt: int, offset: int) -> list[list[list[int]]]:
    """Token ids of ``per_prompt`` continuations per prompt, of different lengths."""
    return [[tok.encode(WORDS[(i + j + offset) % len(WORDS)], add_special_tokens=False)[: 2 + (i + j) % 4]
             for j in range(per_prompt)] for i in range(len(PROMPTS))]


def perturbed(logp: torch.Tensor, i: int, j: int) -> list[float]:
    """Old log-probs that differ from the current ones, so that some ratios leave the clip range."""
    return (logp + torch.tensor([0.1 * (-1) ** (i + j + t) * (1 + 2 * (t % 2)) for t in range(len(logp))])).tolist()


def reference_ppo_tokens(tiny, before: dict, conts, rewards, old, beta: float) -> tuple[dict, float]:
    """One ppo_tokens update (PPO_ARGS) as plain PyTorch: the weights after it, and the batch's mean KL. Each
    continuation's reward arrives at its last token."""
    last = [[[0.0] * (len(c) - 1) + [r] for c, r in zip(per, rs)] for per, rs in zip(conts, rewards)]
    return ppo_tokens_step(tiny, before, PROMPTS, conts, last, old, beta, PPO_ARGS, LR)


def reference_grpo(tiny, before: dict, conts, rewards, old, beta: float = GRPO_ARGS["kl_coef"]) -> dict:
    """One grpo update (GRPO_ARGS: token normalisation, KL estimator to the base model, weighed by ``beta``) as
    plain PyTorch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    peft = peft_model(tiny, before)
    params = trainable({f"model.{k}": p for k, p in peft.named_parameters()})
    eps = GRPO_ARGS["clip_eps"]
    losses = []
    for i, prompt in enumerate(PROMPTS):
        r = torch.tensor(rewards[i])
        adv = (r - r.mean()) / (r.std() + 1e-4)
        token_losses = []
        for j, cont in enumerate(conts[i]):
            with torch.no_grad(), peft.disable_adapter():
                ref, _, _ = token_pass(peft, tok, prompt, cont)
            logp, _, _ = token_pass(peft, tok, prompt, cont)
            ratio = torch.exp(logp - torch.tensor(old[i][j]))
            pg = -torch.minimum(ratio * adv[j], torch.clamp(ratio, 1 - eps, 1 + eps) * adv[j])
            k3 = torch.exp(ref - logp) - (ref - logp) - 1
            token_losses.append(pg + beta * k3)
        losses.append(torch.cat(token_losses).mean())  # every token of the group weighs the same
    opt = torch.optim.SGD(list(params.values()), lr=LR)
    torch.stack(losses).mean().backward()
    opt.step()
    return {k: p.detach().clone() for k, p in params.items()}


# ----------------------------------------------------------------------------- the tests


def old_logprobs(run, llm: str, conts) -> list[list[list[float]]]:
    scored = run.score(PROMPTS, conts, llm=llm, per_token=True)
    return [[perturbed(lp, i, j) for j, lp in enumerate(entry["logprobs"])] for i, entry in enumerate(scored)]


def test_ppo_tokens_update_equals_a_plain_sgd_step_and_adapts_its_kl_coefficient(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    rewards = [[1.0, -0.5], [0.2, 0.8], [-1.0, 0.3], [0.0, 2.0], [0.5, -0.7]]
    warm = continuations(tok, 2, offset=3)  # a first update moves the adapters away from the base model
    first = run.update(PROMPTS, warm, llm="ppo", rewards=rewards)
    assert [s["samples"] for s in first] == [3, 2] and first[0]["kl_coef"] == pytest.approx(0.1)
    conts = continuations(tok, 2, offset=0)
    old = old_logprobs(run, "ppo", conts)
    before = run.state_dict(llm="ppo")
    stats = run.update(PROMPTS, conts, llm="ppo", rewards=rewards, old_logprobs=old)
    beta = 0.1 * (1 + min(max(first[0]["batch_kl"] / PPO_ARGS["kl_target"] - 1, -0.2), 0.2) * 10 / 20)
    assert stats[0]["kl_coef"] == pytest.approx(beta, rel=1e-6)  # the controller, on both replicas' KL
    assert stats[0]["kl_coef"] == stats[1]["kl_coef"] and stats[0]["batch_kl"] == stats[1]["batch_kl"]
    expected, kl = reference_ppo_tokens(tiny, before, conts, rewards, old, beta)
    assert stats[0]["batch_kl"] == pytest.approx(kl, abs=1e-5)
    assert 0 < stats[0]["clip_fraction"] < 1
    check_step(run.state_dict(llm="ppo"), expected, before)


@pytest.mark.parametrize("llm", ["grpo", "grpo-nokl"])
def test_grpo_update_equals_a_plain_sgd_step(run, tiny, llm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    rewards = [[1.0, 0.0, 0.5], [0.2, 0.8, 0.8], [-1.0, 0.3, 2.0], [0.0, 2.0, 1.0], [0.5, -0.7, 0.1]]
    run.update(PROMPTS, continuations(tok, 3, offset=2), llm=llm, rewards=rewards)  # away from the base model
    conts = continuations(tok, 3, offset=0)
    old = old_logprobs(run, llm, conts)
    before = run.state_dict(llm=llm)
    stats = run.update(PROMPTS, conts, llm=llm, rewards=rewards, old_logprobs=old)
    assert [s["samples"] for s in stats] == [3, 2]
    assert all(s["kl_penalty"] > 0 for s in stats) if llm == "grpo" else all(s["kl_penalty"] == 0 for s in stats)
    expected = reference_grpo(tiny, before, conts, rewards, old, GRPO_ARGS["kl_coef"] if llm == "grpo" else 0.0)
    check_step(run.state_dict(llm=llm), expected, before)


def test_zero3_samples_from_its_gathered_weights_with_the_adapter_merged(run, tiny):
    """Under ZeRO-3 (2 replicas), generate runs llmrl's loop on the weights gathered for the call, the trained
    adapter merged into a copy freed after the call: its log-probs are score's, and no weight changes."""
    from transformers import AutoTokenizer

    from testkit.serving import assert_scored_back

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    rewards = [[1.0, 0.0, 0.5], [0.2, 0.8, 0.8], [-1.0, 0.3, 2.0], [0.0, 2.0, 1.0], [0.5, -0.7, 0.1]]
    run.update(PROMPTS, continuations(tok, 3, offset=1), llm="grpo", rewards=rewards)  # a trained adapter
    ranks = [r for r, s in run.servers().items() if s["llm"] == "grpo"]
    before, weights = run.server_memory(), run.state_dict(llm="grpo")
    for sampled in (False, True):
        results = run.generate(PROMPTS, llm="grpo", max_new_tokens=6, do_sample=sampled,
                               num_return_sequences=2 if sampled else 1, seed=5)
        assert_scored_back(run, "grpo", PROMPTS, results)
    after = run.server_memory()
    for r in ranks:
        was, now = before[r].get("decoding") or {"calls": {}, "merges": 0}, after[r]["decoding"]
        assert now["calls"].get("llmrl", 0) - was["calls"].get("llmrl", 0) >= 2, now
        assert now["merges"] - was["merges"] >= 2 and now["merged_weights_mb"] == 0.0, now
        assert now["compiled_shapes"] == [] and now["static_cache_mb"] == 0.0
    assert all(torch.equal(v, weights[k]) for k, v in run.state_dict(llm="grpo").items())


@pytest.mark.budget(120, why="each of the LLM's 2 ranks compiles the decode step with torch.compile (inductor and a "
                             "C compiler): 38-73 s on 2 shared cores in fresh-clone runs")
def test_zero3_with_a_compiled_step_decodes_from_kept_weights_that_never_move(run, tiny):
    """Under ZeRO-3 (2 replicas) with ``compile`` on, ``keep_gathered`` (auto) copies each call's gathered weights
    into buffers kept between calls and merges the trained adapter in place: two rounds of calls, each after an
    update, decode through the static cache and the compiled step, the step's weights never move (a CUDA graph would
    replay, not re-record), log-probs are score's (so the second round reads the newly trained weights), and no
    trained weight changes."""
    import shutil

    from transformers import AutoTokenizer

    from testkit.serving import assert_scored_back

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on the CPU needs a C compiler")
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    rewards = [[1.0, 0.0, 0.5], [0.2, 0.8, 0.8], [-1.0, 0.3, 2.0], [0.0, 2.0, 1.0], [0.5, -0.7, 0.1]]
    ranks = [r for r, s in run.servers().items() if s["llm"] == "grpo-kept"]
    rounds = []
    for offset in (1, 2):  # an update before each round: the second round must decode the newly trained adapter
        run.update(PROMPTS, continuations(tok, 3, offset=offset), llm="grpo-kept", rewards=rewards)
        weights = run.state_dict(llm="grpo-kept")
        for sampled in (False, True):
            results = run.generate(PROMPTS, llm="grpo-kept", max_new_tokens=6, do_sample=sampled,
                                   num_return_sequences=2 if sampled else 1, seed=5)
            assert_scored_back(run, "grpo-kept", PROMPTS, results)
        rounds.append(run.server_memory())
        assert all(torch.equal(v, weights[k]) for k, v in run.state_dict(llm="grpo-kept").items())
    for r in ranks:
        first, now = rounds[0][r]["decoding"], rounds[1][r]["decoding"]
        assert now["calls"].get("llmrl", 0) - first["calls"].get("llmrl", 0) == 2, now
        assert now["compiled_shapes"] and now["compiled_shapes"] == first["compiled_shapes"], now
        assert now["weight_moves"] == 0, now
        assert now["kept_weights_mb"] > 0 and now["merged_weights_mb"] > 0 and now["static_cache_mb"] > 0, now
        assert now["merges"] - first["merges"] == 2, now  # the base weights are gathered anew: merged in place


def test_grpo_refuses_a_group_of_one_and_keeps_serving(run, tiny):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="grpo")
    with pytest.raises(RequestError, match="prompt 0 has 1 continuation.*num_return_sequences >= 2"):
        run.update(PROMPTS[:2], [[[5, 6]], [[7, 8], [9]]], llm="grpo", rewards=[[1.0], [0.0, 1.0]])
    after = run.state_dict(llm="grpo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert len(run.score(PROMPTS[:1], [[" a"]], llm="grpo")) == 1


def test_ppo_tokens_refuses_to_whiten_a_single_token_and_keeps_serving(run, tiny):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="ppo")  # one token over both replicas: whitened, its advantage would be 0
    with pytest.raises(RequestError, match="whiten: the batch holds a single token.*whiten: false"):
        run.update(PROMPTS[:1], [[[5]]], llm="ppo", rewards=[[1.0]])
    after = run.state_dict(llm="ppo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert [s["samples"] for s in run.update(PROMPTS[:1], [[[5, 6]]], llm="ppo", rewards=[[1.0]])] in ([1, 0], [0, 1])


def test_pairwise_reward_update_equals_a_plain_bradley_terry_step_and_scores_like_plain_hf(run, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    pairs = [[WORDS[i % len(WORDS)], WORDS[(i + 2) % len(WORDS)]] for i in range(len(PROMPTS))]
    margins = [0.0, 0.1, 0.0, 0.2, 0.0]
    before = run.state_dict(llm="rm")
    stats = run.update(PROMPTS, pairs, llm="rm", margins=margins)
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    model.load_state_dict({k[len("model."):]: v for k, v in before.items() if k.startswith("model.")})
    w = before["heads.reward.mlp.0.weight"].clone().requires_grad_(True)
    b = before["heads.reward.mlp.0.bias"].clone().requires_grad_(True)

    def reward(prompt, response):
        out = model(input_ids=torch.tensor([tok(prompt + response)["input_ids"]]), output_hidden_states=True)
        return (out.hidden_states[-1][0, -1] @ w.T + b).squeeze(-1)

    losses = [-torch.nn.functional.logsigmoid(reward(p, c) - reward(p, r) - m)
              for p, (c, r), m in zip(PROMPTS, pairs, margins)]
    assert stats[0]["loss"] == pytest.approx(float(torch.stack(losses).mean().detach()), abs=1e-5)
    params = {f"model.{k}": p for k, p in model.named_parameters()}
    opt = torch.optim.SGD([*params.values(), w, b], lr=LR)
    torch.stack(losses).mean().backward()
    opt.step()
    expected = {**{k: p.detach() for k, p in params.items()}, "heads.reward.mlp.0.weight": w.detach(),
                "heads.reward.mlp.0.bias": b.detach()}
    after = run.state_dict(llm="rm")
    for key, want in expected.items():
        torch.testing.assert_close(after[key], want, atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert (after["heads.reward.mlp.0.weight"] - before["heads.reward.mlp.0.weight"]).abs().max() > 1e-4
    got = run.custom_module_fns(["reward"], PROMPTS, [[WORDS[0], WORDS[3]]] * len(PROMPTS), llm="rm")
    with torch.no_grad():
        for prompt, entry in zip(PROMPTS, got):
            want = torch.stack([reward(prompt, WORDS[0]), reward(prompt, WORDS[3])])
            torch.testing.assert_close(entry["reward"], want, atol=1e-5, rtol=0)


def test_a_reward_model_in_the_same_run_scores_the_policys_samples_and_trains_it(run, tiny):
    samples = run.generate(PROMPTS, llm="ppo", max_new_tokens=4, do_sample=True, num_return_sequences=2, seed=3)
    texts = [[s["text"] for s in group] for group in samples]
    scored = run.custom_module_fns(["reward"], PROMPTS, texts, llm="rm")
    rewards = [entry["reward"].tolist() for entry in scored]
    plain = run.score(PROMPTS, texts, llm="rm", additional_module_function_keys=["reward"])
    assert all(torch.equal(a["reward"], b["reward"]) for a, b in zip(scored, plain))
    before = run.state_dict(llm="ppo")
    stats = run.update(PROMPTS, [[s["tokens"] for s in group] for group in samples], llm="ppo", rewards=rewards,
                       old_logprobs=[[s["logprobs"] for s in group] for group in samples])
    mean = sum(map(sum, rewards)) / sum(map(len, rewards))
    assert sum(s["reward"] * s["samples"] * 2 for s in stats) / 10 == pytest.approx(mean, abs=1e-5)
    assert stats[0]["approx_kl"] < 1e-6, "generate's log-probs are the policy's: the first ratios are 1"
    after = run.state_dict(llm="ppo")
    assert any(not torch.equal(before[k], after[k]) for k in before if ".lora_" in k)


def test_declared_per_sample_arguments_of_the_wrong_shape_are_refused_before_sending(run, tiny):
    """ppo_tokens reads rewards per continuation and old log-probs per token; pairwise_reward reads margins per
    pair. With 2 replicas, 5 rewards for 4 prompts used to reach both replicas whole, each pairing them with its
    own prompts from position 0. Every wrong shape is refused on the client, naming the argument; nothing moves and
    the next good update trains."""
    from transformers import AutoTokenizer

    from llmrl.engine.errors import InvalidArgument

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    prompts, conts = PROMPTS[:4], continuations(tok, 2, offset=1)[:4]
    rewards = [[1.0, -0.5], [0.2, 0.8], [-1.0, 0.3], [0.0, 2.0]]
    old = [[[-1.0] * len(c) for c in per] for per in conts]
    before = run.state_dict(llm="ppo")
    refusals = [
        ({"rewards": rewards + [[0.0, 0.0]]}, r"'rewards' has 5 entries, but the call has 4 contexts"),
        ({"rewards": rewards, "old_logprobs": old[:3]}, r"'old_logprobs' has 3 entries, but the call has 4"),
        ({"rewards": rewards[:2] + [[1.0], [0.0, 2.0]]}, r"'rewards'\[2\] holds 1 values, but context 2 has 2"),
        ({"rewards": rewards, "old_logprobs": old[:1] + [[old[1][0][:-1], old[1][1]]] + old[2:]},
         r"'old_logprobs'\[1\]\[0\] holds \d+ values, but candidate 0 of context 1 has \d+ token ids"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(InvalidArgument, match=message):
            run.update(prompts, conts, llm="ppo", **kwargs)
    with pytest.raises(InvalidArgument, match=r"'margins' has 3 entries, but the call has 2 contexts"):
        run.update(PROMPTS[:2], [[" a", " b"], [" c", " d"]], llm="rm", margins=[0.1, 0.2, 0.3])
    after = run.state_dict(llm="ppo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was sent"
    stats = run.update(prompts, conts, llm="ppo", rewards=rewards, old_logprobs=old)
    assert [s["samples"] for s in stats] == [2, 2]
