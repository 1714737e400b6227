"""Peak memory of ``generate`` with per-token log-probs: llmrl's step-by-step read against Hugging Face's kept
``output_logits`` (what llmrl did before, and what a plain HF script does), side by side in one run.

    .venv/bin/python -m benchmarks.generate_memory                       # CPU: 2 narrow layers, SmolLM2's vocabulary
    python -m benchmarks.generate_memory --shape smollm2-1.7b --rows 64 --new-tokens 512   # on a GPU

Each path runs in a child process of its own on the same random-weight Llama (seeded), the same prompts and the same
sampling seed, and reports the peak memory of the generate call above what the process held before it: resident
memory on CPU (``ru_maxrss``), allocated CUDA memory on a GPU (``max_memory_allocated``). The model has few, narrow
layers by default so that the logits dominate on CPU as they do on a GPU. It prints both peaks, their ratio, and the
largest difference between the two paths' log-probs where their sampled tokens are identical (on CPU; seeded
sampling on a GPU is not bit-reproducible even between two plain HF runs). It writes nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

SHAPES = {  # LlamaConfig arguments; every shape has SmolLM2's 49,152-entry vocabulary
    "narrow": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": True},
}


class IdsTokenizer:
    """The least a generate call needs from a tokenizer when prompts are token ids: special ids and decode."""

    pad_token_id, eos_token_id, bos_token_id = 0, 2, 1

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def resident_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def child(path: str, args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmrl.engine.model.generation import generate, plan_generate

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **SHAPES[args.shape])
    with device:
        model = LlamaForCausalLM(config).to(dtype).eval()
    prompts = [[1] + [(7 * i + 13 * j) % 49000 + 100 for j in range(args.prompt_tokens - 1)]
               for i in range(args.prompts)]
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": True,
                "num_return_sequences": args.rows // args.prompts, "pad_token_id": 0}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resident_kb() * 1024
    with torch.no_grad():
        if path == "llmrl":
            plan = plan_generate(model, IdsTokenizer(), "causal", prompts, settings, 10**9, 10**6, None)
            results = generate(model, IdsTokenizer(), "causal", plan, device, seed=args.seed)
            tokens = [s["tokens"].tolist() for r in results for s in r]
            logprobs = [s["logprobs"].tolist() for r in results for s in r]
        else:  # plain HF: keep the raw logits of every step, then read the chosen tokens' log-probs
            torch.manual_seed(args.seed)
            ids = torch.tensor(prompts, device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                 output_logits=True, **settings)
            chosen = out.sequences[:, ids.shape[1]:]
            logits = torch.stack(out.logits, dim=1).float()
            values = (logits.gather(-1, chosen[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)).cpu()
            tokens, logprobs = chosen.cpu().tolist(), values.tolist()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"peak_bytes": peak, "tokens": tokens, "logprobs": logprobs, "device": str(device)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="sequences in all (prompts x samples each)")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["llmrl", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    runs = {}
    for path in ("hf", "llmrl"):
        command = [sys.executable, "-m", "benchmarks.generate_memory", "--child", path] + (argv or sys.argv[1:])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        runs[path] = json.loads(done.stdout.strip().splitlines()[-1])
    hf, ours = runs["hf"], runs["llmrl"]
    same = hf["tokens"] == ours["tokens"]
    diff = max((abs(a - b) for x, y in zip(hf["logprobs"], ours["logprobs"]) for a, b in zip(x, y)), default=0.0)
    kind = "CUDA allocated" if hf["device"].startswith("cuda") else "resident"
    print(f"generate {args.rows} rows x {args.new_tokens} new tokens, shape {args.shape}, vocabulary 49152, "
          f"on {hf['device']}; peak {kind} memory of the call:")
    print(f"  plain HF with output_logits (llmrl before): {hf['peak_bytes'] / 2**20:9.1f} MiB")
    print(f"  llmrl, log-probs read step by step:          {ours['peak_bytes'] / 2**20:9.1f} MiB")
    agreement = (f"same tokens, largest log-prob difference {diff:.2e}" if same else
                 "the sampled tokens differ (seeded sampling on a GPU is not bit-reproducible from run to run, "
                 "even for plain HF), so the log-probs are not compared")
    print(f"  ratio llmrl / HF: {ours['peak_bytes'] / max(hf['peak_bytes'], 1):.3f}; {agreement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
