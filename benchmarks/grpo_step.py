"""One GRPO step (sample a group of continuations per prompt, then update the LoRA adapter), side by side in one run.

    .venv/bin/python -m benchmarks.grpo_step                              # CPU: a small random Llama (minutes)
    python -m benchmarks.grpo_step --shape smollm2-1.7b --devices 0 --dtype bfloat16 --new-tokens 128,512

Paths, each on the same random-weight model (a real architecture: speed does not depend on the weights), LoRA r=16 on
every linear layer, the same prompts (English text of ``--prompt-tokens`` tokens: llmrl and the plain loop get the
token ids, TRL the text, and the JSON records how many tokens TRL made of it), ``min_new_tokens`` =
``max_new_tokens`` (fixed lengths), seeded rewards, no KL term (TRL's default ``beta`` is 0):
  - **llmrl now**: a live run (one server); ``generate`` runs llmrl's decoding loop (with ``--generation``'s
    settings), and the update receives the sampled log-probs as ``old_logprobs`` (no old-policy pass; ``--training``
    adds training settings, e.g. a larger ``max_tokens_per_micro_batch``);
  - **llmrl before**: the same run with ``generation.decoder: hf`` (Hugging Face's generate with the adapter
    unmerged) and the update computing its own old-policy pass, as llmrl ran before its loop;
  - **plain HF + PEFT**: the loop a trainer library's user writes (``model.generate`` on the PEFT model, a
    sequence-level GRPO loss over micro-batches of 8, AdamW; Hugging Face's checkpointing on CUDA), in a child
    process;
  - **TRL's GRPOTrainer**, where it is installed (``pip install -e .[bench]``), in a child process, timed by a
    callback from the start to the end of each optimizer step.
The first step of each path warms up (on CUDA llmrl's first call compiles its decode step); the median of the later
steps is reported (for llmrl's paths also of its ``generate`` and of the rest, the update), with the ratio of each
path to TRL (or, without TRL, to the plain loop). It prints and writes
JSON; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.kit import claim_results_file, profiling_timeouts, testkit
from benchmarks.memory import SHAPES


def random_model(folder: str, shape: str, devices: str, dtype: str) -> str:
    """A seeded random Llama of ``shape`` with SmolLM2's vocabulary, built on the benchmark's device in its dtype
    (a billion-parameter model is built in seconds on a GPU, minutes on a CPU) and saved in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **SHAPES[shape])
    with torch.device("cpu" if devices == "cpu" else f"cuda:{devices}"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    del model
    return folder


SENTENCES = ["Write a short review of a film you watched recently and say why you liked it.",
             "Describe the weather in your town today, and what you plan to do this afternoon.",
             "Explain to a friend how to cook rice, step by step, without a rice cooker.",
             "Tell a story about a cat who finds a key in the garden and opens an old door."]


def workload(args, new_tokens: int, tokenizer) -> tuple[list[list[int]], list[list[float]]]:
    """Prompts (token ids of English text, ``--prompt-tokens`` each, which TRL's path gets back as text) and, per
    step, seeded rewards for every continuation (prompt-major)."""
    prompts = []
    for i in range(args.prompts):
        text = " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(args.prompt_tokens))
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][:args.prompt_tokens])
    rng = random.Random(new_tokens)
    rewards = [[rng.random() for _ in range(args.prompts * args.samples)] for _ in range(args.steps)]
    return prompts, rewards


def sampling(args, new_tokens: int) -> dict:
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": True,
            "num_return_sequences": args.samples}


def llmrl_path(model: str, tokenizer: str, args, new_tokens: int, before: bool) -> dict:
    """Steps through a live run: generate, then a grpo update; seconds per step and the decoder's statistics."""
    llm = {"model": model, "tokenizer": tokenizer, "dtype": args.dtype,
           "devices": "cpu" if args.devices == "cpu" else [int(args.devices)],
           "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 16, "alpha": 32}}}}],
           "updater": {"plugin": "grpo", "args": {"epochs": 1, "kl_coef": 0.0}},
           "training": {"micro_batch_size": args.samples, "optimizer": {"type": "adam", "lr": 1e-5},
                        **({} if before else json.loads(args.training))},
           "generation": {"decoder": "hf"} if before else {"decoder": "auto", **json.loads(args.generation)}}
    from transformers import AutoTokenizer

    prompts, rewards = workload(args, new_tokens, AutoTokenizer.from_pretrained(tokenizer))
    times, generating, stats = [], [], None
    config = {"llms": {"main": llm}, "threads_per_rank": args.threads, **profiling_timeouts(args.profile)}
    with testkit().LiveRun(config, startup_timeout=900) as run:
        for step in range(args.steps):
            start = time.perf_counter()
            groups = run.generate(prompts, **sampling(args, new_tokens), timeout=3600)
            generating.append(time.perf_counter() - start)
            continuations = [[s["tokens"].tolist() for s in group] for group in groups]
            per = [rewards[step][i * args.samples:(i + 1) * args.samples] for i in range(len(prompts))]
            extra = {} if before else {"old_logprobs": [[s["logprobs"] for s in group] for group in groups]}
            stats = run.update(prompts, continuations, rewards=per, **extra, timeout=3600)[0]
            times.append(time.perf_counter() - start)
        memory = run.server_memory()[1]
    return {"seconds": times, "generate seconds": generating, "update stats": stats, "decoding": memory.get("decoding"),
            **peak_mib(memory.get("cuda_peak"))}


def peak_mib(peak_bytes) -> dict:
    """The path's peak CUDA memory (allocated by torch), where it ran on a GPU."""
    return {} if peak_bytes is None else {"peak CUDA MiB": round(peak_bytes / 2**20)}


def cuda_peak():
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def child(path: str, model: str, tokenizer: str, args, new_tokens: int) -> dict:
    """Run the plain loop or TRL in a fresh process (each holds its own copy of the model)."""
    command = [sys.executable, "-m", "benchmarks.grpo_step", "--child", path, "--child-model", model,
               "--tokenizer", tokenizer, "--new-tokens", str(new_tokens),
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("prompts", "samples", "prompt_tokens", "steps", "devices", "dtype", "threads")]]
    # its standard error goes to ours (progress, and the traceback of a failure); its result is its last line
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if done.returncode:
        return {"error": f"the {path} child exited with {done.returncode}: see the standard error above"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_steps(model_path: str, tokenizer_path: str, args, new_tokens: int) -> dict:
    """The plain HF + PEFT GRPO loop (see the module's docstring)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    device = torch.device("cpu" if args.devices == "cpu" else f"cuda:{args.devices}")
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(device)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    if device.type == "cuda":
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    prompts, rewards = workload(args, new_tokens, AutoTokenizer.from_pretrained(tokenizer_path))
    ids = torch.tensor(prompts, device=device)
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        policy.eval()
        with torch.no_grad():
            out = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                  **sampling(args, new_tokens))
        reward = torch.tensor(rewards[step], device=device).view(args.prompts, args.samples)
        advantages = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()
        policy.train()
        for first in range(0, out.shape[0], 8):
            rows = out[first:first + 8]
            logits = policy(input_ids=rows).logits[:, args.prompt_tokens - 1:-1].float()
            targets = rows[:, args.prompt_tokens:]
            logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
            ratio = torch.exp(logp - logp.detach())  # one epoch: the ratio is 1, its gradient the policy gradient's
            loss = -(ratio * advantages[first:first + 8, None]).mean(1).sum() / out.shape[0]
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"seconds": times, **peak_mib(cuda_peak())}


def trl_steps(model_path: str, tokenizer_path: str, args, new_tokens: int) -> dict:
    """TRL's GRPOTrainer on the same model, prompts and rewards, timed per optimizer step by a callback."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    prompts, rewards = workload(args, new_tokens, tokenizer)
    texts = [tokenizer.decode(p) for p in prompts]
    calls = {"n": 0}

    def reward(completions, **kwargs):
        step = min(calls["n"], args.steps - 1)
        calls["n"] += 1
        return rewards[step][:len(completions)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
    rows = args.prompts * args.samples
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=rows, num_generations=args.samples,
                            max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens},
                            learning_rate=1e-5, max_steps=args.steps, beta=0.0, num_iterations=1, report_to=[],
                            logging_steps=1, save_strategy="no", bf16=args.dtype == "bfloat16",
                            use_cpu=args.devices == "cpu", gradient_checkpointing=args.devices != "cpu",
                            shuffle_dataset=False, dataloader_num_workers=0)
        clock = Clock()
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": texts * args.steps}), callbacks=[clock],
                              peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
        trainer.train()
    logged = trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}
    prompt_lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return {"seconds": clock.times, **peak_mib(cuda_peak()),
            "prompt tokens (TRL tokenises the prompts' text)": prompt_lengths,
            "TRL's last log": {k: v for k, v in logged.items() if "length" in k or k in ("loss", "reward")}}


def summary(result: dict) -> dict:
    if "seconds" not in result:
        return result
    later = result["seconds"][1:] or result["seconds"]
    medians = {"median step": statistics.median(later)}
    if "generate seconds" in result:  # llmrl's paths: the step's two parts
        generating = result["generate seconds"][1:] or result["generate seconds"]
        updating = [step - gen for step, gen in zip(later, generating)]
        medians.update({"median generate": statistics.median(generating), "median update": statistics.median(updating)})
    return {**result, "first step": result["seconds"][0], **medians}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", help="a shape of benchmarks.memory.SHAPES")
    parser.add_argument("--devices", default="cpu", help="cpu, or the GPU id every path uses")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", default="20")
    parser.add_argument("--steps", type=int, default=3, help="the first warms up; the median of the rest is reported")
    parser.add_argument("--paths", default="now,before,plain,trl")
    parser.add_argument("--generation", default="{}",
                        help='llms.<name>.generation for "llmrl now", as JSON, e.g. \'{"sampler": "inverse_cdf"}\'')
    parser.add_argument("--training", default="{}",
                        help='more of llms.<name>.training for "llmrl now", as JSON, e.g. '
                             '\'{"max_tokens_per_micro_batch": 40000}\' (one pass per micro-batch, as TRL\'s)')
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the tests' tiny Llama's)")
    parser.add_argument("--profile", default=None, help="a folder: the server profiles its second generate and update "
                        "there (LLMRL_PROFILE)")
    parser.add_argument("--out", default="grpo-step.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile:
        os.environ["LLMRL_PROFILE"] = args.profile
    if args.child:
        new = int(args.new_tokens)
        result = plain_steps(args.child_model, args.tokenizer, args, new) if args.child == "plain" else \
            trl_steps(args.child_model, args.tokenizer, args, new)
        print(json.dumps(result))
        return 0
    mark = claim_results_file(args.out, "grpo_step")
    tokenizer = args.tokenizer or testkit().tiny_model("llama")
    paths = args.paths.split(",")
    results: dict = {**mark, "shape": args.shape, "devices": args.devices, "dtype": args.dtype, "prompts": args.prompts,
                     "samples": args.samples, "prompt tokens": args.prompt_tokens}
    with tempfile.TemporaryDirectory(prefix="llmrl-grpo-step-") as work:
        model = random_model(work, args.shape, args.devices, args.dtype)
        for new in [int(n) for n in args.new_tokens.split(",")]:
            row: dict = {}
            for path in paths:
                print(f"== {new} new tokens: {path}", flush=True)
                if path == "trl":
                    try:
                        import trl  # noqa: F401
                    except ImportError:
                        row[path] = {"skipped": "trl is not installed (pip install -e .[bench])"}
                        continue
                try:
                    result = llmrl_path(model, tokenizer, args, new, before=path == "before") \
                        if path in ("now", "before") else child(path, model, tokenizer, args, new)
                except Exception as err:  # noqa: BLE001 - a benchmark goes on to its next path
                    result = {"error": f"{type(err).__name__}: {err}"[:3000]}
                row[path] = summary(result)
                print(json.dumps(row[path], default=str)[:1500], flush=True)
                results[f"{new} new tokens"] = row
                with open(args.out, "w") as f:  # after every path: a run cut short keeps what it measured
                    json.dump(results, f, indent=1, default=str)
            base = next((p for p in ("trl", "plain") if "median step" in row.get(p, {})), None)
            if base is not None:
                row["ratios (baseline's median step / path's)"] = {
                    p: row[base]["median step"] / r["median step"] for p, r in row.items() if "median step" in r}
                row["baseline"] = base
            results[f"{new} new tokens"] = row
            print(json.dumps(row.get("ratios (baseline's median step / path's)"), indent=1), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
