"""A server's resident memory with the key/value cache across calls (``kv_cache_mb``) against its twin without it,
over many ``score`` calls, in one run.

    .venv/bin/python -m benchmarks.cache_memory                       # 480 calls, 1 MB cap, the tiny test model
    .venv/bin/python -m benchmarks.cache_memory --calls 960 --cpu-matmul torch

One run serves two LLMs of the same tiny random Llama (the test kit's), one with ``kv_cache_mb: --cap-mb``, one
without, on a server rank each. Every call scores 8 contexts: a 30-word header shared by all, then 3 to 120 random
words, so that every call splits cached edges and evicts others. Both LLMs get the same calls. After 20 calls and at
each doubling it prints both servers' resident memory (``server_memory()``), the cached one's over its twin's, and
the bytes the cache's own tensors keep alive against its cap. It asserts nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import random
import sys

from benchmarks import kit

WORDS = "go left right forward ball wall key door red blue green you see a the pick up turn open".split()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=480)
    parser.add_argument("--cap-mb", type=float, default=1.0)
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "torch", "onednn"])
    args = parser.parse_args(argv)
    testkit = kit.testkit()
    llm = {"model": testkit.tiny_model("llama")}
    config = {"llms": {"cached": {**llm, "kv_cache_mb": args.cap_mb}, "twin": {**llm, "kv_cache_mb": 0}},
              "threads_per_rank": 1, "cpu_matmul": args.cpu_matmul}
    rng = random.Random(0)
    header = "Goal: " + " ".join(rng.choice(WORDS) for _ in range(30))
    shown = {20} | {20 * 2**k for k in range(1, 16) if 20 * 2**k <= args.calls} | {args.calls}
    with testkit.LiveRun(config) as run:
        llm_of = {rank: info["llm"] for rank, info in run.servers().items()}
        print(f"{args.calls} score calls of 8 contexts, kv_cache_mb {args.cap_mb:g} against 0, cpu_matmul "
              f"{args.cpu_matmul}; resident memory of each server (MB):")
        for call in range(1, args.calls + 1):
            contexts = [f"{header} {' '.join(rng.choice(WORDS) for _ in range(rng.randrange(3, 120)))}"
                        for _ in range(8)]
            for name in ("cached", "twin"):
                run.score(contexts, [[" go", " turn left"]] * 8, llm=name)
            if call in shown:
                memory = run.server_memory()
                rss = {llm_of[rank]: stats["rss"] / 2**20 for rank, stats in memory.items()}
                cache = next(stats["kv_cache"] for rank, stats in memory.items() if llm_of[rank] == "cached")
                print(f"  after {call:5d} calls: cached {rss['cached']:7.1f}, twin {rss['twin']:7.1f}, "
                      f"cached / twin {rss['cached'] / rss['twin']:.3f}; the cache's tensors "
                      f"{cache['rank_bytes'] / 2**20:.2f} MB of its {cache['cap_bytes'] / 2**20:g} MB cap", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
