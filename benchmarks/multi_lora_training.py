"""Multi-LoRA batching of training passes: the sequences of N adapters (tenants) in one forward and backward pass, each
token on its own adapter, against N passes of one adapter each, in one run, on one device.

    .venv/bin/python -m benchmarks.multi_lora_training            # CPU: SmolLM2-135M's shape, 8 adapters x 4 sequences
    python -m benchmarks.multi_lora_training --device cuda --shape smollm2-1.7b --tokens 512

Both rows run the servers' pass code in-process (:class:`~llmrl.engine.model.module.ModelWithHeads` over the planned
batches, as ``forward_backward`` runs it) on the same random-weight model holding N LoRA adapters (r=16 on every
linear layer), over the same sequences, with the loss ``-sum(log-probs)`` back-propagated:
  - ``one adapter a pass``: N passes, each over the adapter's sequences with that adapter active (as N tenants'
    ``forward_backward`` calls are served one after another);
  - ``all adapters in one pass``: one pass over every sequence, each naming its adapter
    (:mod:`llmrl.engine.model.token_adapters`).
It prints each row's best of ``--repeats`` warm passes (after one that warms up), the ratio, and the largest
difference between the two rows' log-probs and LoRA gradients. ``--out`` writes the figures as JSON. It asserts
nothing.
"""

from __future__ import annotations

from benchmarks.decoding import prompt_ids, sync, timed
from benchmarks.multi_lora import common_arguments, model_of, write_figures


def one_pass(model, tokenizer, sequences: list, names: list | None, call: tuple, device: str):
    """Per-token log-probs of ``sequences`` and the LoRA gradients of ``-sum(log-probs)``: ``names`` gives each
    sequence's adapter (one pass for all, over the adapters of ``call``), or None (the active adapter's pass)."""
    from llmrl.engine.model.module import ModelWithHeads
    from llmrl.engine.model.scoring.planning import Needs, plan_batches
    from llmrl.engine.model.scoring.tokenization import tokenize
    from llmrl.engine.model.token_adapters import TokenAdapters

    plan = tokenize(tokenizer, "causal", [s[:1] for s in sequences], [[s[1:]] for s in sequences], max_length=None)
    if names is not None:
        for ctx, name in zip(plan.contexts, names):
            ctx.adapter = name
    needs = Needs(per_token=True)
    module = ModelWithHeads(model, {}, "causal", tokenizer.pad_token_id, None)
    batches = plan_batches(plan, 8192, 64, needs)  # the defaults of llms.<name>.token_budget and minibatch_size
    if names is None:
        out = module(plan, batches, needs)
    else:
        with TokenAdapters(call).hooked(model):
            out = module(plan, batches, needs)
    (-out.token_logprobs.sum()).backward()
    sync(device)
    return out.token_logprobs.detach().split(out.candidate_token_counts.tolist())


def run(model, tokenizer, groups: dict, device: str, together: bool):
    """Each sequence's log-probs (in ``groups``' order) and every LoRA weight's gradient."""
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    if together:
        sequences = [s for group in groups.values() for s in group]
        names = [name for name, group in groups.items() for _ in group]
        logprobs = list(one_pass(model, tokenizer, sequences, names, tuple(groups), device))
    else:
        logprobs = []
        for name, group in groups.items():
            model.set_adapter(name)  # (PEFT makes this adapter's weights alone trainable)
            logprobs += one_pass(model, tokenizer, group, None, tuple(groups), device)
            for p in params.values():
                p.requires_grad_(True)
    return logprobs, {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}


def main(argv=None) -> int:
    parser = common_arguments(__doc__)
    parser.add_argument("--sequences", type=int, default=4, help="sequences per adapter")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    args = parser.parse_args(argv)
    model, names, dtype, tokenizer = model_of(args)
    sequences = prompt_ids(tokenizer, args.adapters * args.sequences, args.tokens)
    groups = {name: sequences[k * args.sequences:(k + 1) * args.sequences] for k, name in enumerate(names)}
    results, seconds = {}, {}
    for together in (False, True):
        label = "all adapters in one pass" if together else "one adapter a pass"
        results[together], first = timed(lambda t=together: run(model, tokenizer, groups, args.device, t), args.device)
        seconds[together] = min(timed(lambda t=together: run(model, tokenizer, groups, args.device, t),
                                      args.device)[1] for _ in range(args.repeats))
        print(f"  {label:26s} first {first:7.2f} s, warm {seconds[together]:7.3f} s", flush=True)
    (alone, alone_grads), (mixed, mixed_grads) = results[False], results[True]
    logprob_gap = max(float((a - b).abs().max()) for a, b in zip(alone, mixed))
    grad_gap = max(float((alone_grads[n] - g).abs().max()) for n, g in mixed_grads.items())
    largest = max(float(g.abs().max()) for g in alone_grads.values())
    ratio = seconds[False] / seconds[True]
    print(f"  {args.adapters} adapters x {args.sequences} sequences of {args.tokens} tokens, {args.shape} "
          f"{str(dtype).replace('torch.', '')} on {args.device}: one pass is {ratio:.2f}x the adapter-a-pass rate; "
          f"largest log-prob difference {logprob_gap:.2e}, largest gradient difference {grad_gap:.2e} (of "
          f"gradients up to {largest:.2e}); gradients of the same weights: {alone_grads.keys() == mixed_grads.keys()}")
    write_figures(args.out, {"device": args.device, "shape": args.shape, "dtype": str(dtype),
                             "adapters": args.adapters, "sequences_per_adapter": args.sequences,
                             "tokens": args.tokens, "one_adapter_a_pass_s": seconds[False],
                             "one_pass_s": seconds[True], "speedup": ratio, "largest_logprob_difference": logprob_gap,
                             "largest_gradient_difference": grad_gap, "largest_gradient": largest})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
