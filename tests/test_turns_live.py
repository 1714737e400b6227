"""The multi-turn updaters on live servers against plain PyTorch on a plain PEFT model, written out here:

- ``ppo_turns`` (2 replicas, ZeRO-2, LoRA, a token value head, uneven shares 2/1): one update equals a plain SGD step
  of the whole batch: values read at each turn's first token, GAE across turns by hand, advantages whitened over
  every turn of both replicas, the clipped policy loss on the model's tokens only, the KL estimator to the model with
  its adapters disabled, an entropy bonus, the clipped value loss at the turns' boundaries;
- ``grpo_turns`` (1 replica, LoRA, 3 episodes per start): each episode's discounted return against its group's,
  by hand, on every turn; one update equals a plain SGD step;
- the environment's tokens weigh nothing: their old log-probs are far off, and the step still equals the plain one
  taken over the model's tokens alone;
- a wrong number of turn rewards is refused naming the argument, and the servers keep serving; so is whitening a
  batch of one turn (its advantage would be 0).

Tolerance: 1e-5 on parameters after SGD steps; most trained tensors must move by more than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import check_step, peft_model, token_pass, trainable, value_head

pytestmark = pytest.mark.slow

LR = 0.05
PROMPTS = ["You are in a kitchen. Find the coin.", "You are in a cellar. Exits: east.", "Goal: open the door"]
MODEL_WORDS = [" go east", " take coin", " open door", " look", " go west"]
ENV_WORDS = [" You see a table.", " Nothing happens.", " A door is here, closed.", " You are in a hall."]
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
PPO_ARGS = {"epochs": 1, "clip_eps": 0.2, "value_clip": 0.05, "value_coef": 0.5, "entropy_coef": 0.01,
            "kl_coef": 0.1, "gamma": 0.9, "lam": 0.8}
GRPO_ARGS = {"epochs": 1, "clip_eps": 0.2, "gamma": 0.9}


@pytest.fixture(scope="module")
def run(tiny):
    sgd = {"optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": 4}
    llms = {
        "ppo": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                "heads": {"value": {"plugin": "token_value", "args": {"hidden": 16}}},
                "updater": {"plugin": "ppo_turns", "args": PPO_ARGS}, "training": {**sgd, "zero_stage": 2}},
        "grpo": {"model": tiny["llama"], "initializers": [LORA],
                 "updater": {"plugin": "grpo_turns", "args": GRPO_ARGS}, "training": sgd},
    }
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def episodes(tok, per_prompt: int) -> list[list[tuple[list[int], list[int], list[float]]]]:
    """Per prompt, ``per_prompt`` episodes as (ids after the prompt, model mask, one reward per turn): model turns
    and environment replies alternate, with 1 to 3 turns, some ending on the model's turn."""
    out = []
    for i in range(len(PROMPTS)):
        group = []
        for j in range(per_prompt):
            ids, mask, rewards = [], [], []
            for k in range(1 + (i + j) % 3):
                action = tok.encode(MODEL_WORDS[(i + 2 * j + k) % len(MODEL_WORDS)], add_special_tokens=False)
                ids += action[:1 + (i + j + k) % 3]
                mask += [1] * len(action[:1 + (i + j + k) % 3])
                rewards.append(float((i + 1) * (k - j) % 3) - 0.5)
                if k < (i + j) % 3 or (i + j) % 2 == 0:
                    reply = tok.encode(ENV_WORDS[(i + j + k) % len(ENV_WORDS)], add_special_tokens=False)[:4]
                    ids += reply
                    mask += [0] * len(reply)
            group.append((ids, mask, rewards))
        out.append(group)
    return out


def spans(mask: list[int]) -> list[tuple[int, int]]:
    starts = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
    ends = [t + 1 for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]
    return list(zip(starts, ends))


def per_token(values, turns, length: int) -> torch.Tensor:
    out = torch.zeros(length)
    for value, (start, end) in zip(values, turns):
        out[start:end] = value
    return out


def old_logprobs(run, llm: str, eps) -> list[list[list[float]]]:
    """The current log-probs, moved on every token (the model's and the environment's) so some ratios clip."""
    scored = run.score(PROMPTS, [[e[0] for e in group] for group in eps], llm=llm, per_token=True)
    return [[(lp + torch.tensor([0.15 * (-1) ** (i + j + t) for t in range(len(lp))])).tolist()
             for j, lp in enumerate(entry["logprobs"])] for i, entry in enumerate(scored)]


def update(run, llm: str, eps, old, **extra):
    return run.update(PROMPTS, [[e[0] for e in g] for g in eps], llm=llm, model_mask=[[e[1] for e in g] for g in eps],
                      turn_rewards=[[e[2] for e in g] for g in eps], old_logprobs=old, **extra)


def reference_ppo_turns(tiny, tok, before: dict, eps, old, boot=None) -> dict:
    """(``boot[i][j]``: episode j of prompt i is truncated; its last token is a placeholder where the value after
    its last turn is read.)"""
    peft = peft_model(tiny, before)
    head_state = {k: v.clone().requires_grad_(True) for k, v in before.items() if k.startswith("heads.value.")}
    head = value_head(head_state, "heads.value")
    a, rows = PPO_ARGS, []
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            for j, (ids, mask, rewards) in enumerate(eps[i]):
                _, _, h = token_pass(peft, tok, prompt, ids, hidden=True)
                turns = spans(mask)
                v = head(h)[[s for s, _ in turns]]
                with peft.disable_adapter():
                    ref, _, _ = token_pass(peft, tok, prompt, ids)
                adv, running = torch.zeros(len(turns)), 0.0
                after = head(h)[len(ids) - 1] if boot and boot[i][j] else 0.0  # the placeholder's position
                for k in reversed(range(len(turns))):
                    next_v = v[k + 1] if k + 1 < len(turns) else after
                    running = rewards[k] + a["gamma"] * next_v - v[k] + a["gamma"] * a["lam"] * running
                    adv[k] = running
                rows.append([i, j, v, adv, adv + v, ref, turns])
    flat = torch.cat([row[3] for row in rows])
    mean, std = flat.mean(), flat.std()
    params = trainable({f"model.{k}": p for k, p in peft.named_parameters()})
    params.update(head_state)
    per_prompt = [[] for _ in PROMPTS]
    for i, j, old_v, adv, ret, ref, turns in rows:
        ids, mask, _ = eps[i][j]
        logp, entropy, h = token_pass(peft, tok, PROMPTS[i], ids, hidden=True)
        token_adv = per_token((adv - mean) / (std + 1e-8), turns, len(ids))
        ratio = torch.exp(logp - torch.tensor(old[i][j]))
        pg = -torch.minimum(ratio * token_adv, torch.clamp(ratio, 1 - a["clip_eps"], 1 + a["clip_eps"]) * token_adv)
        k3 = torch.exp(ref - logp) - (ref - logp) - 1
        own = torch.tensor(mask, dtype=torch.bool)
        policy = (pg + a["kl_coef"] * k3 - a["entropy_coef"] * entropy)[own].mean()
        v = head(h)[[s for s, _ in turns]]
        v_clipped = old_v + torch.clamp(v - old_v, -a["value_clip"], a["value_clip"])
        vf = 0.5 * torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2)
        per_prompt[i].append(policy + a["value_coef"] * vf.mean())
    loss = torch.stack([torch.stack(x).mean() for x in per_prompt]).mean()
    loss.backward()
    torch.optim.SGD(list(params.values()), lr=LR).step()
    return {k: p.detach().clone() for k, p in params.items()}


def reference_grpo_turns(tiny, tok, before: dict, eps, old) -> dict:
    peft = peft_model(tiny, before)
    params = trainable({f"model.{k}": p for k, p in peft.named_parameters()})
    gamma, clip = GRPO_ARGS["gamma"], GRPO_ARGS["clip_eps"]
    losses = []
    for i, prompt in enumerate(PROMPTS):
        returns = torch.tensor([sum(r * gamma ** k for k, r in enumerate(rewards)) for _, _, rewards in eps[i]])
        advantages = (returns - returns.mean()) / (returns.std() + 1e-4)
        group = []
        for j, (ids, mask, _) in enumerate(eps[i]):
            token_adv = per_token([advantages[j]] * len(spans(mask)), spans(mask), len(ids))
            logp, _, _ = token_pass(peft, tok, prompt, ids)
            ratio = torch.exp(logp - torch.tensor(old[i][j]))
            pg = -torch.minimum(ratio * token_adv, torch.clamp(ratio, 1 - clip, 1 + clip) * token_adv)
            group.append(pg[torch.tensor(mask, dtype=torch.bool)].mean())
        losses.append(torch.stack(group).mean())
    torch.stack(losses).mean().backward()
    torch.optim.SGD(list(params.values()), lr=LR).step()
    return {k: p.detach().clone() for k, p in params.items()}


def test_ppo_turns_update_equals_a_plain_sgd_step(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=2)
    old = old_logprobs(run, "ppo", eps)
    before = run.state_dict(llm="ppo")
    stats = update(run, "ppo", eps, old)
    check_step(run.state_dict(llm="ppo"), reference_ppo_turns(tiny, tok, before, eps, old), before)
    assert sorted(s["samples"] for s in stats) == [1, 2]  # uneven shares
    returns = sum(sum(e[2]) for g in eps for e in g)  # two episodes per start
    assert sum(s["reward"] * s["samples"] * 2 for s in stats) == pytest.approx(returns, abs=1e-5)


def test_ppo_turns_bootstraps_truncated_episodes_from_the_value_at_their_placeholder(run, tiny):
    """Episodes that end on the environment's reply are marked truncated: each gets a placeholder token, and the
    value read there (the state after its last turn) replaces the 0 after its last turn in GAE."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=2)
    boot = [[int(not e[1][-1]) for e in group] for group in eps]  # those whose last token is the environment's
    assert 0 < sum(map(sum, boot)) < sum(map(len, boot))
    eps = [[(ids + [tok.eos_token_id], mask + [0], rewards) if b else (ids, mask, rewards)
            for (ids, mask, rewards), b in zip(group, flags)] for group, flags in zip(eps, boot)]
    old = old_logprobs(run, "ppo", eps)
    before = run.state_dict(llm="ppo")
    update(run, "ppo", eps, old, bootstrap=boot)
    after = run.state_dict(llm="ppo")
    check_step(after, reference_ppo_turns(tiny, tok, before, eps, old, boot), before)
    cut_short = reference_ppo_turns(tiny, tok, before, eps, old)  # the same episodes, ended: another step
    assert max(float((after[k] - cut_short[k]).abs().max()) for k in cut_short) > 1e-4


def test_bootstrap_is_refused_on_an_episode_that_ends_on_a_model_token_and_by_grpo_turns(run, tiny):
    from transformers import AutoTokenizer

    from llmrl.engine.errors import RequestError

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=2)
    boot = [[1, 1] for _ in eps]
    old = old_logprobs(run, "ppo", eps)
    for llm, refusal in (("ppo", "is marked bootstrap but ends on a model token"),
                         ("grpo", "grpo_turns has no critic to bootstrap truncated episodes")):
        before = run.state_dict(llm=llm)
        with pytest.raises(RequestError, match=refusal):
            update(run, llm, eps, old, bootstrap=boot)
        after = run.state_dict(llm=llm)
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused update trains nothing"
        assert len(run.score(PROMPTS[:1], [[" look"]], llm=llm)) == 1


def test_grpo_turns_update_equals_a_plain_sgd_step_and_ignores_environment_tokens(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=3)
    old = old_logprobs(run, "grpo", eps)
    # the environment's tokens get old log-probs far from the model's: counted anywhere, they would clip or weigh
    old = [[[x if m else x + 3.0 for x, m in zip(lp, e[1])] for lp, e in zip(lps, g)] for lps, g in zip(old, eps)]
    before = run.state_dict(llm="grpo")
    update(run, "grpo", eps, old)
    check_step(run.state_dict(llm="grpo"), reference_grpo_turns(tiny, tok, before, eps, old), before)


def test_a_wrong_number_of_turn_rewards_is_refused_by_name_and_the_servers_keep_serving(run, tiny):
    from transformers import AutoTokenizer

    from llmrl.engine.errors import RequestError

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=2)
    before = run.state_dict(llm="grpo")
    rewards = [[e[2] + [1.0] for e in g] for g in eps]
    with pytest.raises(RequestError, match=r"turn_rewards\[0\]\[0\] holds \d rewards but episode 0 of start 0 has"):
        run.update(PROMPTS, [[e[0] for e in g] for g in eps], llm="grpo", model_mask=[[e[1] for e in g] for g in eps],
                   turn_rewards=rewards)
    after = run.state_dict(llm="grpo")
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused update trains nothing"
    assert len(run.score(PROMPTS[:1], [[" look"]], llm="grpo")) == 1


def test_ppo_turns_refuses_to_whiten_a_single_turn_and_keeps_serving(run, tiny):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="ppo")  # one turn over both replicas: whitened, its advantage would be 0
    with pytest.raises(RequestError, match="whiten: the batch holds a single turn.*whiten: false"):
        run.update(PROMPTS[:1], [[[5, 6, 7]]], llm="ppo", model_mask=[[[1, 1, 0]]], turn_rewards=[[[1.0]]])
    after = run.state_dict(llm="ppo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert len(run.score(PROMPTS[:1], [[" look"]], llm="ppo")) == 1


def test_grpo_turns_takes_no_step_when_every_group_returned_alike(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = [[(ids, mask, [0.0] * (len(rewards) - 1) + [1.0]) for ids, mask, rewards in group]
           for group in episodes(tok, per_prompt=2)]
    eps = [[group[0], group[0]] for group in eps]  # two equal episodes per start: equal returns
    before = run.state_dict(llm="grpo")
    (stats,) = update(run, "grpo", eps, old_logprobs(run, "grpo", eps))
    assert stats["skipped"] == 1 and "policy_loss" not in stats and stats["samples"] == len(PROMPTS)
    after = run.state_dict(llm="grpo")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_episodes_given_as_text_on_one_replica_are_refused_and_no_rank_is_left_behind(run, tiny):
    """The episode of start 2 (replica 1's share) is text: replica 1 refuses it, replica 0 (ids only) must not
    wait for it; the call fails naming the start, and both replicas serve the next call."""
    from transformers import AutoTokenizer

    from llmrl.engine.errors import RequestError

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    eps = episodes(tok, per_prompt=2)
    candidates = [[e[0] for e in g] for g in eps]
    candidates[2][1] = tok.decode(candidates[2][1])
    before = run.state_dict(llm="ppo")
    with pytest.raises(RequestError, match="the episodes of start 2 are not all token ids"):
        run.update(PROMPTS, candidates, llm="ppo", model_mask=[[e[1] for e in g] for g in eps],
                   turn_rewards=[[e[2] for e in g] for g in eps])
    after = run.state_dict(llm="ppo")
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused update trains nothing"
    stats = update(run, "ppo", eps, old_logprobs(run, "ppo", eps))
    assert sorted(s["samples"] for s in stats) == [1, 2]


def test_policy_versions_move_by_one_per_step_and_reach_update_through_trajectories_and_episode_batch(run, tiny):
    """Every sample carries the optimizer steps of its weights: the test counts steps itself, from the version of
    the first sample; the versions go through ``Trajectory`` and ``episode_batch`` to ``update``, whose staleness
    statistics are worked out by hand. A snapshot keeps its source's version of when it was taken."""
    from transformers import AutoTokenizer

    from llmrl import Episode, Trajectory, episode_batch

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    start = tok.encode(PROMPTS[0])

    def step():
        datum = {"model_input": start[:-1], "loss_fn_inputs": {"target_tokens": start[1:],
                                                                "weights": [1.0] * (len(start) - 1)}}
        run.forward_backward([datum], "cross_entropy", llm="grpo")
        return run.optim_step({"learning_rate": 1e-3}, llm="grpo")

    counter = run.generate([start], llm="grpo", max_new_tokens=1)[0][0]["policy_version"]
    trajectories = [Trajectory(tok, start) for _ in range(2)]
    for turn in range(2):  # turn 1 sampled at `counter`, turn 2 one step later
        samples = run.generate([t.prompt for t in trajectories], llm="grpo", seed=turn, do_sample=True,
                               max_new_tokens=3)
        assert [s["policy_version"] for (s,) in samples] == [counter] * 2
        assert {s["policy"] for (s,) in samples} == {"default"}
        for trajectory, (sample,) in zip(trajectories, samples):
            trajectory.add_sample(sample)
            trajectory.add_ids(tok.encode(ENV_WORDS[turn], add_special_tokens=False)[:2])
        if turn == 0:
            assert step()["policy_version"] == counter + 1
            counter += 1
    assert [t.policy_versions for t in trajectories] == [[counter - 1, counter]] * 2
    group = [Episode(t, actions=["a", "b"], rewards=[1.0, r]) for t, r in zip(trajectories, (0.0, 2.0))]
    batch = episode_batch([group])
    assert batch["policy_versions"] == [[[counter - 1, counter], [counter - 1, counter]]]
    run.snapshot("sampler", llm="grpo")
    snapped = counter
    (stats,) = run.update(**batch, llm="grpo")
    assert stats["policy_version"] == counter  # the version the update trained from
    assert stats["staleness_mean"] == 0.5 and stats["staleness_max"] == 1.0  # (1 + 0 + 1 + 0) / 4
    counter += stats["optimizer_steps"]
    assert stats["optimizer_steps"] >= 1
    for _ in range(2):
        assert step()["policy_version"] == counter + 1
        counter += 1
        assert run.generate([start], llm="grpo", max_new_tokens=1)[0][0]["policy_version"] == counter
    frozen = run.generate([start], llm="grpo", peft_adapter="sampler", max_new_tokens=1)[0][0]
    assert (frozen["policy"], frozen["policy_version"]) == ("sampler", snapped)
    datum = {"model_input": start[:-1], "loss_fn_inputs": {"target_tokens": start[1:],
                                                            "weights": [1.0] * (len(start) - 1)}}
    metrics = run.forward_backward([datum, datum], "cross_entropy", llm="grpo",
                                   policy_versions=[counter, counter - 3])["metrics"]
    assert (metrics["staleness:mean"], metrics["staleness:max"]) == (1.5, 3.0)
    run.optim_step({"learning_rate": 1e-3}, llm="grpo")
    run.drop_snapshot("sampler", llm="grpo")


def test_async_rollouts_through_a_live_run_hand_over_samples_within_the_bound(run, tiny):
    """``AsyncRollouts`` sampling from the servers on a thread while the test trains: every batch is within the
    bound of the version ``optim_step`` returned, and ``forward_backward`` reports the same staleness. (The test's
    proxy to the script is one socket: a lock keeps its calls whole; a Caller needs none.)"""
    import threading

    from transformers import AutoTokenizer

    from llmrl import AsyncRollouts, completion_datum

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    start = tok.encode(PROMPTS[1])
    lock = threading.Lock()

    def produce():
        with lock:
            (group,) = run.generate([start], llm="grpo", do_sample=True, max_new_tokens=2, num_return_sequences=2)
        return group

    with lock:
        version = run.generate([start], llm="grpo", max_new_tokens=1)[0][0]["policy_version"]
    with AsyncRollouts(produce, max_staleness=1, capacity=4) as rollouts:
        for _ in range(3):
            batch = rollouts.take(2, version)
            assert all(version - v <= 1 for v in batch.versions)
            data = [completion_datum(start, s["tokens"], weights=[1.0] * len(s["tokens"])) for s in batch.rollouts]
            with lock:
                metrics = run.forward_backward(data, "cross_entropy", llm="grpo",
                                               policy_versions=batch.versions)["metrics"]
                stepped = run.optim_step({"learning_rate": 1e-3}, llm="grpo")["policy_version"]
            assert metrics["staleness:max"] == max(batch.staleness)
            assert stepped == version + 1
            version = stepped
    assert rollouts.stats()["taken"] == 6
