"""Multi-LoRA batching: the prompts of N adapters (tenants) generated in one call, each row on its own adapter,
against N calls of one adapter each, in one run, on one device.

    .venv/bin/python -m benchmarks.multi_lora                     # CPU: SmolLM2-135M's shape, 8 adapters x 4 prompts
    python -m benchmarks.multi_lora --device cuda --shape smollm2-1.7b --new-tokens 256

Both rows run the servers' ``generate`` code in-process (llmrl's loop and the device's default decoding settings) on
the same random-weight model holding N LoRA adapters (r=16 on every linear layer, B drawn away from its zero start),
with the same prompts, greedy, and ``min_new_tokens`` = ``max_new_tokens``:
  - ``one adapter a call``: N calls, each the adapter's prompts with that adapter active (as N tenants' calls are
    served one after another; where the device merges the adapter into the weights, it does here);
  - ``all adapters in one call``: one call of every prompt, each naming its adapter
    (:mod:`llmrl.engine.model.row_adapters`: the base weights' products shared by every row, each adapter's A and B
    applied to its own rows).
It prints each row's best of ``--repeats`` warm calls (after one call that packs weights and warms up), the ratio
one-a-call / one-call, whether every greedy token is the same and the largest log-prob difference. ``--out`` writes
the figures as JSON. It asserts nothing.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.decoding import LORA_TARGETS, build, prompt_ids, timed, tokenizer_from


def with_adapters(model, count: int, seed: int = 1):
    """``model`` (a PEFT model holding ``default``) with ``count`` adapters in all: ``default`` and ``t1``... of the
    same configuration, each with weights of its own."""
    from peft import LoraConfig

    config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)
    names = ["default", *(f"t{k}" for k in range(1, count))]
    for name in names[1:]:
        model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_" in key:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval(), names


def run_calls(model, tokenizer, groups: dict, kwargs: dict, device: str, decoder, together: bool) -> list:
    """Each adapter's samples (in ``groups``' order): one call per adapter, or one call for all."""
    from llmrl.engine.model.generation import generate, plan_generate
    from llmrl.engine.model.row_adapters import RowAdapters

    if not together:
        out = []
        for name, prompts in groups.items():
            model.set_adapter(name)
            plan = plan_generate(model, tokenizer, "causal", prompts, kwargs, 1 << 22, 4096, 8192)
            out += generate(model, tokenizer, "causal", plan, device, seed=0, decoder=decoder)
        return out
    prompts = [p for group in groups.values() for p in group]
    rows = RowAdapters([name for name, group in groups.items() for _ in group])
    plan = plan_generate(model, tokenizer, "causal", prompts, kwargs, 1 << 22, 4096, 8192)
    plan = type(plan)(**{**plan.__dict__, "row_adapters": rows})
    with rows.hooked(model):
        return generate(model, tokenizer, "causal", plan, device, seed=0, decoder=decoder)


def common_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments of the multi-LoRA benchmarks: the device, the model's shape and dtype, the adapters, the
    repeats, the tokenizer and the JSON output."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    return parser


def model_of(args):
    """(the PEFT model with ``args.adapters`` adapters, their names, its dtype, the tokenizer)."""
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    model, names = with_adapters(build(args.shape, dtype, args.device), args.adapters)
    return model, names, dtype, tokenizer_from(args.tokenizer)


def write_figures(path: str | None, figures: dict) -> None:
    """``figures`` with the run's provenance, as JSON at ``path`` (nothing without one)."""
    if not path:
        return
    from llmrl.engine.provenance import run_provenance

    with open(path, "w") as f:
        json.dump({"provenance": run_provenance(), **figures}, f, indent=2)


def main(argv=None) -> int:
    from llmrl.engine.config.types import GenerationSettings
    from llmrl.engine.model.decoding.runtime import Decoder

    parser = common_arguments(__doc__)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model, names, dtype, tokenizer = model_of(args)
    prompts = prompt_ids(tokenizer, args.adapters * args.prompts, args.prompt_tokens)
    groups = {name: prompts[k * args.prompts:(k + 1) * args.prompts] for k, name in enumerate(names)}
    kwargs = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    decoder = Decoder(GenerationSettings(), torch.device(args.device).type)
    results, seconds = {}, {}
    for together in (False, True):
        name = "all adapters in one call" if together else "one adapter a call"
        results[together], first = timed(lambda t=together: run_calls(model, tokenizer, groups, kwargs, args.device,
                                                                       decoder, t), args.device)
        seconds[together] = min(timed(lambda t=together: run_calls(model, tokenizer, groups, kwargs, args.device,
                                                                   decoder, t), args.device)[1]
                                for _ in range(args.repeats))
        print(f"  {name:26s} first {first:7.2f} s, warm {seconds[together]:7.3f} s", flush=True)
    same = all(a["tokens"].tolist() == b["tokens"].tolist() for ra, rb in zip(results[False], results[True])
               for a, b in zip(ra, rb))
    gap = max(float((a["logprobs"] - b["logprobs"]).abs().max()) for ra, rb in zip(results[False], results[True])
              for a, b in zip(ra, rb) if a["tokens"].tolist() == b["tokens"].tolist())
    ratio = seconds[False] / seconds[True]
    rows = args.adapters * args.prompts
    print(f"  {args.adapters} adapters x {args.prompts} prompts ({rows} rows), {args.new_tokens} new tokens, "
          f"{args.shape} {str(dtype).replace('torch.', '')} on {args.device}: one call is {ratio:.2f}x the "
          f"adapter-a-call rate; greedy tokens the same: {same}; largest log-prob difference {gap:.2e}")
    write_figures(args.out, {"device": args.device, "shape": args.shape, "dtype": str(dtype),
                             "adapters": args.adapters, "prompts_per_adapter": args.prompts,
                             "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                             "one_adapter_a_call_s": seconds[False], "one_call_s": seconds[True], "speedup": ratio,
                             "same_tokens": same, "largest_logprob_difference": gap,
                             "decoding": decoder.stats()["calls"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
