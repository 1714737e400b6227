"""oneDNN's products at every row count against the same products padded to a bounded set of row counts
(:func:`llmrl.engine.model.cpu_matmul.on_bounded_rows`), each in a fresh process of its own, in one run.

    .venv/bin/python -m benchmarks.onednn_rows                     # 1500 products, 1 to 1000 rows, 576 -> 1536
    .venv/bin/python -m benchmarks.onednn_rows --products 300 --in 64 --out 128

Each child multiplies ``--products`` inputs of a random number of rows (1 to ``--max-rows``, the same sequence in both
children) by one frozen float32 weight through ``mkldnn._linear_pointwise``: as given, or padded. It reports how many
distinct row counts oneDNN met, the growth of its resident memory after the first 50 products, and the seconds spent
in the products. The parent prints both rows and their ratios. It asserts nothing and writes nothing. Meaningful only
where torch has oneDNN (``cpu_matmul`` uses it by default on AMD CPUs).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def child(args) -> dict:
    import torch

    from llmrl.engine.model.cpu_matmul import on_bounded_rows

    torch.set_num_threads(args.threads)
    weight = torch.randn(args.out, getattr(args, "in"))
    rng = random.Random(0)
    seen, seconds, start_mb = set(), 0.0, None
    for i in range(args.products):
        x = torch.randn(rng.randrange(1, args.max_rows + 1), weight.shape[1])

        def product(rows):
            seen.add(rows.shape[0])
            return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")

        began = time.perf_counter()
        product(x) if args.child == "as-given" else on_bounded_rows(product, x)
        seconds += time.perf_counter() - began
        if i == 49:
            start_mb = resident_mb()
    return {"row_counts": len(seen), "growth_mb": resident_mb() - start_mb, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--products", type=int, default=1500)
    parser.add_argument("--max-rows", type=int, default=1000)
    parser.add_argument("--in", type=int, default=576)
    parser.add_argument("--out", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=["as-given", "padded"])
    args = parser.parse_args(argv)
    if args.products <= 50:
        parser.error("--products must be over 50: memory growth is counted after the first 50")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = {}
    for name in ("as-given", "padded"):
        command = [sys.executable, "-m", "benchmarks.onednn_rows", "--child", name] + list(argv or sys.argv[1:])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.products} products of 1 to {args.max_rows} rows x {getattr(args, 'in')} -> {args.out}, float32, "
          f"{args.threads} thread(s):")
    for name, row in rows.items():
        print(f"  {name:9s} {row['row_counts']:5d} row counts met, resident memory +{row['growth_mb']:7.1f} MB, "
              f"{row['seconds']:.2f} s in the products")
    given, padded = rows["as-given"], rows["padded"]
    print(f"  padded / as given: memory growth {padded['growth_mb'] / max(given['growth_mb'], 1e-9):.3f}, "
          f"time {padded['seconds'] / given['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
