"""Decode steps over a static cache attending over windows of it (``generation.attention_window``, 64 by default)
against attending over its whole length (``attention_window: 0``), in one run, on one device.

    .venv/bin/python -m benchmarks.attention_window                  # CPU: SmolLM2-135M's shape, 8 x (32 + 224)
    python -m benchmarks.attention_window --device cuda --shape smollm2-1.7b --prompts 8 --samples 8 \\
        --prompt-tokens 64 --new-tokens 512 --length-bucket 256      # the H100 GRPO step's generation

Both rows run llmrl's loop with a static cache on the same random-weight model with a LoRA adapter, the same prompts
and ``min_new_tokens`` = ``max_new_tokens``. On CUDA the step is compiled and captured: one compile serves every
window (its width is dynamic) and each new width is captured once, so the first call is printed apart. It prints each
row's first call and best of two warm calls, the ratio whole / windowed, whether the greedy tokens are the same and
the largest log-prob difference, and the memory-bandwidth limit of the weights plus the filled cache read once per
step (:mod:`benchmarks.decoding`). It writes nothing and asserts nothing.
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.decoding import bandwidth_limit, build, copy_rate, llmrl_generate, prompt_ids, timed, tokenizer_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=224)
    parser.add_argument("--length-bucket", type=int, default=64)
    parser.add_argument("--window-columns", type=int, default=64, help="generation.attention_window")
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    torch.set_grad_enabled(False)
    model, tokenizer = build(args.shape, dtype, args.device), tokenizer_from(args.tokenizer)
    prompts = prompt_ids(tokenizer, args.prompts, args.prompt_tokens)
    kwargs = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": args.samples > 1,
              "num_return_sequences": args.samples}
    results, seconds = {}, {}
    for windowed in (True, False):
        settings = {"static_cache": True, "length_bucket": args.length_bucket,
                    "attention_window": args.window_columns if windowed else 0}
        call = functools.partial(llmrl_generate, model, tokenizer, prompts, kwargs, args.device, settings)
        (out, decoder), first = timed(call, args.device)
        warm = min(timed(functools.partial(call, decoder=decoder), args.device)[1] for _ in range(2))
        results[windowed], seconds[windowed] = out, warm
        name = "windowed" if windowed else "whole cache"
        print(f"  {name:12s} first call {first:7.2f} s, warm {warm:7.3f} s; compiled shapes (rows, length, window) "
              f"{decoder.stats()['compiled_shapes']}", flush=True)
    rows = args.prompts * args.samples
    limit = bandwidth_limit(model, rows, args.prompt_tokens, args.new_tokens, copy_rate(args.device))
    same = all(a["tokens"].tolist() == b["tokens"].tolist() for ra, rb in zip(results[True], results[False])
               for a, b in zip(ra, rb))
    gap = max(float((a["logprobs"] - b["logprobs"]).abs().max()) for ra, rb in zip(results[True], results[False])
              for a, b in zip(ra, rb))
    print(f"{args.shape}, {dtype} on {args.device}, {rows} rows x ({args.prompt_tokens} + {args.new_tokens}) tokens, "
          f"length_bucket {args.length_bucket}, attention_window {args.window_columns}:")
    print(f"  whole cache / windowed: {seconds[False] / seconds[True]:.2f}x  (windowed {seconds[True]:.3f} s, "
          f"whole {seconds[False]:.3f} s, bandwidth limit {limit:.3f} s: windowed {seconds[True] / limit:.2f}x it)")
    print(f"  {'same' if same else 'DIFFERENT'} {'samples' if args.samples > 1 else 'greedy tokens'}; "
          f"log-probs within {gap:.1e}")


if __name__ == "__main__":
    main()
