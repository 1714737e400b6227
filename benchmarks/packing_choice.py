"""The planner's choice between packed and unpacked passes, timed against packing always (what llmrl did before),
on an update's pass shape, in one process and one run.

    .venv/bin/python -m benchmarks.packing_choice                               # 2 prompts x 8 x 256 tokens
    .venv/bin/python -m benchmarks.packing_choice --samples 4 --new-tokens 20   # the RLHF demo's: stays packed
    python -m benchmarks.packing_choice --device cuda --shape smollm2-1.7b --dtype bfloat16 --prompts 8 --samples 8

A random model of a real shape (``benchmarks.memory.SHAPES``) with LoRA r=16 on every linear layer scores prompts of
``--prompt-tokens`` random ids with ``--samples`` continuations of ``--new-tokens`` each, per token (as an update's
passes do), then back-propagates their sum: once as planned with the model's attention cost
(:func:`llmrl.engine.model.scoring.planning.packing_pays` decides), once with packing forced (no attention cost given).
It prints the median seconds of each, their ratio, which layout the planner chose, and the largest difference of
the per-token log-probs and of the LoRA gradients between the two. It asserts nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.memory import SHAPES, IdsTokenizer
    from llmrl.engine.model.scoring.packed import attention_per_column
    from llmrl.engine.model.scoring.planning import Needs, plan_batches
    from llmrl.engine.model.scoring.run import run_batch
    from llmrl.engine.model.scoring.tokenization import tokenize

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], vocab_size=49152, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).eval()
    tokenizer = IdsTokenizer()
    prompts = [torch.randint(10, 40000, (args.prompt_tokens,)).tolist() for _ in range(args.prompts)]
    continuations = [[torch.randint(10, 40000, (args.new_tokens,)).tolist() for _ in range(args.samples)]
                     for _ in prompts]
    plan = tokenize(tokenizer, "causal", prompts, continuations, max_length=4096)
    needs = Needs(per_token=True)
    lora = [p for p in model.parameters() if p.requires_grad]
    alpha = attention_per_column(config)

    def one_pass(attention: float):
        model.zero_grad(set_to_none=True)
        scores, layouts = [], []
        for batch in plan_batches(plan, 1 << 20, 1 << 10, needs, packed=True, attention=attention):
            layouts.append("packed" if batch.packed else "unpacked")
            result = run_batch(model.base_model.model, plan, batch, needs, tokenizer.pad_token_id, args.device, True)
            result.scores.sum().backward()
            tokens = result.tokens  # in no particular order: sorted by candidate, then position
            order = torch.argsort(tokens.candidate * (1 << 20) + tokens.position)
            scores.append(tokens.logprobs.detach().float().cpu()[order])
        grads = torch.cat([p.grad.flatten().float().cpu() for p in lora])
        return scores, grads, layouts

    def timed(attention: float):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = one_pass(attention)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    times: dict[str, list[float]] = {"planned": [], "packed always": []}
    outs = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, attention in (("planned", alpha), ("packed always", 0.0)):
            outs[name], seconds = timed(attention)
            if repeat:
                times[name].append(seconds)
    planned, packed = statistics.median(times["planned"]), statistics.median(times["packed always"])
    (s1, g1, layouts), (s2, g2, _) = outs["planned"], outs["packed always"]
    print(f"{args.shape} {args.dtype} on {args.device}: {args.prompts} prompts of {args.prompt_tokens} tokens x "
          f"{args.samples} x {args.new_tokens} tokens, per token, forward + backward, median of {args.repeats}")
    print(f"  planned ({', '.join(sorted(set(layouts)))}, attention per column {alpha:.2e}): {planned:.3f} s")
    print(f"  packed always: {packed:.3f} s   -> planned is {packed / planned:.2f}x as fast")
    print(f"  largest difference: log-probs {max(float((a - b).abs().max()) for a, b in zip(s1, s2)):.1e}, "
          f"LoRA gradients {float((g1 - g2).abs().max()):.1e} (of {float(g2.abs().max()):.1e})")


if __name__ == "__main__":
    main()
