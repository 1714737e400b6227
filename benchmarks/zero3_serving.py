"""Serving under ZeRO-3: ``score`` and ``generate`` with the weights gathered once per call, against ZeRO-3 gathering
layer by layer at every forward (``training.zero3_gather_mb: 0``, DeepSpeed's own path) and against ZeRO-2, in one
run.

    .venv/bin/python -m benchmarks.zero3_serving                  # SmolLM2-135M-Instruct with LoRA, 1 rank each
    .venv/bin/python -m benchmarks.zero3_serving --model tiny     # the tiny random model (a smoke run)
    python -m benchmarks.zero3_serving --shape smollm2-1.7b --devices 0 --dtype bfloat16 --tokenizer TOKENIZER_DIR
                                                                  # a random model of that shape on a GPU

Three LLMs of one run load the same weights with the same LoRA adapter: ``zero2``, ``zero3`` (gathered once per
call, the default) and ``zero3-per-layer``. Each repetition times, on each LLM in turn, ``score`` of 24 contexts
x 4 candidates (the shape of the GPU measurement in issue 33) and ``generate`` of 8 prompts x 4 samples x 16 tokens
(the RLHF demo's); it prints the medians, each ZeRO-3 row's ratio to ZeRO-2, and the largest difference of the
three LLMs' scores and generated log-probs (greedy: the same tokens). It writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks.kit import ROOT, load_module, profiling_timeouts, testkit

NAMES = ["zero2", "zero3", "zero3-per-layer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model, or 'tiny'")
    parser.add_argument("--shape", default=None, help="a random model of this shape (benchmarks.memory.SHAPES)")
    parser.add_argument("--devices", default="cpu", help="cpu, or the GPU id every LLM uses")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder, for --shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds first (on a GPU the first generate compiles the decode step)")
    parser.add_argument("--names", default=",".join(NAMES), help="the LLMs to time, of " + ", ".join(NAMES))
    parser.add_argument("--profile", default=None, help="a folder: each server profiles its second score and generate "
                        "(the first timed round; LLMRL_PROFILE)")
    args = parser.parse_args()
    if args.profile:
        os.environ["LLMRL_PROFILE"] = args.profile
    kit = testkit()
    with tempfile.TemporaryDirectory(prefix="llmrl-zero3-") as work:
        if args.shape:
            from benchmarks.grpo_step import random_model

            args.model = random_model(work, args.shape, args.devices, args.dtype)
            args.tokenizer = args.tokenizer or kit.tiny_model("llama")  # the tests' tiny Llama's tokenizer
        run_benchmark(args, kit)


def run_benchmark(args, kit) -> None:
    model = kit.tiny_model("llama") if args.model == "tiny" else args.model
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 8, "last_layers": 8 if args.model != "tiny"
                                                                else 1}}}}
    def llm(stage: int, gather_mb: int | None = None) -> dict:
        training = {"zero_stage": stage, "optimizer": {"type": "adam", "lr": 1e-4}}
        if gather_mb is not None:
            training["zero3_gather_mb"] = gather_mb
        where = {"dtype": args.dtype, "devices": "cpu" if args.devices == "cpu" else [int(args.devices)]}
        if args.tokenizer:
            where["tokenizer"] = args.tokenizer
        return {"model": model, "initializers": [lora], "trainable": True, "training": training, **where}

    names = args.names.split(",")
    llms = {name: spec for name, spec in {"zero2": llm(2), "zero3": llm(3), "zero3-per-layer": llm(3, 0)}.items()
            if name in names}
    demo = load_module("rlhf_sentiment", ROOT / "examples" / "rlhf_sentiment.py")
    train, held_out = demo.build_prompts()
    contexts = train[:24]
    candidates = [[" was great", " was terrible", " happened", " is over"]] * len(contexts)
    prompts = held_out[:8]
    times = {(name, call): [] for name in names for call in ("score", "generate")}
    results = {}
    with kit.LiveRun({"llms": llms, "threads_per_rank": 2, **profiling_timeouts(args.profile)}) as run:
        for repeat in range(args.warmup + args.repeats):
            for name in names:
                start = time.perf_counter()
                scores = run.score(contexts, candidates, llm=name)
                score_seconds = time.perf_counter() - start
                start = time.perf_counter()
                samples = run.generate(prompts, llm=name, max_new_tokens=16, do_sample=False)
                generate_seconds = time.perf_counter() - start
                if repeat >= args.warmup:
                    times[(name, "score")].append(score_seconds)
                    times[(name, "generate")].append(generate_seconds)
                print(f"  round {repeat}{' (untimed)' if repeat < args.warmup else ''}: {name} score "
                      f"{score_seconds:.3f} s, generate {generate_seconds:.3f} s", flush=True)
                results[name] = (scores, samples)
        memory, servers = run.server_memory(), run.servers()
        gathered = {name: sum(m.get("zero3_gathered_calls", 0) for r, m in memory.items()
                              if servers[r]["llm"] == name) for name in names}
        shown = ("calls", "llama_step_batches", "weights_packed", "compiled_shapes", "weight_moves", "kept_weights_mb")
        loops = {name: [{key: m.get("decoding", {}).get(key) for key in shown}
                        for r, m in memory.items() if servers[r]["llm"] == name] for name in names}
    base_scores, base_samples = results["zero2"]
    print(f"{args.shape or args.model}, {args.dtype} on {args.devices}, 1 rank per LLM, median of {args.repeats} "
          f"after {args.warmup} untimed:")
    for call in ("score", "generate"):
        base = statistics.median(times[("zero2", call)])
        for name in names:
            t = statistics.median(times[(name, call)])
            print(f"  {call:8s} {name:16s} {t:7.3f} s   {t / base:6.2f}x ZeRO-2's")
    for name in names[1:]:
        scores, samples = results[name]
        score_diff = max(float((a - b).abs().max()) for a, b in zip(scores, base_scores))
        same_tokens = all(a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(samples, base_samples))
        logprob_diff = max(float((a[0]["logprobs"] - b[0]["logprobs"]).abs().max()) for a, b in zip(samples,
                                                                                                 base_samples))
        print(f"  {name}: scores within {score_diff:.1e} of ZeRO-2's, greedy tokens "
              f"{'equal' if same_tokens else 'DIFFERENT'}, log-probs within {logprob_diff:.1e}; "
              f"{gathered[name]} calls gathered the weights")
    for name in names:
        print(f"  {name}: decoding per rank {loops[name]}")


if __name__ == "__main__":
    main()
