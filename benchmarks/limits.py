"""Compute limits for the benchmark: the machine's matmul rate (measured, the best of the run), the unique tokens of
a workload, the FLOPs of the work a scoring call cannot avoid, and every row's limit restated at the best rate.

Used by :mod:`benchmarks.run` and :mod:`benchmarks.profile_scoring`; it runs no llmrl server.
"""

from __future__ import annotations

import sys
import time

import torch


class BestRate:
    """The machine's float32 matmul rate, measured again before each row; the best seen so far is used (and, at the
    end, the best of the run: ``rebase_limits``), so that a measurement taken while something else ran on the machine
    never makes a compute limit look easy."""

    def __init__(self, threads: int, size: int = 1536):
        self.threads = threads
        self.size = size  # a smoke test (``--quick``) measures a smaller product: its figures are not the subject
        self.seen: list[float] = []

    def __call__(self) -> float:
        self.seen.append(measure_matmul_rate(self.threads, self.size))
        return max(self.seen)


def rebase_limits(rows: list[dict], best: float) -> None:
    """Restate every row's compute limit at the best matmul rate of the whole run (measured once more at its end):
    a row measured while the machine was slow keeps its time, but its limit shrinks and its ratio grows. Prints
    each ratio that changed."""
    for row in rows:
        rate = row.get("matmul GFLOP/s (best so far)")
        if rate is None or rate * 1e9 >= best:
            continue
        factor = rate * 1e9 / best
        for key in list(row):
            if key.startswith("compute limit"):
                row[key] *= factor
            elif " / " in key and key.endswith("limit"):
                row[key] /= factor
                print(f"   {row['workload']}: {key} at the run's best rate ({best / 1e9:.1f} GFLOP/s): "
                      f"{row[key]:.3f}", file=sys.stderr)
        row["matmul GFLOP/s (best so far)"] = best / 1e9


def measure_matmul_rate(threads: int, size: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of a square float32 matrix multiply with ``threads`` threads (best of a few), through torch's ``matmul``
    (MKL) and, where this torch has it, through oneDNN, the kernel llmrl's passes use on AMD CPUs (``cpu_matmul``):
    the faster kernel's rate, so that the limit is this machine's whichever kernel llmrl runs."""
    from llmrl.engine.model.decoding.packed_linears import available

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    kernels = [lambda: a @ b]
    if available("onednn"):
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for kernel in kernels:
        kernel()
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def unique_tokens(tokenizer, workload: list[dict]) -> int:
    total = 0
    for item in workload:
        ctx = len(tokenizer(item["context"])["input_ids"])
        total += ctx + sum(max(0, len(tokenizer(item["context"] + c)["input_ids"]) - ctx) for c in item["candidates"])
    return total


def necessary_flops(model, tokenizer, workload: list[dict]) -> float:
    """FLOPs a scoring call cannot avoid, counted tighter than 2 per parameter per token: every context token and
    every candidate token but the last (a target only) through the decoder layers (2 per layer parameter),
    attention over the positions before it (4 x hidden per layer and position: queries times keys, weights times
    values), and the vocabulary projection only where a score is read (the context's last position, then each
    candidate token but the last). Candidates that start alike are counted apart (sharing goes below this)."""
    config = model.config
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    per_input, per_attended, per_logit = 2 * layer_params, 4 * hidden * layers, 2 * vocab * hidden
    total = 0.0
    for item in workload:
        ctx = len(tokenizer(item["context"])["input_ids"])
        total += ctx * per_input + per_attended * ctx * (ctx + 1) / 2 + per_logit
        for candidate in item["candidates"]:
            inputs = max(0, len(tokenizer(item["context"] + candidate)["input_ids"]) - ctx - 1)
            attended = sum(ctx + j for j in range(1, inputs + 1))
            total += inputs * (per_input + per_logit) + per_attended * attended
    return total
