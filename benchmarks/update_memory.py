"""Peak memory of a ``grpo`` and a ``ppo_tokens`` update on a long batch, side by side in one run: llmrl as it was
(one pass per micro-batch, full-vocabulary logits), llmrl with its defaults (passes of at most the token budget,
log-probs from hidden states in chunks), the same with ``gradient_checkpointing: true``, and a plain Hugging Face
+ PEFT policy-gradient loop with Hugging Face's checkpointing (what a script without llmrl does).

    .venv/bin/python -m benchmarks.update_memory      # CPU: 2 narrow layers, SmolLM2's 49k vocabulary (~2.5 minutes)
    python -m benchmarks.update_memory --shape smollm2-1.7b --devices 0 --dtype bfloat16 --prompts 8 \
        --new-tokens 512 --prompt-tokens 49                # one GPU: the issue's batch (peak CUDA memory instead)

Each llmrl path is a live run of its own (one server rank): the peak resident memory of the server during the update,
above what it held before it (``server_memory()``: ``peak_rss`` after, ``rss`` before), and the update's time. The
plain loop runs in a child process and reports the same. Every llmrl path starts from the same weights and trains on
the same batch; the row prints the largest difference of the trained weights from the old path's (the new paths
must give the same update) and the old path's statistics next to the new ones. The model has few, narrow layers so
that logits dominate on CPU as they do on a GPU. It writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.kit import testkit
from benchmarks.memory import SHAPES

LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 16}}}}
PATHS = {  # name: (training keys, extra initializers)
    "llmrl before (one pass per micro-batch, whole logits)": (
        {"max_tokens_per_micro_batch": 10**9, "gradient_checkpointing": False}, ["benchmarks.hooks:LogitsKeptWhole"]),
    "llmrl defaults (token-bounded passes, chunked log-probs)": ({}, []),
    "llmrl defaults + gradient_checkpointing": ({"gradient_checkpointing": True}, []),
}


def narrow_model(folder: str, shape: str = "narrow") -> str:
    """A seeded random Llama of ``shape`` (default: 2 narrow layers) with a 49,152-token vocabulary, in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **SHAPES[shape])
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def batch(args) -> tuple[list, list, list]:
    """Prompts (token ids), ``--samples`` continuations of ``--new-tokens`` tokens each, and their rewards."""
    prompts = [[1] + [100 + 7 * i + j for j in range(args.prompt_tokens - 1)] for i in range(args.prompts)]
    continuations = [[[300 + (11 * k + 5 * i + 3 * t) % 48000 for t in range(args.new_tokens)]
                      for k in range(args.samples)] for i in range(args.prompts)]
    rewards = [[float((i + k) % 3) - 1.0 for k in range(args.samples)] for i in range(args.prompts)]
    return prompts, continuations, rewards


def llmrl_path(model: str, tokenizer: str, updater: str, training: dict, hooks: list, args) -> dict:
    """One update through a live run; its peak memory, time, statistics and trained weights."""
    heads = {"value": {"plugin": "token_value", "args": {"hidden": 16}}} if updater == "ppo_tokens" else {}
    llm = {"model": model, "tokenizer": tokenizer, "initializers": [LORA, *hooks], "heads": heads,
           "devices": "cpu" if args.devices == "cpu" else [int(args.devices)], "dtype": args.dtype,
           "updater": {"plugin": updater, "args": {"epochs": 1}},
           "training": {"micro_batch_size": args.prompts, "optimizer": {"type": "sgd", "lr": 0.1}, **training}}
    prompts, continuations, rewards = batch(args)
    with testkit().LiveRun({"llms": {"main": llm}, "threads_per_rank": args.threads}) as run:
        before = run.server_memory()[1]
        start = time.perf_counter()
        stats = run.update(prompts, continuations, rewards=rewards)[0]
        seconds = time.perf_counter() - start
        after = run.server_memory()[1]
        weights = {k: v for k, v in run.state_dict().items() if "lora_" in k or k.startswith("heads.")}
    if "cuda_peak" in after:  # a GPU: the allocator's peak (over the server's life: loading peaks lower)
        peak = after["cuda_peak"] - before["cuda_allocated"]
    else:
        peak = after["peak_rss"] - before["rss"]
    return {"peak_bytes": max(peak, 0), "seconds": seconds, "stats": stats, "weights": weights}


def plain_child(model: str, args) -> dict:
    """A plain HF + PEFT policy-gradient step over the batch, 8 sequences per forward, Hugging Face's checkpointing."""
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    device = torch.device("cpu" if args.devices == "cpu" else f"cuda:{args.devices}")
    base = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).to(device)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    prompts, continuations, rewards = batch(args)
    rows = [(p + c, r) for p, cs, rs in zip(prompts, continuations, rewards) for c, r in zip(cs, rs)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1]) * resource.getpagesize()
    start = time.perf_counter()
    for first in range(0, len(rows), 8):
        part = rows[first:first + 8]
        ids = torch.tensor([ids for ids, _ in part], device=device)
        advantages = torch.tensor([r for _, r in part], device=device)
        logits = policy(input_ids=ids).logits[:, args.prompt_tokens - 1:-1].float()
        targets = ids[:, args.prompt_tokens:]
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
        (-(logp.sum(1) * advantages).sum() / len(rows)).backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(peak - before, 0), "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="continuations per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--updaters", default="grpo,ppo_tokens")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    parser.add_argument("--devices", default="cpu", help="cpu, or the GPU id the server (and the plain loop) use")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(plain_child(args.child, args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="llmrl-bench-narrow-") as work:  # the model is removed afterwards
        return compare(narrow_model(work, args.shape), args, argv)


def compare(folder: str, args, argv) -> int:
    """Run the plain loop in a child process and each llmrl path on the model in ``folder``; print the table."""
    tokenizer = testkit().tiny_model("llama")
    tokens = args.prompts * args.samples * (args.prompt_tokens + args.new_tokens)
    command = [sys.executable, "-m", "benchmarks.update_memory", "--child", folder] + (argv or sys.argv[1:])
    quiet = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(command, capture_output=True, text=True, env=quiet)
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    plain = json.loads(done.stdout.strip().splitlines()[-1])
    for updater in args.updaters.split(","):
        print(f"{updater} update: {args.prompts} prompts x {args.samples} continuations x {args.new_tokens} new tokens "
              f"({tokens} tokens), Llama shape {args.shape}, vocabulary 49152, LoRA r=16, {args.dtype}, devices "
              f"{args.devices}; peak memory (resident on CPU, CUDA allocated on a GPU) above the server's before "
              "the update:")
        runs = {name: llmrl_path(folder, tokenizer, updater, training, hooks, args)
                for name, (training, hooks) in PATHS.items()}
        old = next(iter(runs.values()))
        for name, run in runs.items():
            diff = max(float((run["weights"][k] - w).abs().max()) for k, w in old["weights"].items())
            share = run["peak_bytes"] / max(old["peak_bytes"], 1)
            print(f"  {name + ':':60s} {run['peak_bytes'] / 2**20:8.1f} MiB ({share:.3f} of before), "
                  f"{run['seconds']:6.1f} s, {run['stats']['passes_with_gradients']} pass(es) with gradients; "
                  f"trained weights differ from before's by {diff:.1e}")
        print(f"  {'plain HF + PEFT, checkpointing, 8 sequences per pass:':60s} {plain['peak_bytes'] / 2**20:8.1f} MiB "
              f"({plain['peak_bytes'] / old['peak_bytes']:.3f} of before), {plain['seconds']:6.1f} s")
        keys = [k for k in old["stats"] if k not in ("passes_with_gradients",)]
        new = runs[list(PATHS)[1]]["stats"]
        print("  statistics, before -> defaults: " + ", ".join(f"{k} {old['stats'][k]:.6g} -> {new[k]:.6g}"
                                                              for k in keys if isinstance(old["stats"][k], float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
