"""Generation paths side by side, in one process, on one device: llmrl's decoding loop against plain Hugging Face.

Run from the repository root::

    python -m benchmarks.decoding --device cuda                 # SmolLM2-1.7B's shape, bf16, LoRA r=16 everywhere
    python -m benchmarks.decoding --device cpu --shape tiny     # a smoke run of every path

Each row generates the same prompts with the same settings and prints seconds and the ratio to plain Hugging Face
``generate`` on the model without its adapter:
  - plain HF ``generate`` (the adapter disabled); HF ``generate`` with the LoRA adapter unmerged (PEFT), which is
    what llmrl ran before its own loop (``generation.decoder: hf``);
  - llmrl's ``generate`` code (the server's, called in-process) with its loop: one prefill per prompt, the adapter
    merged, on CUDA a static cache and the decode step captured (the first call of a shape compiles; its time is
    printed apart), on a CPU weights packed for the CPU's kernel (MKL's, or oneDNN's on AMD CPUs; the other kernel is
    timed too, in the same run) and the step of Llama-shaped models written out (``llama_step``; the same loop with
    Hugging Face's step is timed too);
  - HF ``generate`` with a static cache, which compiles its forward (on the plain model);
  - the memory-bandwidth limit: the weights and the key/value cache read once per decode step, at the copy rate
    measured here.
It also reports exactness on this device: greedy tokens against HF with the adapter unmerged, and the largest difference
between the loop's log-probs and a plain forward over prompt + continuation (what ``score`` computes). The models have
random weights of real architectures (speed does not depend on the weights), and ``min_new_tokens`` fixes every
sequence's length. Samples are drawn with Hugging Face's default processors (top-k 50), or with ``--sampling demo`` the
RLHF demo's (top-k 0, top-p 1, temperature 1). Every path runs under the same host allocator setting, the servers'
default (``--host-malloc``). Results go to ``--out`` as JSON. This module benchmarks; it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

from benchmarks.kit import claim_results_file

SHAPES = {  # LlamaConfig fields
    "smollm2-1.7b": dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)).eval()
    with torch.no_grad():  # a trained-looking adapter: B away from its zero start
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def tokenizer_from(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from testkit.models import tiny_model

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def prompt_ids(tokenizer, count: int, length: int) -> list[list[int]]:
    base = tokenizer.encode("Write a short review of a film you watched recently, and say why you liked it: ")
    return [(base * (length // len(base) + 1))[: length - (i % 4)] for i in range(count)]


def llmrl_generate(model, tokenizer, prompts, kwargs, device, settings: dict, decoder=None):
    from llmrl.engine.config.types import GenerationSettings
    from llmrl.engine.model.decoding.runtime import Decoder
    from llmrl.engine.model.generation import generate, plan_generate

    if decoder is None and settings is not None:
        decoder = Decoder(GenerationSettings(**settings), torch.device(device).type)
    plan = plan_generate(model, tokenizer, "causal", prompts, kwargs, 1 << 22, 4096, 8192)
    return generate(model, tokenizer, "causal", plan, device, seed=0, decoder=decoder), decoder


def hf_generate(model, prompts, kwargs, device, adapter: bool, **extra):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    torch.manual_seed(0)
    with torch.no_grad():
        if adapter:
            return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=2, **kwargs, **extra)
        with model.disable_adapter():
            return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=2, **kwargs, **extra)


def copy_rate(device: str) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read + write), the best of five."""
    size = (1 << 30) if device.startswith("cuda") else (1 << 27)
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        _, seconds = timed(lambda: b.copy_(a), device)
        best = min(best, seconds)
    return 2 * size / best


def bandwidth_limit(model, rows: int, prompt: int, new: int, rate: float) -> float:
    """Seconds to read every weight once per decode step plus the key/value cache as it grows."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    cache = sum(rows * (prompt + t) * per_token for t in range(new))
    return (new * weights + cache) / rate


def exactness(model, tokenizer, prompts, device, settings=None) -> dict:
    """Greedy tokens of llmrl's loop vs HF with the adapter unmerged; loop log-probs vs a plain forward."""
    kwargs = {"max_new_tokens": 32, "do_sample": False}
    ours, _ = llmrl_generate(model, tokenizer, prompts, kwargs, device, settings or {})
    reference, _ = llmrl_generate(model, tokenizer, prompts, kwargs, device, None)
    same = sum(a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(ours, reference))
    return {"greedy sequences equal to HF (adapter unmerged)": f"{same}/{len(prompts)}",
            "largest |loop log-prob - plain forward log-prob|": _worst_gap(model, prompts, ours, device),
            "the same for HF generate (adapter unmerged): the dtype's floor": _worst_gap(model, prompts, reference,
                                                                                          device)}


def _worst_gap(model, prompts, results, device) -> float:
    """The largest difference between generated log-probs and a plain forward over prompt + continuation."""
    worst = 0.0
    with torch.no_grad():
        for prompt, (sample,) in zip(prompts, results):
            tokens = sample["tokens"].tolist()
            logits = model(input_ids=torch.tensor([prompt + tokens], device=device)).logits[0].float()
            rows = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
            plain = rows.log_softmax(-1).gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()
            worst = max(worst, float((plain - sample["logprobs"]).abs().max()))
    return worst


def paths_row(model, tokenizer, prompts, kwargs, device, settings, limit, keep: dict | None = None) -> dict:
    """Plain HF, HF with the adapter unmerged, llmrl's loop (first call apart), the limit; ratios to plain HF.
    ``keep`` receives the loop's decoder (its compiled steps), for a later profile."""
    row: dict = {}
    timed(lambda: hf_generate(model, prompts, kwargs, device, adapter=False), device)  # warm-up
    plain = row["plain HF generate, no adapter"] = min(timed(  # each path: the best of two warm calls
        lambda: hf_generate(model, prompts, kwargs, device, adapter=False), device)[1] for _ in range(2))
    row["HF generate, LoRA unmerged (llmrl before: decoder hf)"] = min(timed(
        lambda: hf_generate(model, prompts, kwargs, device, adapter=True), device)[1] for _ in range(2))
    (_, decoder), row["llmrl loop, first call (compiles)"] = timed(
        lambda: llmrl_generate(model, tokenizer, prompts, kwargs, device, settings), device)
    row["llmrl loop"] = min(timed(lambda: llmrl_generate(model, tokenizer, prompts, kwargs, device, settings,
                                                         decoder), device)[1] for _ in range(2))
    row["llmrl decoder stats"] = decoder.stats()
    if device.startswith("cpu") and settings.get("llama_step", "auto") in ("auto", True):  # its share, in this run
        hf_step = {**settings, "llama_step": False}
        _, hf_decoder = llmrl_generate(model, tokenizer, prompts, kwargs, device, hf_step)  # packs its weights
        row["llmrl loop, Hugging Face's step (llama_step false)"] = min(timed(lambda: llmrl_generate(
            model, tokenizer, prompts, kwargs, device, hf_step, hf_decoder), device)[1] for _ in range(2))
    from llmrl.engine.model.decoding.packed_linears import KERNELS, available

    used = row["llmrl decoder stats"].get("packed_for")
    for kernel in [k for k in KERNELS if device.startswith("cpu") and used is not None and k != used and available(k)]:
        other = {**settings, "pack_weights": kernel}  # the other CPU kernel, in this run (auto picks by CPU vendor)
        _, other_decoder = llmrl_generate(model, tokenizer, prompts, kwargs, device, other)  # packs its weights
        call = functools.partial(llmrl_generate, model, tokenizer, prompts, kwargs, device, other, other_decoder)
        row[f"llmrl loop, weights packed for {kernel} (pack_weights {kernel})"] = min(
            timed(call, device)[1] for _ in range(2))
    if keep is not None:
        keep["decoder"] = decoder
    row["bandwidth limit"] = limit
    for key in list(row):
        if isinstance(row[key], float):
            row[key.split(" (")[0] + " / plain"] = row[key] / plain
    return row


def profile_loop(model, tokenizer, prompts, kwargs, device, settings, decoder=None) -> dict:
    """One warm call of llmrl's loop under torch's profiler: the operations that take the most device time and the
    most host time, as text tables (without a ``decoder`` that has run this shape, a first call compiles,
    unprofiled)."""
    from torch.profiler import ProfilerActivity, profile

    if decoder is None:
        _, decoder = llmrl_generate(model, tokenizer, prompts, kwargs, device, settings)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llmrl_generate(model, tokenizer, prompts, kwargs, device, settings, decoder)
        sync(device)
    out = {"seconds under the profiler": time.perf_counter() - start}
    events = prof.key_averages()
    sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if device.startswith("cuda") else [])
    for key in sorts:
        out[key] = events.table(sort_by=key, row_limit=30, max_name_column_width=60).splitlines()
    return out


def hf_static_row(model, prompts, kwargs, device, ours: float) -> dict:
    """HF generate with a static cache (it compiles its forward), plain model: first call, then a timed one."""
    static = dict(cache_implementation="static")
    first = timed(lambda: hf_generate(model, prompts, kwargs, device, adapter=False, **static), device)[1]
    again = timed(lambda: hf_generate(model, prompts, kwargs, device, adapter=False, **static), device)[1]
    return {"first call": first, "seconds": again, "llmrl loop / this": ours / again}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", default="128", help="comma-separated: a row set per length")
    parser.add_argument("--batch1-shape", default="smollm2-135m", help="the batch-1 decoding row's model ('' skips)")
    parser.add_argument("--skip-hf-compile", action="store_true")
    parser.add_argument("--skip-exactness", action="store_true", help="no exactness row (it compiles another shape)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--settings", default="{}", help="llms.<name>.generation for llmrl's loop, as JSON")
    parser.add_argument("--profile", action="store_true", help="also profile one warm call of llmrl's loop")
    parser.add_argument("--sampling", choices=("hf-defaults", "demo"), default="hf-defaults",
                        help="hf-defaults: Hugging Face's (top_k 50); demo: the RLHF demo's (top_k 0, top_p 1, "
                             "temperature 1)")
    parser.add_argument("--host-malloc", choices=("reuse", "default"), default="reuse",
                        help="this process's allocator, for every path: what llmrl's server ranks set (host_malloc)")
    parser.add_argument("--out", default="decoding.json")
    parser.add_argument("--exactness", default=None,
                        help='only exactness rows, as JSON [[dtype, settings], ...], e.g. [["float32", {}]]')
    args = parser.parse_args(argv)
    mark = claim_results_file(args.out, "decoding")
    from llmrl.engine.server.host_memory import keep_freed_memory

    print(keep_freed_memory(args.host_malloc), file=sys.stderr)
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    tokenizer = tokenizer_from(args.tokenizer)
    results: dict = {**mark, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                     "shape": args.shape, "dtype": str(dtype), "torch": torch.__version__,
                     "host_malloc": args.host_malloc, "sampling": args.sampling}
    rate = copy_rate(device)
    results["copy GB/s"] = rate / 1e9

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    def stage(name, fn):
        print(f"== {name}", flush=True)
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - a benchmark goes on to its next row
            value = {"error": f"{type(err).__name__}: {err}"[:2000]}
        results[name] = value
        print(json.dumps(value, indent=1), flush=True)
        save()
        return value

    prompts = prompt_ids(tokenizer, args.prompts, args.prompt_tokens)
    if args.exactness:
        for dtype_name, settings in json.loads(args.exactness):
            model = build(args.shape, getattr(torch, dtype_name), device)
            stage(f"exactness, {dtype_name}, {json.dumps(settings)}", functools.partial(
                exactness, model, tokenizer, prompts, device, settings))
            del model
        return 0
    model = build(args.shape, dtype, device)
    if not args.skip_exactness:
        stage("exactness", lambda: exactness(model, tokenizer, prompts, device))
    settings = json.loads(args.settings)
    for new in [int(n) for n in args.new_tokens.split(",")]:
        kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": True,
                  "num_return_sequences": args.samples}
        if args.sampling == "demo":
            kwargs.update(top_k=0, top_p=1.0, temperature=1.0)
        rows = args.prompts * args.samples
        limit = bandwidth_limit(model, rows, args.prompt_tokens, new, rate)
        keep: dict = {}
        row = stage(f"{rows} x {new} tokens", functools.partial(
            paths_row, model, tokenizer, prompts, kwargs, device, settings, limit, keep))
        if args.profile:
            stage(f"{rows} x {new} tokens, llmrl loop profiled", functools.partial(
                profile_loop, model, tokenizer, prompts, kwargs, device, settings, keep.get("decoder")))
        if not args.skip_hf_compile:
            stage(f"{rows} x {new} tokens, HF static cache + compile, no adapter", functools.partial(
                hf_static_row, model, prompts, kwargs, device, row.get("llmrl loop", float("nan"))))
    if args.batch1_shape:
        small = build(args.batch1_shape, torch.float32, device)
        one = prompt_ids(tokenizer, 1, 32)
        kwargs = {"max_new_tokens": 128, "min_new_tokens": 128, "do_sample": False}

        def batch1():
            out = {}
            hf_generate(small, one, kwargs, device, adapter=True)
            out["HF, LoRA unmerged, ms/token"] = timed(lambda: hf_generate(small, one, kwargs, device, True),
                                                       device)[1] / 128 * 1e3
            out["plain HF, ms/token"] = timed(lambda: hf_generate(small, one, kwargs, device, False),
                                              device)[1] / 128 * 1e3
            (_, decoder), first = timed(lambda: llmrl_generate(small, tokenizer, one, kwargs, device, settings), device)
            out["llmrl first call (compiles), s"] = first
            out["llmrl loop, ms/token"] = min(
                timed(lambda: llmrl_generate(small, tokenizer, one, kwargs, device, settings, decoder), device)[1]
                for _ in range(2)) / 128 * 1e3
            out["speed-up over HF unmerged"] = out["HF, LoRA unmerged, ms/token"] / out["llmrl loop, ms/token"]
            return out

        stage(f"batch 1, {args.batch1_shape} float32, 128 greedy tokens", batch1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
