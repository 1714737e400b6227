"""The client script of the two-node test (tests/test_two_hosts_live.py), run on rank 0 by `llmrl run`.

It scores the request of ``REQUEST`` (JSON: contexts, candidates and the update's per-sample batch) on
every LLM, trains LLMs that have an updater with one `update` call (weights before and after go to
``OUT.pt``), syncs the first trained LLM's weights into an LLM named ``sampler`` when there is one (the report
says whether the sampler then holds them), writes what it saw to ``OUT`` (JSON), and then keeps pinging every
server rank until one dies: the test kills a node's launcher at that point. The ``ServerDiedError`` it then
gets is written to ``OUT.died.json`` and re-raised, so the script (and the run) exits non-zero. If nothing dies
within ``--wait`` seconds it exits with code 3.

Usage: two_node_client.py OUT REQUEST [--wait SECONDS]
"""

import json
import os
import sys
import threading
import time


def write_json(path: str, data: dict) -> None:
    """Write atomically: the test waits for the file and must never read half of it."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    import torch

    from llmrl import Caller
    from llmrl.engine.errors import ServerDiedError

    out = sys.argv[1]
    with open(sys.argv[2]) as f:
        request = json.load(f)
    contexts, candidates, batch = request["contexts"], request["candidates"], request["batch"]
    wait = float(sys.argv[sys.argv.index("--wait") + 1]) if "--wait" in sys.argv else 120.0
    with Caller() as caller:
        report = {"client_pid": os.getpid(), "servers": {str(rank): info for rank, info in caller.servers().items()},
                  "scores": {}, "updated": [], "stats": {}}
        weights = {}
        for llm in caller.llms:
            report["scores"][llm] = [s.tolist() for s in caller.score(contexts, candidates, llm=llm)]
            if caller.config.llms[llm].updater is not None:
                before = caller.state_dict(llm=llm)
                stats = caller.update(contexts, candidates, llm=llm, **batch)
                weights[llm] = {"before": before, "after": caller.state_dict(llm=llm),
                                "replicas": [caller.state_dict(llm=llm, replica=r) for r in range(len(stats))]}
                report["updated"].append(llm)
                report["stats"][llm] = stats
        if "sampler" in caller.llms and report["updated"]:  # the trained weights sent to the sampler's ranks
            learner = report["updated"][0]
            synced = caller.sync_weights(learner, "sampler")
            held, after = caller.state_dict(llm="sampler"), weights[learner]["after"]
            report["synced"] = {"tensors": synced["tensors"], "policy_version": synced["policy_version"],
                                "equal": sorted(held) == sorted(after) and all(torch.equal(held[k], after[k])
                                                                               for k in after)}
        torch.save(weights, out + ".pt")
        write_json(out, report)
        deadline = time.monotonic() + wait
        try:
            while time.monotonic() < deadline:
                for rank in report["servers"]:
                    caller.ping(int(rank))
                threading.Event().wait(0.1)
        except ServerDiedError as err:
            write_json(out + ".died.json", {"type": type(err).__name__, "rank": err.rank, "message": str(err)})
            raise
    return 3


if __name__ == "__main__":
    sys.exit(main())
