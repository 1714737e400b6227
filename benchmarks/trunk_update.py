"""A token-level update with its frozen trunk computed once (``trunk_reuse_mb``) against the same update with every
layer run in every pass, on the RLHF demo's batch, in one run.

    .venv/bin/python -m benchmarks.trunk_update                    # SmolLM2-135M-Instruct, LoRA on the top 8 of 30
    .venv/bin/python -m benchmarks.trunk_update --updater grpo     # the demo's grpo config instead of ppo_tokens
    .venv/bin/python -m benchmarks.trunk_update --model tiny       # the tiny random model (a smoke run)

Two LLMs of one run start from the same weights and differ only in ``trunk_reuse_mb``: ``whole`` (0) and ``trunk``.
Their updater is the RLHF demo's (``configs/rlhf-sentiment.yaml``: ``ppo_tokens`` with a token value head, 2 epochs of 2
minibatches, KL to the adapters-off reference; or ``configs/rlhf-sentiment-grpo.yaml``'s ``grpo``). Each repetition
samples a fresh batch (8 prompts x 4 continuations of 16 tokens, as one demo update), by default from ``trunk`` itself,
as the demo samples from the LLM it trains: its decoding loop keeps the trunk of what it samples, and the update replays
it in every pass. With ``--sample-from whole`` no call of ``trunk`` ever computed these tokens: its update records them
in its first pass and replays them in the reference pass and every epoch. Then it times ``update`` on ``whole`` and on
``trunk`` with the same batch, one after the other. It prints the median times, their ratio, the largest difference of
the two LLMs' statistics and trained weights (float32 rounding, magnified by Adam where a gradient is near zero), and
the trunk's replayed and whole model calls. It writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.kit import ROOT, load_module, testkit

LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 8, "alpha": 16, "last_layers": 8}}}}
UPDATERS = {  # the demo configs' updaters
    "ppo_tokens": ({"epochs": 2, "clip_eps": 0.2, "value_clip": 0.2, "value_coef": 0.5, "kl_coef": 0.05, "gamma": 1.0,
                    "lam": 0.95}, {"value": {"plugin": "token_value", "args": {"hidden": 128}}}),
    "grpo": ({"epochs": 2, "clip_eps": 0.2, "kl_coef": 0.2}, {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model, or 'tiny'")
    parser.add_argument("--updater", choices=sorted(UPDATERS), default="ppo_tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample-from", choices=("trunk", "whole"), default="trunk",
                        help="the LLM that samples each batch (trunk: its loop keeps the trunk for the update)")
    args = parser.parse_args()
    kit = testkit()
    tiny = args.model == "tiny"
    model = kit.tiny_model("llama") if tiny else args.model
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4, "last_layers": 1}}}} if tiny else LORA
    updater_args, heads = UPDATERS[args.updater]
    common = {"model": model, "initializers": [lora], "heads": heads, "token_budget": 4096,
              "updater": {"plugin": args.updater, "args": updater_args},
              "training": {"optimizer": {"type": "adam", "lr": 1e-3}, "micro_batch_size": max(args.prompts // 2, 1),
                           "gradient_clipping": 1.0}}
    llms = {"whole": {**common, "trunk_reuse_mb": 0}, "trunk": {**common, "trunk_reuse_mb": 256}}
    demo = load_module("rlhf_sentiment", ROOT / "examples" / "rlhf_sentiment.py")
    reward = demo.Reward(0.5, 1.0)
    train_prompts = demo.build_prompts()[0]
    times = {"whole": [], "trunk": []}
    stat_difference, tokens = 0.0, 0
    with kit.LiveRun({"llms": llms, "threads_per_rank": 2}) as run:
        for repeat in range(args.repeats):
            prompts = train_prompts[repeat * args.prompts:(repeat + 1) * args.prompts]
            groups = run.generate(prompts, llm=args.sample_from, max_new_tokens=args.new_tokens, do_sample=True,
                                  top_k=0,
                                  num_return_sequences=args.samples, seed=repeat)
            rewards = [[reward(s["text"]) for s in group] for group in groups]
            continuations = [[s["tokens"] for s in group] for group in groups]
            tokens += sum(len(c) for group in continuations for c in group)
            stats = {}
            for name in ("whole", "trunk"):
                start = time.perf_counter()
                stats[name] = run.update(prompts, continuations, llm=name, rewards=rewards)[0]
                times[name].append(time.perf_counter() - start)
            stat_difference = max(stat_difference, *(abs(stats["whole"][k] - stats["trunk"][k])
                                                     for k in stats["whole"]))
        a, b = run.state_dict(llm="whole"), run.state_dict(llm="trunk")
        weight_difference = max(float((a[k] - b[k]).abs().max()) for k in a)
        trunk_ranks = [rank for rank, server in run.servers().items() if server["llm"] == "trunk"]
        trunk = run.server_memory()[trunk_ranks[0]]["trunk"]
    whole, reused = statistics.median(times["whole"]), statistics.median(times["trunk"])
    print(f"{args.model}, {args.updater}: {args.prompts} prompts x {args.samples} continuations "
          f"({tokens / args.repeats:.0f} generated tokens per update), median of {args.repeats} updates")
    print(f"  every layer in every pass:          {whole:7.3f} s per update")
    print(f"  the trunk computed once per update: {reused:7.3f} s per update   ({whole / reused:.2f}x faster)")
    print(f"  trunk: depth {trunk['depth']}, {trunk['replayed_calls']} model calls replayed, {trunk['whole_calls']} "
          "run whole (each update's first pass over tokens it did not sample)")
    print(f"  largest difference: statistics {stat_difference:.2e}, trained weights {weight_difference:.2e}")


if __name__ == "__main__":
    main()
