"""GRPO written in your script: the RLHF demo's task, trained with forward_backward / optim_step and no updater.

    llmrl run --config configs/rlhf-sentiment-script.yaml examples/rlhf_grpo_in_script.py
    llmrl run --config configs/rlhf-sentiment-script-quick.yaml examples/rlhf_grpo_in_script.py --quick   # CI
    llmrl run --config configs/rlhf-sentiment-script-sampler.yaml examples/rlhf_grpo_in_script.py \
        --async-staleness 1 --sampler sampler       # sampling on a rank of its own, weights synced every step

The same prompts, reward and held-out evaluation as ``examples/rlhf_sentiment.py`` (which runs the ``grpo`` updater
plugin on the servers); here the algorithm is the ~40 lines of :func:`train`: sample a group of continuations per
prompt, reward them, centre and scale the rewards within each group, turn every continuation into a datum whose
per-token advantage is its group advantage minus a KL penalty to the starting policy (a snapshot taken before
training, read with ``forward``), divided by its length and the batch size (a mean over tokens, then over
continuations), take ``forward_backward`` with the ``importance_sampling`` loss against the log-probs the sampler
returned, and ``optim_step`` with a learning rate that decays linearly, computed here.

Writes, in ``--out``: ``curve.png``, ``metrics.csv`` and ``summary.json`` (as the RLHF demo), and what the
config's ``tracking`` back ends record (each ``optim_step``'s statistics on their own, this script's scalars through
``caller.log``) in a folder named after the run. It does not define
the prompts, reward or evaluation (``examples/rlhf_sentiment.py`` does) and runs no updater plugin.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the RLHF demo's prompts, reward and evaluation
from dataclass_flags import flags_parser  # noqa: E402
from rlhf_sentiment import Reward, build_prompts, evaluate, plot, write_metrics  # noqa: E402

from llmrl import Caller, completion_datum  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402


@dataclass
class Args:
    updates: Annotated[int, "GRPO updates"] = 30
    prompts_per_update: Annotated[int, "training prompts per update"] = 8
    samples_per_prompt: Annotated[int, "continuations sampled per prompt (the GRPO group)"] = 4
    max_new_tokens: Annotated[int, "continuation length"] = 16
    lr: Annotated[float, "the first update's learning rate, decaying linearly to 0"] = 2e-3
    kl_coef: Annotated[float, "weight of the KL penalty to the starting policy (a per-token negative reward)"] = 0.2
    grad_clip_norm: Annotated[float, "gradients are clipped to this global norm"] = 1.0
    short_penalty: Annotated[float, "subtracted from the reward of a continuation with fewer than 3 words"] = 0.5
    repeat_penalty: Annotated[float, "times the share of repeated word trigrams, subtracted from the reward"] = 1.0
    eval_prompts: Annotated[int, "held-out prompts in each evaluation (at most 72)"] = 72
    seed: Annotated[int, "seed of the prompt order and the sampling"] = 0
    out: Annotated[str, "where the curve, metrics and summary go"] = "runs/rlhf_grpo_in_script"
    async_staleness: Annotated[int, "sample on a background thread, at most this many optimizer steps behind the "
                                    "trained weights (0: sample, then train)"] = 0
    sampler: Annotated[str, "an LLM of the config that samples while the policy trains on its own ranks; the "
                            "policy's adapter is copied into it after every step (sync_weights_async, in flight)"] = ""
    quick: Annotated[bool, "a tiny smoke run (CI): 2 updates, 4 prompts, 8 evaluation prompts"] = False


def train(caller: Caller, prompts: list[str], reward: Reward, args: Args) -> list[dict]:
    """The GRPO loop. With ``--async-staleness K`` the batches are sampled on a background thread
    (:class:`llmrl.AsyncRollouts`) while the main thread trains, each at most K optimizer steps behind the weights
    it trains; the importance-sampling loss divides by the sampler's own log-probs."""
    import contextlib
    import itertools

    from tqdm import tqdm

    import llmrl

    caller.snapshot("reference")  # the starting policy, frozen: the KL penalty's reference
    policy = caller.config.default_llm
    if args.sampler:
        caller.sync_weights(policy, args.sampler)  # the sampler starts from the policy's weights
    order, pool, draws, history = random.Random(args.seed), [], itertools.count(), []
    sync = None  # the sampler's sync in progress

    def produce() -> list:  # one rollout: a batch of prompts and their sampled groups
        nonlocal pool
        if len(pool) < args.prompts_per_update:
            pool += order.sample(prompts, len(prompts))
        batch, pool = pool[:args.prompts_per_update], pool[args.prompts_per_update:]
        groups = caller.generate(batch, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, num_return_sequences=args.samples_per_prompt,
                                 seed=args.seed * 100003 + next(draws), llm=args.sampler or None)
        return [(batch, groups)]

    def version_of(rollout) -> int:
        return min(s["policy_version"] for group in rollout[1] for s in group)

    # one batch a call, K batches buffered at most: the batch for step k + K is drawn only once step k's was taken,
    # so none is ever more than K steps old (nothing dropped)
    rollouts = llmrl.AsyncRollouts(produce, max_staleness=args.async_staleness, capacity=args.async_staleness,
                                   version_of=version_of) if args.async_staleness else None
    version = caller.generate(prompts[:1], max_new_tokens=1)[0][0]["policy_version"] if rollouts else None
    with rollouts or contextlib.nullcontext():
        for update in (bar := tqdm(range(args.updates), desc="GRPO in the script", unit="update")):
            start = time.time()
            taken = rollouts.take(1, version) if rollouts else None
            batch, groups = taken.rollouts[0] if taken else produce()[0]
            waited = time.time() - start  # sampling (synchronous), or waiting for the sampler's thread (asynchronous)
            prompt_ids = [t["ids"] for t in caller.tokenize(batch)]  # the tokens the sampler read
            samples = [(ids, s, a) for ids, group in zip(prompt_ids, groups)
                       for s, a in zip(group, group_advantages([reward(s["text"]) for s in group])) if len(s["tokens"])]
            data = [completion_datum(ids, s["tokens"]) for ids, s, _ in samples]
            reference = caller.forward(data, peft_adapter="reference")["loss_fn_outputs"]
            n, kls = len(samples), []
            for k, ((ids, sample, advantage), ref) in enumerate(zip(samples, reference)):
                kl = sample["logprobs"] - ref["logprobs"][-len(sample["tokens"]):]  # per token, log pi - log pi_ref
                kl_to_go = kl.flip(0).cumsum(0).flip(0)  # the KL penalty is a reward: each token answers for the rest
                per_token = (advantage - args.kl_coef * kl_to_go) / (len(kl) * n)  # a mean over tokens, then samples
                data[k] = completion_datum(ids, sample["tokens"], logprobs=sample["logprobs"], advantages=per_token)
                kls.append(float(kl.sum()))
            out = caller.forward_backward(data, "importance_sampling",
                                          policy_versions=[s["policy_version"] for _, s, _ in samples])
            lr = args.lr * (1 - update / args.updates)  # the schedule lives here
            step = caller.optim_step({"learning_rate": lr, "grad_clip_norm": args.grad_clip_norm})
            version = step["policy_version"]
            if args.sampler:  # sent while this thread goes on: the sampler takes the weights after its call in
                # progress, or between two of its decode batches (a call of several); one sync at a time (its answer
                # raises what went wrong)
                if sync is not None:
                    sync.result()
                sync = caller.sync_weights_async(policy, args.sampler, in_flight=True)
            rewards = [reward(s["text"]) for _, s, _ in samples]
            history.append({"update": update + 1, "samples": n, "reward": sum(rewards) / n, "kl": sum(kls) / n,
                            "loss": out["metrics"]["loss:sum"], "learning_rate": lr, "grad_norm": step["grad_norm"],
                            "staleness_max": out["metrics"]["staleness:max"], "dropped": taken.dropped if taken else 0,
                            **mismatch(samples, out["loss_fn_outputs"]), "waited_for_samples": waited,
                            "seconds": time.time() - start})
            caller.log({f"train/{key}": history[-1][key] for key in ("reward", "kl", "loss", "learning_rate",
                                                                      "staleness_max", "ratio_max")})
            bar.set_postfix(reward=f"{history[-1]['reward']:+.2f}", kl=f"{history[-1]['kl']:.2f}", lr=f"{lr:.1e}")
    if sync is not None:
        sync.result()
    return history


def mismatch(samples: list, outputs: list) -> dict:
    """The sampler/learner mismatch of a batch: per token, the ratio of the learner's probability (before the step)
    to the sampler's; its mean and max, and KL(sampler || learner) per token (the mean of log p_sampler - log p)."""
    import torch

    gaps = torch.cat([out["logprobs"][-len(s["tokens"]):] - s["logprobs"] for (_, s, _), out in zip(samples, outputs)])
    ratio = gaps.exp()
    return {"ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()),
            "kl_sampler_learner": float(-gaps.mean())}


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantages: each reward centred on its group's mean, scaled by the group's standard deviation."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)) ** 0.5
    return [(r - mean) / (std + 1e-4) for r in rewards]


def parse_args() -> Args:
    parser = flags_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args.updates, args.prompts_per_update, args.samples_per_prompt, args.eval_prompts = 2, 4, 2, 8
        args.max_new_tokens = 8
    return args


def main() -> None:
    args = parse_args()
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    train_prompts, held_out = build_prompts()
    held_out = held_out[:args.eval_prompts]
    reward = Reward(args.short_penalty, args.repeat_penalty)
    start = time.time()
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        before = evaluate(caller, held_out, reward, args, "before training")
        caller.log({"eval/mean_reward": before["mean_reward"]})  # step 0: before any optim_step
        history = train(caller, train_prompts, reward, args)
        after = evaluate(caller, held_out, reward, args, "after training")
        caller.log({"eval/mean_reward": after["mean_reward"]})  # at the last optim_step's step
    wall = time.time() - start
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = after["ci95"][0] > before["ci95"][1]
    summary = {"provenance": run_provenance(),
               "args": asdict(args), "before": before, "after": after, "improvement_significant": significant,
               "wall_seconds": wall, "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"), "GRPO written in the script")
    print(f"held-out reward {before['mean_reward']:+.3f} -> {after['mean_reward']:+.3f} "
          f"({'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; "
          f"results in {args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
