"""Peak memory of the calls that used to hold full-vocabulary tensors, today's path against the earlier one, side
by side in one run, each in a child process of its own:

- ``generate`` with per-token log-probs: llmrl reads each chosen token's log-prob step by step, against plain Hugging
  Face keeping ``output_logits`` (what llmrl did before, and what a plain HF script does);
- ``score(per_token=True, entropy=True)`` without gradients (as in the old-policy and reference passes): log-probs and
  entropies normalised a piece of rows at a time, against one piece (what llmrl did before);
- ``generate`` of many samples of one prompt (``--one-prompt-rows``, a large GRPO group) in llmrl's decoding loop: the
  prompt's rows in runs within ``--max-rows`` (the LLM's ``minibatch_size``) and the default ``generation.cache_mb``,
  against all of them in one batch (what llmrl did before). Sampled with ``top_k=1``, so that both paths choose the
  same tokens.

    .venv/bin/python -m benchmarks.memory                     # CPU: 2 narrow layers, SmolLM2's 49k vocabulary
    python -m benchmarks.memory --shape smollm2-1.7b --rows 64 --new-tokens 512 --prompt-tokens 49   # on a GPU

Every path runs on the same random-weight Llama (seeded), the same inputs and the same sampling seed, and reports
the peak memory of the call above what its process held before it: resident memory on CPU (the peak ``VmHWM`` of
``/proc/self/status``, reset at the start of the call through ``/proc/self/clear_refs``, above ``VmRSS`` then; where
that file cannot be written, ``ru_maxrss`` above the resident memory then), allocated CUDA memory on a GPU
(``max_memory_allocated``). The model has few, narrow layers by default so that the logits dominate on CPU as they do
on a GPU. Each row prints both peaks, their ratio, and the largest difference between the two paths' results (for
generate, where the sampled tokens are identical: seeded sampling on a GPU is not bit-reproducible even between two
plain HF runs). It writes nothing.

Each path runs in a fresh interpreter of its own (``python -m benchmarks.memory --child PATH``): the figures. With
``--forked-children`` (CPU only, where the peak can be reset), the benchmark instead imports torch, transformers and
llmrl once and forks a child per path, which skips those imports (some CPU-seconds each): a quick check that every
row runs and both paths agree, whose peaks are not the figures (a forked child's peaks read differently from a fresh
process's; on the default shape, 4.6 GiB / 325 MiB for the generate row against 6.2 GiB / 1.0-1.2 GiB fresh, 2-core
AMD EPYC, 2026-12-02). A child sends its result back as one JSON object: through a pipe, or as the last
line of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import traceback

SHAPES = {  # LlamaConfig arguments; every shape has SmolLM2's 49,152-entry vocabulary
    "narrow": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "tie_word_embeddings": True},
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


def status_kb(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status``, in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its resident memory now (Linux: ``5`` written to
    ``/proc/self/clear_refs``); False where that file cannot be written (then only ``ru_maxrss`` tells a peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def preload() -> None:
    """Import what the children import before their measured call (torch, transformers, the llmrl modules of each
    path), so that children forked afterwards skip it. Not PEFT, which llmrl's decoding loop imports as it starts
    (in the call, as it always was here): imported before the model is built, it raises the peak of the
    one-prompt-one-batch path several times over (a cause not yet found), so it stays out of both ways. Runs
    nothing with torch: no thread pool or CUDA state is there to fork."""
    import torch  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    from llmrl.engine.config.types import GenerationSettings  # noqa: F401
    from llmrl.engine.model.decoding import batches, llama_step, loop, packed_linears, static_step  # noqa: F401
    from llmrl.engine.model.decoding.runtime import Decoder  # noqa: F401
    from llmrl.engine.model.generation import generate, plan_generate  # noqa: F401
    from llmrl.engine.model.module import ModelWithHeads  # noqa: F401
    from llmrl.engine.model.scoring import results  # noqa: F401
    from llmrl.engine.model.scoring.planning import Needs, plan_batches  # noqa: F401
    from llmrl.engine.model.scoring.tokenization import tokenize  # noqa: F401


def child(path: str, args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmrl.engine.model.generation import generate, plan_generate

    preload()  # already done in a forked child; here, so that a fresh child measures the same
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
    peak = start_measuring(device)
    if path.startswith("score"):
        return score_child(path, model, args, device, peak)
    if path.startswith("one-prompt"):
        return one_prompt_child(path, model, prompts[0], args, device, peak)
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
    return {"peak_bytes": peak(), "tokens": tokens, "logprobs": logprobs, "device": str(device)}


def start_measuring(device):
    """Start measuring this process's peak memory from now; returns the function that tells the peak since then,
    in bytes, above what the process held now: CUDA allocated memory on a GPU, else resident memory (``VmHWM``
    reset now, else ``ru_maxrss``, the process's whole peak)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        return lambda: torch.cuda.max_memory_allocated() - before
    if reset_peak():
        before = status_kb("VmRSS") * 1024
        return lambda: status_kb("VmHWM") * 1024 - before
    before = resident_kb() * 1024
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def one_prompt_child(path: str, model, prompt: list[int], args, device, peak) -> dict:
    """``--one-prompt-rows`` samples of one prompt in llmrl's loop; ``one-prompt-one-batch`` lets its rows run in one
    batch, as llmrl did before, ``one-prompt-runs`` bounds them by ``--max-rows``."""
    import torch

    from llmrl.engine.config.types import GenerationSettings
    from llmrl.engine.model.decoding.runtime import Decoder
    from llmrl.engine.model.generation import generate, plan_generate

    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": True, "top_k": 1,
                "num_return_sequences": args.one_prompt_rows, "pad_token_id": 0}
    whole = path == "one-prompt-one-batch"  # no bound on rows, nor on the cache (the default cache_mb would cut)
    loop = Decoder(GenerationSettings(cache_mb=2**40) if whole else GenerationSettings(), device.type)
    with torch.no_grad():
        plan = plan_generate(model, IdsTokenizer(), "causal", [prompt], settings, 10**9,
                             10**6 if whole else args.max_rows, None)
        results = generate(model, IdsTokenizer(), "causal", plan, device, seed=args.seed, decoder=loop)
    return {"peak_bytes": peak(), "tokens": [s["tokens"].tolist() for s in results[0]],
            "logprobs": [s["logprobs"].tolist() for s in results[0]], "device": str(device)}


def score_child(path: str, model, args, device, peak) -> dict:
    """``score(per_token=True, entropy=True)`` of ``--rows`` candidates of ``--new-tokens`` tokens each, through the
    engine's forward without gradients; ``score-one-piece`` normalises every row at once, as llmrl did before."""
    import torch

    from llmrl.engine.model.module import ModelWithHeads
    from llmrl.engine.model.scoring import results
    from llmrl.engine.model.scoring.planning import Needs, plan_batches
    from llmrl.engine.model.scoring.tokenization import tokenize

    if path == "score-one-piece":
        results.LOGITS_PER_PIECE = 1 << 62
    per_prompt = args.rows // args.prompts
    contexts = [[1] + [100 + 7 * i + j for j in range(args.prompt_tokens - 1)] for i in range(args.prompts)]
    candidates = [[[200 + 11 * k + t for t in range(args.new_tokens)] for k in range(per_prompt)]
                  for _ in range(args.prompts)]
    plan = tokenize(IdsTokenizer(), "causal", contexts, candidates, max_length=None, prefix_reuse=True,
                    add_eos=False, vocab_size=model.config.vocab_size)
    needs = Needs(per_token=True, entropy=True)
    module = ModelWithHeads(model, {}, "causal", 0, None)
    with torch.no_grad():
        out = module(plan, plan_batches(plan, 10**9, 10**6, needs, encoder_reuse=True), needs)
    values = torch.cat([out.token_logprobs, out.token_entropy]).float().cpu().tolist()
    return {"peak_bytes": peak(), "tokens": [], "logprobs": [values], "device": str(device)}


def can_fork() -> bool:
    """Whether the paths can run in forked children: no GPU (CUDA must not be initialised before a fork; checked
    through NVML, which does not), and a peak resident memory that a child can reset (:func:`reset_peak`)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() through NVML, not the CUDA runtime
    import torch

    return not torch.cuda.is_available() and reset_peak()


def forked(path: str, args) -> dict | None:
    """``path`` run in a child forked from this process (which imported what it needs: :func:`preload`); its result
    comes back through a pipe as JSON. None (its traceback printed) if it failed."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 1
        try:
            with os.fdopen(write, "w") as out:
                json.dump(child(path, args), out)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as result:
        text = result.read()  # to its end (the child's exit) before waiting: a large result fills the pipe
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return json.loads(text) if code == 0 else None


def fresh(path: str, argv) -> dict | None:
    """``path`` run in a fresh interpreter (``python -m benchmarks.memory --child PATH`` with this run's arguments);
    its result is the last line of its output. None (the end of its error output printed) if it failed."""
    command = [sys.executable, "-m", "benchmarks.memory", "--child", path] + (argv or sys.argv[1:])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="sequences (candidates) in all, over the prompts")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one-prompt-rows", type=int, default=128, help="samples of one prompt (the third row)")
    parser.add_argument("--max-rows", type=int, default=64, help="the LLM's minibatch_size (the third row)")
    parser.add_argument("--child", choices=["llmrl", "hf", "score-one-piece", "score-pieces", "one-prompt-one-batch",
                                            "one-prompt-runs"], help=argparse.SUPPRESS)
    parser.add_argument("--forked-children", action="store_true",
                        help="quick check (CPU): fork each path's child from this process instead of starting a fresh "
                             "interpreter; every row runs and both paths are compared, but the peaks are not figures")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    fork = args.forked_children and can_fork()
    if args.forked_children and not fork:
        print("benchmarks.memory: --forked-children needs a CPU run whose peak memory can be reset "
              "(/proc/self/clear_refs); running each path in a fresh interpreter", file=sys.stderr)
    if fork:
        preload()
    rows = [("generate", "plain HF with output_logits (llmrl before)", "hf", "llmrl, log-probs read step by step",
             "llmrl"),
            ("score per_token + entropy", "one piece (llmrl before)", "score-one-piece", "pieces of rows",
             "score-pieces"),
            ("generate, one prompt's samples", "its rows in one batch (llmrl before)", "one-prompt-one-batch",
             f"runs within {args.max_rows} rows and the cache", "one-prompt-runs")]
    for title, old_name, old_path, new_name, new_path in rows:
        runs = {}
        for path in (old_path, new_path):
            runs[path] = forked(path, args) if fork else fresh(path, argv)
            if runs[path] is None:
                return 1
        before, now = runs[old_path], runs[new_path]
        same = before["tokens"] == now["tokens"]
        diff = max((abs(a - b) for x, y in zip(before["logprobs"], now["logprobs"]) for a, b in zip(x, y)),
                   default=0.0)
        kind = "CUDA allocated" if before["device"].startswith("cuda") else "resident"
        count = args.one_prompt_rows if old_path.startswith("one-prompt") else args.rows
        print(f"{title}: {count} rows x {args.new_tokens} tokens, shape {args.shape}, vocabulary 49152, on "
              f"{before['device']}; peak {kind} memory of the call:")
        print(f"  {old_name + ':':48s} {before['peak_bytes'] / 2**20:9.1f} MiB")
        print(f"  {new_name + ':':48s} {now['peak_bytes'] / 2**20:9.1f} MiB")
        agreement = (f"same tokens, largest difference {diff:.2e}" if same else
                     "the sampled tokens differ (seeded sampling on a GPU is not bit-reproducible from run to run, "
                     "even for plain HF), so the log-probs are not compared")
        print(f"  ratio: {now['peak_bytes'] / max(before['peak_bytes'], 1):.3f}; {agreement}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
