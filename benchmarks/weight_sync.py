"""The two routes of ``Caller.sync_weights`` side by side, in one run: ``via="client"`` (the learner's weights come
to rank 0's client and go from it to each rank of the sampler) and ``via="group"`` (the learner's group leader sends
them straight to each sampler rank over a gloo group of the two; the client relays only their layout and
digest).

    .venv/bin/python -m benchmarks.weight_sync                   # SmolLM2-135M-Instruct on CPU
    .venv/bin/python -m benchmarks.weight_sync --model tiny      # the tiny random model (seconds; a smoke run)

Two pairs of LLMs serve the same model: ``learner`` (LoRA r=16 on every linear layer, trainable) and ``sampler``
(the same adapter, ``--sampler-replicas`` replicas) sync one adapter; ``full`` (no LoRA, trainable) and
``sampler_full`` (one replica) sync the whole model. After one untimed sync of each route (the group forms on
the first), each repetition times one ``sync_weights_async`` by each route, alternated, from this process (each
figure holds one round trip to the run's client process): until it returned (the learner's weights read and sent:
the learner and the client are free again) and until the sampler answered; it then checks that the sampler holds
the learner's weights. It prints the medians, the bytes synced and the ratios, and writes ``--out`` (JSON) when
given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.kit import claim_results_file, testkit
from llmrl.engine.provenance import run_provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="a model, or 'tiny'")
    parser.add_argument("--sampler-replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    mark = claim_results_file(args.out, "weight_sync") if args.out else {}
    kit = testkit()
    model = kit.tiny_model("llama") if args.model == "tiny" else args.model
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 16}}}}  # on every linear layer
    adam = {"optimizer": {"type": "adam", "lr": 1e-3}}
    llms = {"learner": {"model": model, "initializers": [lora], "trainable": True, "training": adam},
            "sampler": {"model": model, "initializers": [lora], "replicas": args.sampler_replicas},
            "full": {"model": model, "trainable": True, "training": adam},
            "sampler_full": {"model": model}}
    rows = {}
    with kit.LiveRun({"llms": llms, "threads_per_rank": 1}) as run:
        for what, source, target in (("adapter", "learner", "sampler"), ("whole model", "full", "sampler_full")):
            times = {"client": [], "group": []}
            for via in times:  # untimed: the group forms on its first sync
                synced = run.sync_weights(source, target, via=via)
            for _ in range(args.repeats):
                for via in times:
                    times[via].append(timed_sync(run, source, target, via))
            synced = times["group"][-1]["answer"]
            held = run.state_dict(llm=target)
            learner = run.state_dict(llm=source)
            assert all(k not in held or bool((held[k] == v).all()) for k, v in learner.items()), "weights differ"
            row = {"bytes": synced["bytes"], "tensors": synced["tensors"],
                   "target_ranks": args.sampler_replicas if what == "adapter" else 1}
            for key in ("returned_s", "answered_s"):
                client, group = (statistics.median(t[key] for t in times[via]) for via in ("client", "group"))
                row[key] = {"client": client, "group": group, "group_over_client": group / client}
            rows[what] = row
    print(f"{args.model}: median of {args.repeats} syncs each, alternated; seconds until sync_weights_async "
          "returned (the learner and the client free again) and until the sampler answered")
    for what, row in rows.items():
        print(f"  {what} ({row['bytes'] / 2**20:.1f} MiB to {row['target_ranks']} rank(s)):")
        for key, label in (("returned_s", "returned"), ("answered_s", "answered")):
            r = row[key]
            print(f"    {label:8s}  via client {r['client']:7.3f} s, via group {r['group']:7.3f} s   "
                  f"({r['group_over_client']:.2f}x the client's)")
    if args.out:
        record = {**mark, "provenance": run_provenance(), "model": args.model, "repeats": args.repeats, "rows": rows}
        with open(args.out, "w") as f:  # (opened after the provenance: an emptied results file is a change)
            json.dump(record, f, indent=2)


def timed_sync(run, source: str, target: str, via: str) -> dict:
    """One ``sync_weights_async`` by route ``via``: seconds until it returned (the learner and the client free
    again) and until the target answered, each with one round trip to the run's client process (the same for
    both routes)."""
    start = time.perf_counter()
    run.function("testkit.weight_sync:send_sync", source, target, via)
    returned = time.perf_counter() - start
    answer = run.function("testkit.weight_sync:sync_answer", source, target)
    return {"returned_s": returned, "answered_s": time.perf_counter() - start, "answer": answer}


if __name__ == "__main__":
    main()
