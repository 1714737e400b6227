"""Load: a given number of small requests in a row and 200 concurrent async ones; reports results and server memory."""

import json
import sys

import torch

from llmrl import Caller

if __name__ == "__main__":
    out, count = sys.argv[1], int(sys.argv[2])
    contexts, candidates = ["You see a wall 2 steps forward."], [[" turn left", " go forward"]]
    with Caller() as caller:
        reference = caller.score(contexts, candidates)[0]
        for _ in range(200):  # warm-up: allocator pools, kernels
            caller.score(contexts, candidates)
        memory = [caller.server_memory()]
        wrong = 0
        for i in range(count):
            wrong += not torch.equal(caller.score(contexts, candidates)[0], reference)
            if i + 1 in (count // 2, count):
                memory.append(caller.server_memory())
        prompts = [f"Context number {k}." for k in range(200)]
        # Each prompt alone, one request at a time, then all 200 in flight at once (alternating between
        # the two replicas); a batch of different shape could differ in the last bits, so compare to 1e-5.
        expected = [caller.score([p], [[" a", " b c"]])[0] for p in prompts]
        futures = [caller.score_async([p], [[" a", " b c"]]) for p in prompts]
        concurrent_wrong = sum(not torch.allclose(f.result()[0], e, rtol=0, atol=1e-5)
                               for f, e in zip(futures, expected))
        report = {"requests": count, "wrong": wrong, "concurrent": len(futures), "concurrent_wrong": concurrent_wrong,
                  "rss_mb": [{str(r): m["rss"] / 2**20 for r, m in snapshot.items()} for snapshot in memory]}
    with open(out, "w") as f:
        json.dump(report, f)
