"""Benchmark llmrl against plain Hugging Face on RL-shaped workloads; print ratios, write JSON.

From the repository root (the servers it starts import :mod:`benchmarks.hooks` from there)::

    python -m benchmarks.run                      # SmolLM2-135M, the headline figures (about 40 minutes on 2 cores)
    python -m benchmarks.run --model tiny --quick  # a tiny random Llama: a smoke test in under a minute
    python -m benchmarks.run --workload my.json   # your own workload: [{"context": ..., "candidates": [...]}, ...]
    python -m benchmarks.run --episodes-only      # the cache across calls: on vs off vs naive (about 20 minutes)
    python -m benchmarks.run --update-only        # the demo's update: every layer vs trunk reuse and twins (about 12)
    python -m benchmarks.run decoding --help      # the other suites, each from this entry: decoding, grpo-step,
                                                  # zero3, trunk-update (CPU, or --device cuda where they take it)

In one run on one machine it measures, each as a ratio to its baseline:
  - ``score`` through llmrl (one server) vs the plain Hugging Face code a user would write (concatenate
    context and candidate, pad, batched forward, gather log-probs), on 16 contexts of ~200 tokens with 6
    candidates of 2-5 tokens, and with 64 candidates (the naive baseline may run a subset of the contexts
    and be scaled; the table says so);
  - ``score`` through llmrl vs the same computation done in this process by llmrl's own model code
    (the engine's overhead: dispatch, serialisation, process hops);
  - ``score(..., per_token=True)`` (each candidate's tokens and per-token log-probs) vs the summed ``score`` on
    the same workloads, measured in turn with it (the cost of per-token outputs);
  - ``generate`` through llmrl vs plain batched Hugging Face ``generate`` with the same settings;
  - the round trip of a minimal request;
  - whole episodes (16 environments x 12 steps, history prompts that grow by ~30 tokens a step after a ~60-token
    header, 6 candidates): ``score`` with the key/value cache across calls (``kv_cache_mb``) vs without it vs
    naive Hugging Face, each repeat on fresh episodes (the cache starts cold);
  - the demo's PPO update of 256 transitions after their rollout (LoRA on the top 8 of 30 layers), with the compute
    limit of the top layers' work: on transitions that never repeat, every layer recomputed vs frozen-trunk reuse
    (``trunk_reuse_mb``); on the demo's own BabyAI rollout, whose states repeat, every layer recomputed for every
    transition vs twins computed once vs frozen-trunk reuse with twins computed once;
  - the weights' memory and the peak memory of a server loading the model in float32, bfloat16 and 4-bit.
It also prints the compute limit: the time the unique tokens (each context once, each candidate's tokens
once) take at this machine's measured matrix-multiply rate at 2 FLOPs per parameter per token, so that each time
reads as a multiple of it; for the score rows, also the limit of the necessary work (``necessary_flops``: no
vocabulary projection where no score is read, attention counted), which is tighter. The
rate is measured again before each row and at the end, and every limit is stated at the best rate of the run (a
slow moment never flatters a row).
The server and this process never compute at the same time, and use the same number of threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.baselines import (
    inprocess_scores,
    interleaved,
    max_error,
    naive_estimate,
    naive_scores,
    plain_generate,
    timed,
)
from benchmarks.kit import claim_results_file, testkit
from benchmarks.limits import BestRate, necessary_flops, rebase_limits, unique_tokens
from benchmarks.workloads import babyai_rollout, make_episodes, make_workload
from llmrl.engine.server.host_memory import keep_freed_memory


def episodes_row(path: str, model, tokenizer, per_token: float, quick: bool, repeats: int, naive_budget: float,
                 host_malloc: str, skip_naive: bool) -> dict:
    """Cache across calls on vs off vs naive Hugging Face on whole episodes (each repeat a fresh set of episodes, so
    the cache starts cold every time); scores compared on one set; the compute limit of the unique work."""
    envs, steps = (4, 4) if quick else (16, 12)
    shape = dict(envs=envs, steps=steps, header_tokens=60, step_tokens=30, candidates=6)
    threads = torch.get_num_threads()
    llms = {"cache-on": {"model": path, "kv_cache_mb": 2048}, "cache-off": {"model": path}}
    seeds = iter(range(1000, 2000))
    sample = make_episodes(tokenizer, seed=0, **shape)

    def play(run, llm, calls=None):
        calls = calls or make_episodes(tokenizer, seed=next(seeds), **shape)
        return [run.score(contexts, options, llm=llm) for contexts, options in calls]

    # the two servers never compute at once
    with testkit().LiveRun({"llms": llms, "threads_per_rank": threads, "host_malloc": host_malloc}) as run:
        on = play(run, "cache-on", sample)
        off = play(run, "cache-off", sample)
        (on_time, _), (off_time, _) = interleaved(lambda: play(run, "cache-on"), lambda: play(run, "cache-off"),
                                                  repeats=repeats)
        servers, memory = run.servers(), run.server_memory()
    cache = next(memory[r]["kv_cache"] for r, s in servers.items() if s["llm"] == "cache-on")
    header = len(tokenizer(sample[0][0][0])["input_ids"]) - 30  # about: the first context less its first step
    unique = header
    for e in range(envs):
        final = sample[-1][0][e]
        unique += len(tokenizer(final)["input_ids"]) - header
    unique += sum(unique_tokens(tokenizer, [{"context": c, "candidates": o}]) - len(tokenizer(c)["input_ids"])
                  for contexts, options in sample for c, o in zip(contexts, options))
    limit = unique * per_token
    row = {"workload": f"episodes: {envs} envs x {steps} steps, history prompts, 6 candidates",
           "score calls": steps, "unique tokens": unique, "compute limit s": limit,
           "cache on s": on_time, "cache off s": off_time, "cache off / cache on": off_time / on_time,
           "cache on / limit": on_time / limit, "cache off / limit": off_time / limit,
           "max |cache on - cache off|": max(max_error(a, b) for a, b in zip(on, off)),
           "cache hit rate": cache["hit_rate"], "cache MB (cap 2048)": cache["bytes"] / 2**20}
    if not skip_naive:
        flat = [{"context": c, "candidates": o} for contexts, options in sample for c, o in zip(contexts, options)]
        est = naive_estimate(model, tokenizer, flat)
        subset = envs if est <= naive_budget else max(1, int(envs * naive_budget / est))
        naive_time, naive = timed(lambda: [naive_scores(model, tokenizer, [{"context": c, "candidates": o}
                                                                          for c, o in zip(cs[:subset], os_[:subset])])
                                           for cs, os_ in sample])
        naive_scaled = naive_time * envs / subset
        row.update({"naive HF s": naive_scaled, "naive subset (envs)": f"{subset}/{envs}",
                    "naive HF / cache on": naive_scaled / on_time,
                    "max |cache on - naive|": max(max_error(a[:subset], b) for a, b in zip(on, naive))})
    return row


def update_row(path: str, model, tokenizer, rate: float, quick: bool, repeats: int, rollout: str,
               host_malloc: str) -> dict:
    """The demo's PPO update (256 transitions of ~44-token prompts and 3 actions, LoRA on the top 8 layers, a value
    head, one epoch in minibatches of 32) after the rollout scored those transitions, as in
    ``examples/ppo_babyai.py``, each repeat on a fresh rollout; the stats of the paths compared.

    ``rollout="synthetic"``: text-game observations that never repeat; every layer recomputed vs frozen-trunk reuse
    (``trunk_reuse_mb``). ``rollout="babyai"``: the demo's own rollout (:func:`babyai_rollout`), whose states repeat;
    every layer recomputed for every transition (the engine before this issue; a benchmark hook,
    :class:`benchmarks.hooks.EveryTwinComputed`, turns twins off) vs twins computed once vs frozen-trunk reuse with
    twins computed once (the engine's default)."""
    transitions, length, top = (32, 44, 1) if quick else (256, 44, 8)  # the demo's prompts: ~44 tokens, 3 actions
    threads = torch.get_num_threads()
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 8, "alpha": 16, "last_layers": top}}}}
    llm = {"model": path, "minibatch_size": 64, "token_budget": 4096, "initializers": [lora],
           "heads": {"value": {"plugin": "value", "args": {"hidden": 128}}},
           "updater": {"plugin": "ppo", "args": {"epochs": 1, "clip_eps": 0.2, "value_clip": None, "value_coef": 0.5,
                                                 "entropy_coef": 0.01}},
           "training": {"zero_stage": 0, "optimizer": {"type": "adam", "lr": 1e-3}, "micro_batch_size": 32,
                        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}}
    trunk_llm = {**llm, "trunk_reuse_mb": 4096}
    if rollout == "babyai":
        every_twin = {**llm, "initializers": [lora, "benchmarks.hooks:EveryTwinComputed"]}
        llms = {"every-layer-every-twin": every_twin, "twins-once": llm, "trunk-and-twins-once": trunk_llm}
    else:
        llms = {"every-layer": llm, "trunk-reuse": trunk_llm}
    baseline, ours = list(llms)[0], list(llms)[-1]
    times: dict[str, list[float]] = {name: [] for name in llms}
    stats: dict[str, list] = {}
    tokens = distinct = 0
    # the servers never compute at once
    with testkit().LiveRun({"llms": llms, "threads_per_rank": threads, "host_malloc": host_malloc}) as run:
        for round_ in range(repeats):
            if rollout == "babyai":
                contexts, candidates = babyai_rollout(transitions, seed=100 + 1000 * round_)
                work = [{"context": c, "candidates": k} for c, k in zip(contexts, candidates)]
            else:
                work = make_workload(tokenizer, transitions, length, 3, seed=100 + round_)
                contexts, candidates = [w["context"] for w in work], [w["candidates"] for w in work]
            tokens = unique_tokens(tokenizer, list({w["context"]: w for w in work}.values()))
            distinct = len(set(contexts))
            order = list(llms) if round_ % 2 == 0 else list(reversed(llms))
            batches = {}
            for name in order:  # the rollout: scored by 16 environments at a time, with the value head
                scores, values = [], []
                for i in range(0, transitions, 16):
                    out = run.score(contexts[i:i + 16], candidates[i:i + 16], llm=name,
                                    additional_module_function_keys=["value"])
                    scores += [o["score"] for o in out]
                    values += [float(o["value"]) for o in out]
                gen = torch.Generator().manual_seed(round_)
                actions = [int(torch.randint(len(s), (1,), generator=gen)) for s in scores]
                advantages = torch.randn(transitions, generator=gen).tolist()
                batches[name] = {"actions": actions,
                                 "old_logprobs": [float(torch.log_softmax(s, -1)[a]) for s, a in zip(scores, actions)],
                                 "advantages": advantages,
                                 "returns": [v + a for v, a in zip(values, advantages)]}
            for name in order:
                start = time.perf_counter()
                result = run.update(contexts, candidates, llm=name, **batches[name])
                times[name].append(time.perf_counter() - start)
                stats.setdefault(name, []).append(result[0])
        trunk = next(run.server_memory()[r]["trunk"] for r, s in run.servers().items() if s["llm"] == ours)
    layers = model.config.num_hidden_layers
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n) / layers
    # Forward + backward (counted as twice the forward) of the top layers over the distinct transitions' tokens.
    top_limit = tokens * 2 * layer_params * top * 3 / rate
    median = {name: statistics.median(t) for name, t in times.items()}
    diffs = [abs(a[k] - b[k]) for a, b in zip(stats[baseline], stats[ours])
             for k in ("policy_loss", "value_loss", "entropy")]
    row = {"workload": f"update ({rollout} rollout): {transitions} transitions ({distinct} distinct prompts), PPO, "
                       f"LoRA top {top} of {layers} layers",
           "transitions": transitions, "distinct prompts": distinct, "unique tokens (distinct prompts)": tokens}
    row.update({f"{name} s": t for name, t in median.items()})
    row.update({f"{baseline} / {name}": median[baseline] / median[name] for name in llms if name != baseline})
    row.update({"compute limit s (top layers fwd+bwd, distinct prompts)": top_limit,
                f"{ours} / limit": median[ours] / top_limit,
                f"max |stats {baseline} - {ours}| (first update, equal weights)": max(diffs[:3]),
                "replayed calls": trunk["replayed_calls"], "whole calls": trunk["whole_calls"],
                "trunk MB": trunk["bytes"] / 2**20})
    return row


def model_path(name: str) -> str:
    if name == "tiny":
        return testkit().tiny_model("llama")
    if name == "smollm2":
        from llmrl.engine.model.store.builtin_models import builtin_model_path

        return str(builtin_model_path("smollm2-135m-instruct"))
    return name


SUITES = {  # python -m benchmarks.run SUITE [its arguments]: the other benchmarks, from this one entry
    "decoding": "benchmarks.decoding",  # generation: llmrl's loop vs plain HF, HF static + compile, the limit
    "attention-window": "benchmarks.attention_window",  # static-cache steps over windows vs over the whole cache
    "grpo-step": "benchmarks.grpo_step",  # one GRPO step: llmrl now / before vs a plain HF + PEFT loop vs TRL
    "zero3": "benchmarks.zero3_serving",  # score and generate under ZeRO-3 (gathered once) vs ZeRO-2
    "trunk-update": "benchmarks.trunk_update",  # a token-level update: every layer vs the frozen trunk once
}


def run_suite(argv: list[str]) -> int:
    """``python -m benchmarks.run SUITE ...``: the suite's own ``main`` with the remaining arguments."""
    import importlib

    module = importlib.import_module(SUITES[argv[0]])
    sys.argv = [f"benchmarks.run {argv[0]}", *argv[1:]]
    return int(module.main() or 0)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in SUITES:
        return run_suite(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="other suites: python -m benchmarks.run {" + ",".join(SUITES) + "} "
                                            "[--help]")
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a local model folder")
    parser.add_argument("--workload",
                        help="a JSON list of {context, candidates} to measure instead of the built-in ones")
    parser.add_argument("--quick", action="store_true", help="small workloads, one repeat (a smoke test)")
    parser.add_argument("--naive-budget", type=float, default=150.0,
                        help="seconds the naive baseline may take per workload; beyond that it runs a subset and "
                             "scales")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median reported)")
    parser.add_argument("--skip-memory", action="store_true", help="skip the float32/bfloat16/4-bit loading runs")
    parser.add_argument("--score-only", action="store_true",
                        help="only the score rows (llmrl, per-token, in-process): no naive baseline, generate, round "
                             "trip or memory")
    parser.add_argument("--episodes-only", action="store_true",
                        help="only the episodes workload (the cache across calls on vs off vs naive)")
    parser.add_argument("--update-only", action="store_true",
                        help="only the demo's update step (every layer vs frozen-trunk reuse and twins computed once)")
    parser.add_argument("--host-malloc", choices=("reuse", "default"), default="reuse",
                        help="the servers' host_malloc setting; this process (in-process and naive rows) gets the same")
    parser.add_argument("--out", default="benchmark-results.json")
    args = parser.parse_args()
    mark = claim_results_file(args.out, "run")
    print(keep_freed_memory(args.host_malloc), file=sys.stderr)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads)
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)  # frozen, as a scoring-only LLM is on its server (cpu_matmul applies to it)
    params = sum(p.numel() for p in model.parameters())
    rates = BestRate(threads, size=512 if args.quick else 1536)
    rate = rates()
    per_token = 2 * params / rate
    repeats = 1 if args.quick else args.repeats
    if args.workload:
        with open(args.workload) as f:
            workloads = {os.path.basename(args.workload): json.load(f)}
    else:
        n, length = (4, 60) if args.quick else (16, 200)
        workloads = {"6 candidates": make_workload(tokenizer, n, length, 6),
                     "64 candidates": make_workload(tokenizer, n, length, 8 if args.quick else 64, seed=1)}
    rows: list[dict] = []
    config = {"llms": {"main": {"model": path, "token_budget": args.token_budget}}, "host_malloc": args.host_malloc}
    print(f"model {args.model}: {params / 1e6:.1f}M parameters; matmul {rate / 1e9:.1f} GFLOP/s on {threads} threads; "
          f"compute limit {per_token * 1e3:.2f} ms per token", file=sys.stderr)
    if args.episodes_only or args.update_only:
        workloads = {}
    with (testkit().LiveRun(config) if workloads else contextlib.nullcontext()) as run:
        for name, work in workloads.items():
            contexts = [w["context"] for w in work]
            candidates = [w["candidates"] for w in work]
            tokens = unique_tokens(tokenizer, work)
            rate = rates()
            per_token = 2 * params / rate
            limit = tokens * per_token
            necessary = necessary_flops(model, tokenizer, work) / rate
            served_fn = lambda c=contexts, k=candidates: run.score(c, k)  # noqa: E731
            per_token_fn = lambda c=contexts, k=candidates: run.score(c, k, per_token=True)  # noqa: E731
            inproc_fn = lambda w=work: inprocess_scores(model, tokenizer, w, args.token_budget, 64)  # noqa: E731
            (served_time, served), (per_token_time, tokenwise), (inproc_time, inproc) = interleaved(
                served_fn, per_token_fn, inproc_fn, repeats=repeats)
            sums = [torch.tensor([float(lp.sum()) for lp in p["logprobs"]]) for p in tokenwise]
            row = {"workload": name, "contexts": len(work), "candidate rows": sum(len(w["candidates"]) for w in work),
                   "unique tokens": tokens, "matmul GFLOP/s (best so far)": rate / 1e9, "compute limit s": limit,
                   "llmrl score s": served_time, "llmrl score per_token s": per_token_time,
                   "per-token / summed": per_token_time / served_time, "in-process s": inproc_time,
                   "engine efficiency (in-process / llmrl)": inproc_time / served_time,
                   "llmrl / limit": served_time / limit,
                   "compute limit s (necessary work)": necessary, "llmrl / necessary limit": served_time / necessary,
                   "in-process / necessary limit": inproc_time / necessary,
                   "max |llmrl - in-process|": max_error(served, inproc),
                   "max |per-token sums - llmrl|": max_error(sums, served)}
            if not args.score_only:
                est = naive_estimate(model, tokenizer, work)
                subset = len(work) if est <= args.naive_budget else max(1, int(len(work) * args.naive_budget / est))
                naive_time, naive = timed(lambda w=work[:subset]: naive_scores(model, tokenizer, w))
                naive_scaled = naive_time * len(work) / subset
                row.update({"naive HF s": naive_scaled, "naive subset": f"{subset}/{len(work)}",
                            "speedup vs naive": naive_scaled / served_time,
                            "max |llmrl - naive|": max_error(served[:subset], naive)})
            rows.append(row)
            print_row(rows[-1])
        if workloads and not args.score_only:
            rows += generate_rows(run, model, tokenizer, [w["context"] for w in next(iter(workloads.values()))],
                                  args.quick, repeats)
    if not args.score_only and not args.update_only:
        rate = rates()
        rows.append(episodes_row(path, model, tokenizer, 2 * params / rate, args.quick, repeats, args.naive_budget,
                                 args.host_malloc, skip_naive=False))
        rows[-1]["matmul GFLOP/s (best so far)"] = rate / 1e9
        print_row(rows[-1])
    if not args.score_only and not args.episodes_only:
        for rollout in ("synthetic", "babyai"):
            rate = rates()
            rows.append(update_row(path, model, tokenizer, rate, args.quick, repeats, rollout, args.host_malloc))
            rows[-1]["matmul GFLOP/s (best so far)"] = rate / 1e9
            print_row(rows[-1])
    if not args.skip_memory and not args.score_only and not args.episodes_only and not args.update_only:
        rows.append(memory_row(path, args.quick, args.host_malloc))
        print_row(rows[-1])
    best = rates()
    rebase_limits(rows, best)
    with open(args.out, "w") as f:
        json.dump({**mark, "model": args.model, "parameters": params, "threads": threads, "matmul GFLOP/s": best / 1e9,
                   "matmul GFLOP/s measured": [r / 1e9 for r in rates.seen],
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def generate_rows(run, model, tokenizer, gen_contexts: list[str], quick: bool, repeats: int) -> list[dict]:
    """Greedy generate through llmrl vs plain batched Hugging Face generate, and the minimal request round trip."""
    rows = []
    new_tokens = 8 if quick else 16
    (gen_time, generated), (plain_time, plain) = interleaved(
        lambda: run.generate(gen_contexts, max_new_tokens=new_tokens, do_sample=False),
        lambda: plain_generate(model, tokenizer, gen_contexts, new_tokens), repeats=repeats)
    same = sum(g[0]["tokens"].tolist() == p for g, p in zip(generated, plain))
    rows.append({"workload": f"generate {len(gen_contexts)} x {new_tokens} tokens (greedy)",
                 "llmrl generate s": gen_time, "plain HF generate s": plain_time,
                 "generate speed ratio (plain / llmrl)": plain_time / gen_time,
                 "identical outputs": f"{same}/{len(gen_contexts)}"})
    print_row(rows[-1])
    run.ping()
    trips = sorted(run.ping() for _ in range(200))
    rows.append({"workload": "minimal request round trip", "median ms": 1e3 * trips[100], "p95 ms": 1e3 * trips[190]})
    print_row(rows[-1])
    return rows


def memory_row(path: str, quick: bool, host_malloc: str) -> dict:
    """Weights' memory and peak resident memory of one server per loading mode."""
    llms = {"float32": {"model": path}, "bfloat16": {"model": path, "dtype": "bfloat16"},
            "int4": {"model": path, "quantization": {"bits": 4, "quant_type": "nf4"}}}
    with testkit().LiveRun({"llms": llms, "threads_per_rank": 1, "host_malloc": host_malloc}) as run:
        memory = run.server_memory()
        servers = run.servers()
    by_llm = {servers[r]["llm"]: m for r, m in memory.items()}
    fp32 = by_llm["float32"]["parameter_bytes"]
    row = {"workload": "memory per server (MB)"}
    for name, m in by_llm.items():
        row[f"{name} weights"] = m["parameter_bytes"] / 2**20
        row[f"{name} peak RSS"] = m["peak_rss"] / 2**20
        row[f"{name} weights / float32"] = m["parameter_bytes"] / fp32
    return row


def print_row(row: dict) -> None:
    print(f"\n== {row['workload']}")
    for key, value in row.items():
        if key == "workload":
            continue
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"   {key:<42} {text}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
