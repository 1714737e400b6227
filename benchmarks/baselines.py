"""The baselines the benchmark compares llmrl with (the plain Hugging Face code a user would write, and llmrl's model
code in this process), and its timing helpers (interleaved repeats, medians, the largest difference).

Used by :mod:`benchmarks.run` and :mod:`benchmarks.profile_scoring`; it starts no llmrl server.
"""

from __future__ import annotations

import statistics
import time

import torch


def naive_scores(model, tokenizer, workload: list[dict], rows_per_forward: int = 16) -> list[torch.Tensor]:
    """What a user writes with plain Hugging Face: concatenated texts, padded batches, gathered log-probs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for i, item in enumerate(workload):
        ctx_len = len(tokenizer(item["context"])["input_ids"])
        for c in item["candidates"]:
            rows.append((i, tokenizer(item["context"] + c)["input_ids"], ctx_len))
    out = [[] for _ in workload]
    with torch.no_grad():
        for start in range(0, len(rows), rows_per_forward):
            chunk = rows[start:start + rows_per_forward]
            width = max(len(ids) for _, ids, _ in chunk)
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (_, seq, _) in enumerate(chunk):
                ids[r, : len(seq)] = torch.tensor(seq)
                mask[r, : len(seq)] = 1
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for r, (i, seq, ctx_len) in enumerate(chunk):
                out[i].append(sum(logp[r, t - 1, seq[t]].item() for t in range(ctx_len, len(seq))))
    return [torch.tensor(s) for s in out]


def inprocess_scores(model, tokenizer, workload, token_budget: int, minibatch: int) -> list[torch.Tensor]:
    """llmrl's own pipeline (prefix reuse, token budget), run here without the engine around it (with the server's
    default ``cpu_matmul``: oneDNN's products for frozen weights on AMD CPUs)."""
    from llmrl.engine.model.cpu_matmul import frozen_linears
    from llmrl.engine.model.scoring.planning import Needs, plan_batches
    from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
    from llmrl.engine.model.scoring.tokenization import tokenize

    plan = tokenize(tokenizer, "causal", [w["context"] for w in workload], [w["candidates"] for w in workload],
                    max_length=None)
    out = [None] * len(workload)
    keep = accepts_logits_to_keep(model)
    with torch.no_grad(), frozen_linears(model):
        for batch in plan_batches(plan, token_budget, minibatch, Needs(), packed=True):
            res = run_batch(model, plan, batch, Needs(), tokenizer.pad_token_id, "cpu", keep)
            offset = 0
            for i in batch.contexts:
                k = len(plan.contexts[i].candidates)
                out[i] = res.scores[offset:offset + k]
                offset += k
    return out


def naive_estimate(model, tokenizer, work) -> float:
    """Seconds the naive baseline would take, from one small forward (to decide on a subset)."""
    ids = torch.tensor([tokenizer(work[0]["context"] + work[0]["candidates"][0])["input_ids"]] * 4)
    with torch.no_grad():
        model(input_ids=ids)
        start = time.perf_counter()
        model(input_ids=ids)
    per_token = (time.perf_counter() - start) / ids.numel()
    tokens = sum(len(tokenizer(w["context"] + c)["input_ids"]) for w in work for c in w["candidates"])
    return per_token * tokens


def plain_generate(model, tokenizer, prompts, new_tokens) -> list[list[int]]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    result = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        result.append(row[:end])
    return result


def interleaved(*fns, repeats: int):
    """(median time, result) of each function, run in turn after one warm-up each, the order reversed every other
    round (drift hits all alike, and none always runs right after the same one)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    results = [None for _ in fns]
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for k in order:
            start = time.perf_counter()
            results[k] = fns[k]()
            times[k].append(time.perf_counter() - start)
    return [(statistics.median(t), r) for t, r in zip(times, results)]


def timed(fn, repeats: int = 1):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def max_error(a, b) -> float:
    return max(float((x - y).abs().max()) if len(x) else 0.0 for x, y in zip(a, b))
