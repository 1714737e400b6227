"""Profile llmrl's in-process scoring on the benchmark's "6 candidates" workload (16 contexts x ~200 tokens x 6).

From the repository root::

    python -m benchmarks.profile_scoring                       # 2 threads
    THREADS=1 CALL_RUNS=1 python -m benchmarks.profile_scoring  # the clean fractions of a 1-thread run

Prints: the compute limit as benchmarks/run.py computes it, the in-process time (median of 3), per-call-type
time / tokens / achieved GFLOP/s (model.forward wrapped in a timer), a FLOP account (what the limit counts vs what
is really computed), and torch.profiler tables (by op, by op + input shape) with a bucketed breakdown.
Starts no llmrl server; importing this module runs nothing (``main`` does the work).
"""

import argparse
import collections
import functools
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.baselines import inprocess_scores
from benchmarks.limits import measure_matmul_rate, unique_tokens
from benchmarks.workloads import make_workload
from llmrl.engine.model.reuse.hf_kv import layer_cache
from llmrl.engine.model.store.builtin_models import builtin_model_path

COPIES = ("aten::cat", "aten::copy_", "aten::index_select", "aten::index", "aten::clone", "aten::contiguous",
          "aten::zeros", "aten::new_zeros", "aten::empty", "aten::empty_strided", "aten::fill_", "aten::zero_",
          "aten::expand", "aten::slice", "aten::select", "aten::view", "aten::reshape", "aten::transpose",
          "aten::as_strided", "aten::unsqueeze", "aten::t", "aten::_unsafe_view", "aten::permute",
          "aten::resolve_conj", "aten::resolve_neg", "aten::detach", "aten::alias", "aten::to", "aten::_to_copy",
          "aten::lift_fresh", "aten::index_put_", "aten::_index_put_impl_", "aten::ones", "aten::full",
          "aten::arange", "aten::masked_fill", "aten::where", "aten::gather", "aten::item",
          "aten::_local_scalar_dense", "aten::embedding")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    threads = int(os.environ.get("THREADS", "2"))
    torch.set_num_threads(threads)
    path = str(builtin_model_path("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)  # frozen, as a scoring-only LLM is on its server (cpu_matmul applies to it)
    cfg = model.config
    work = make_workload(tok, 16, 200, 6)

    params = sum(p.numel() for p in model.parameters())  # what run.py counts (tied embedding counted once)
    emb = model.get_input_embeddings().weight.numel()
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    layer_matmul = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    print(f"params total {params/1e6:.2f}M; embedding (tied with LM head) {emb/1e6:.2f}M; "
          f"decoder layers {layer_params/1e6:.2f}M (of which 2-D matmul weights {layer_matmul/1e6:.2f}M)")

    rate = measure_matmul_rate(threads)
    rate2 = measure_matmul_rate(threads)
    rate = max(rate, rate2)
    tokens = unique_tokens(tok, work)
    per_token = 2 * params / rate
    limit = tokens * per_token
    print(f"matmul rate {rate/1e9:.1f} GFLOP/s; unique tokens {tokens}; compute limit {limit:.3f} s")

    fn = lambda: inprocess_scores(model, tok, work, 8192, 64)  # noqa: E731
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t_in = statistics.median(times)
    print(f"in-process: median {t_in:.3f} s of {[f'{t:.3f}' for t in times]}  ->  {t_in/limit:.2f} x limit")

    # ---------------------------------------------------------------- per model call timings
    total, calls = forward_calls(model, fn, int(os.environ.get("CALL_RUNS", "3")))
    per_tok_flops = 2 * layer_matmul  # decoder-layer linear layers only
    lm_head = 2 * emb  # per kept logit position
    groups = collections.defaultdict(lambda: dict(n=0, t=0.0, padded=0, real=0, kept=0, attn=0.0))
    for c in calls:
        g = groups[kind(c)]
        b, w = c["shape"]
        g["n"] += 1
        g["t"] += c["t"]
        g["padded"] += b * w
        g["real"] += c["real"]
        g["kept"] += c["kept"]
        # attention score+value matmuls: 4 * heads*head_dim * (keys attended) per query token per layer (full, no
        # causal skip)
        g["attn"] += 4 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * b * w \
            * (c["past"] + w) * cfg.num_hidden_layers
    print(f"\nforward calls of one run ({total:.3f} s outer, {sum(c['t'] for c in calls):.3f} s inside "
          f"model.forward):")
    for c in calls:
        print(f"   {kind(c):32s} ids {c['shape']} past {c['past']:4d} real tokens {c['real']:5d} logits kept "
              f"{c['kept']:4d}  {c['t']*1e3:8.1f} ms")
    print(f"\n{'call type':32s} {'n':>3s} {'time s':>7s} {'share':>6s} {'padded':>7s} {'real':>6s} {'kept':>5s} "
          f"{'GFLOP/s(lin,real)':>17s} {'GFLOP/s(lin,padded)':>19s} {'GFLOP/s(all work)':>17s} {'vs matmul':>9s}")
    for k, g in groups.items():
        lin_real = per_tok_flops * g["real"] / g["t"] / 1e9
        lin_pad = per_tok_flops * g["padded"] / g["t"] / 1e9
        allw = (per_tok_flops * g["padded"] + lm_head * g["kept"] + g["attn"]) / g["t"] / 1e9
        print(f"{k:32s} {g['n']:3d} {g['t']:7.3f} {g['t']/total:6.1%} {g['padded']:7d} {g['real']:6d} "
              f"{g['kept']:5d} {lin_real:17.1f} {lin_pad:19.1f} {allw:17.1f} {allw/(rate/1e9):9.2f}")
    print(f"outside model.forward (planning, tokenising, padding, log-softmax, glue): "
          f"{total - sum(c['t'] for c in calls):.3f} s ({(total - sum(c['t'] for c in calls))/total:.1%})")

    # ---------------------------------------------------------------- FLOP account
    padded = sum(g["padded"] for g in groups.values())
    real = sum(g["real"] for g in groups.values())
    kept = sum(g["kept"] for g in groups.values())
    attn = sum(g["attn"] for g in groups.values())
    limit_flops = tokens * 2 * params
    need_lin = real * per_tok_flops
    pad_lin = (padded - real) * per_tok_flops
    print("\nFLOP account (GFLOP):")
    print(f"   limit counts: {tokens} unique tokens x 2 x {params/1e6:.1f}M = {limit_flops/1e9:.2f}")
    print(f"   of which embedding/LM-head share (2 x {emb/1e6:.1f}M per token): {tokens*2*emb/1e9:.2f}")
    print(f"   really needed linear (decoder layers, real tokens {real}): {need_lin/1e9:.2f}")
    print(f"   padding tokens computed ({padded - real}): {pad_lin/1e9:.2f}")
    print(f"   LM head at {kept} kept positions: {kept*lm_head/1e9:.2f}")
    print(f"   attention QK^T + AV (as computed, incl. padding, no causal skipping): {attn/1e9:.2f}")
    print(f"   really computed total: {(need_lin + pad_lin + kept*lm_head + attn)/1e9:.2f}  "
          f"(= {(need_lin + pad_lin + kept*lm_head + attn)/limit_flops:.2f} x limit FLOPs)")
    print(f"   at the matmul rate that would take {(need_lin + pad_lin + kept*lm_head + attn)/rate:.3f} s "
          f"vs limit {limit:.3f} s vs measured {t_in:.3f} s")
    print(f"   unique tokens {tokens} vs real tokens fed {real} (candidate rows feed rest[:-1], the rest are "
          f"scored from logits)")

    # ---------------------------------------------------------------- profiler
    print_profile(fn, cfg.vocab_size)


def forward_calls(model, fn, runs: int) -> tuple[float, list[dict]]:
    """Run ``fn`` ``runs`` times with ``model.forward`` wrapped in a timer; the median run's time and its calls."""
    calls = []
    orig_forward = model.forward

    @functools.wraps(orig_forward)
    def timed_forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        pkv = layer_cache(kwargs)
        past = 0 if pkv is None else pkv.get_seq_length()
        mask = kwargs.get("attention_mask")
        two_d = mask is not None and mask.dim() == 2
        real = int(mask[:, -ids.shape[1]:].sum()) if two_d else ids.numel()  # 4-D: packed
        keep = kwargs.get("logits_to_keep")
        kept = int(keep.sum()) if isinstance(keep, torch.Tensor) else (keep * ids.shape[0] if keep else ids.numel())
        t0 = time.perf_counter()
        out = orig_forward(*args, **kwargs)
        calls.append(dict(shape=tuple(ids.shape), past=past, real=real, kept=kept, t=time.perf_counter() - t0,
                          packed=mask is not None and mask.dim() == 4))
        return out

    model.forward = timed_forward
    outer = []
    for _ in range(runs):
        calls.clear()
        t0 = time.perf_counter()
        fn()
        outer.append((time.perf_counter() - t0, list(calls)))
    model.forward = orig_forward
    return sorted(outer, key=lambda x: x[0])[len(outer) // 2]  # the median run


def kind(c: dict) -> str:
    if c["packed"]:
        return "packed pass (own prefixes and candidates)"
    if c["past"] == 0:
        return "common/own prefix pass"
    return "candidate pass" if c["shape"][1] <= 16 else "own-prefix pass (after common)"


def print_profile(fn, vocab_size: int) -> None:
    """One run of ``fn`` under torch.profiler: its tables, and its self CPU time in buckets."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        prof_wall = time.perf_counter() - t0
    ka = prof.key_averages()
    print(f"\nprofiled run wall {prof_wall:.3f} s")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30))
    kas = prof.key_averages(group_by_input_shape=True)
    print(kas.table(sort_by="self_cpu_time_total", row_limit=25))

    # Self times of all ops (CPU time of the calling thread; intra-op threads run within the op's span)
    buckets = collections.Counter()
    for e in kas:
        buckets[bucket(e.key, e.input_shapes, vocab_size)] += e.self_cpu_time_total / 1e6
    op_total = sum(buckets.values())
    print(f"\nbucketed self CPU time (s) of the profiled run (wall {prof_wall:.3f} s):")
    for k, v in buckets.most_common():
        print(f"   {k:55s} {v:7.3f}  {v/prof_wall:6.1%} of wall")
    print(f"   {'Python / framework overhead (wall - sum of op self times)':55s} {prof_wall-op_total:7.3f}  "
          f"{(prof_wall-op_total)/prof_wall:6.1%} of wall")


def bucket(name: str, shapes, vocab_size: int) -> str:
    n = name
    if n in ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear") or "mkldnn" in n:
        if shapes and any(list(s)[:1] == [vocab_size] for s in shapes if s):
            return "LM head (linear 576->49152)"
        return "linear layers (matmul)"
    if "scaled_dot_product" in n or "flash_attention" in n or n in ("aten::_softmax", "aten::softmax"):
        return "attention (SDPA)"
    if n in COPIES:
        return "copies/cat/index/alloc/mask (incl. KV cache)"
    if n in ("aten::logsumexp", "aten::exp", "aten::max", "aten::amax", "aten::log", "aten::sum", "aten::sub",
             "aten::log_softmax", "aten::_log_softmax"):
        return "logsumexp / reductions"
    if n.startswith("aten::"):
        return "elementwise (RMSNorm, SiLU, rotary, mul/add/pow/rsqrt)"
    return "other"


if __name__ == "__main__":
    main()
