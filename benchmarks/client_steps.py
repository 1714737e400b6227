"""The cost of a training step written in the script (``forward_backward`` + ``optim_step``) against the same step
run by the ``grpo`` updater plugin (``update``), on the same batch, in one run.

    .venv/bin/python -m benchmarks.client_steps                   # SmolLM2-135M-Instruct with LoRA on CPU
    .venv/bin/python -m benchmarks.client_steps --model tiny      # the tiny random model (seconds; a smoke run)

Two LLMs of one run start from the same weights: ``plugin`` runs ``grpo`` (one epoch, the whole batch in one
optimizer step, no KL term) and ``script`` has no updater (``trainable: true``). One batch is sampled once: the
RLHF demo's prompts, 4 continuations each. Each repetition times ``update(prompts, continuations, rewards,
old_logprobs)`` on ``plugin``, then ``forward_backward(data, "ppo")`` + ``optim_step`` on ``script`` with the same
maths (group advantages divided by each continuation's length and the number of continuations, the ratio clipped
to [0.8, 1.2]), and prints both times, their ratio, and the largest difference between the two LLMs' trained
weights (they take the same steps, so it stays at float32 rounding). It writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.kit import ROOT, load_module, testkit

LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 8, "alpha": 16, "last_layers": 8}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model, or 'tiny'")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kit = testkit()
    model = kit.tiny_model("llama") if args.model == "tiny" else args.model
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}} if args.model == "tiny" else LORA
    common = {"model": model, "initializers": [lora], "token_budget": 4096,
              "training": {"optimizer": {"type": "adam", "lr": 1e-3}, "micro_batch_size": args.prompts}}
    llms = {"plugin": {**common, "updater": {"plugin": "grpo", "args": {"kl_coef": 0.0}}},
            "script": {**common, "trainable": True}}
    demo = load_module("rlhf_sentiment", ROOT / "examples" / "rlhf_sentiment.py")
    reward = demo.Reward(0.5, 1.0)
    prompts = demo.build_prompts()[0][:args.prompts]
    with kit.LiveRun({"llms": llms, "threads_per_rank": 2}) as run:
        groups = run.generate(prompts, llm="plugin", max_new_tokens=args.new_tokens, do_sample=True,
                              num_return_sequences=args.samples, seed=0)
        rewards = [[reward(s["text"]) for s in group] for group in groups]
        continuations = [[s["tokens"] for s in group] for group in groups]
        old = [[s["logprobs"] for s in group] for group in groups]
        data = script_data(run, prompts, groups, rewards)
        times = {"plugin": [], "script": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            run.update(prompts, continuations, llm="plugin", rewards=rewards, old_logprobs=old)
            times["plugin"].append(time.perf_counter() - start)
            start = time.perf_counter()
            run.forward_backward(data, "ppo", llm="script")
            run.optim_step(llm="script")
            times["script"].append(time.perf_counter() - start)
        a, b = run.state_dict(llm="plugin"), run.state_dict(llm="script")
        difference = max(float((a[k] - b[k]).abs().max()) for k in a)
    plugin, script = statistics.median(times["plugin"]), statistics.median(times["script"])
    tokens = sum(len(s["tokens"]) for g in groups for s in g)
    print(f"{args.model}: {args.prompts} prompts x {args.samples} continuations ({tokens} generated tokens), "
          f"median of {args.repeats} steps")
    print(f"  update with the grpo plugin:        {plugin:7.3f} s per step")
    print(f"  forward_backward + optim_step:      {script:7.3f} s per step   ({script / plugin:.2f}x the plugin's)")
    print(f"  largest difference of the trained weights after {args.repeats} steps: {difference:.2e}")


def script_data(run, prompts, groups, rewards) -> list[dict]:
    """The grpo plugin's loss as ``ppo`` data: per-token advantage = group advantage / (tokens x continuations)."""
    import torch

    from llmrl import completion_datum
    from llmrl.plugins.rl_math import group_advantages

    ids = [t["ids"] for t in run.tokenize(prompts)]
    count = sum(len(g) for g in groups)
    data = []
    for prompt, group, scores in zip(ids, groups, rewards):
        advantages = group_advantages(torch.tensor(scores)).tolist()
        for sample, advantage in zip(group, advantages):
            # the plugin averages a prompt's continuations, then the prompts: 1 / count per continuation
            scale = advantage / (len(sample["tokens"]) * count)
            data.append(completion_datum(prompt, sample["tokens"], logprobs=sample["logprobs"], advantages=scale))
    return data


if __name__ == "__main__":
    main()
