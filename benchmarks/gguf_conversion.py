"""Converting a GGUF builtin model (``builtin:smollm2-135m-instruct``) with the GGUF file parsed once
(:func:`llmrl.engine.model.store.gguf_parsing.parsed_once`) against transformers' own three parses, each in a fresh
process of its own, in one run.

    .venv/bin/python -m benchmarks.gguf_conversion

Each child runs the conversion's reading part (:func:`llmrl.engine.model.store.builtin_models._from_gguf`: the
tokenizer and the dequantised model), with or without the memoization, and reports its CPU and wall seconds after
its imports. The parent prints both rows, their ratio, and whether both children built equal weights and the same
vocabulary. It writes nothing but a temporary folder, removed after.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time

NAME = "smollm2-135m-instruct"


def child(parsed_once_on: bool) -> dict:
    import hashlib

    import torch  # noqa: F401 - imported before the clock starts, as transformers is
    import transformers  # noqa: F401

    from llmrl.engine.model.store import builtin_models, gguf_parsing

    if not parsed_once_on:
        gguf_parsing.parsed_once = contextlib.nullcontext
    with tempfile.TemporaryDirectory() as staging:
        wall, cpu = time.perf_counter(), time.process_time()
        model, tokenizer, _ = builtin_models._from_gguf(NAME, builtin_models.Path(staging))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.numpy().tobytes())
    return {"wall_s": wall, "cpu_s": cpu, "weights": digest.hexdigest(), "vocab": len(tokenizer)}


def main() -> None:
    rows = {}
    for label, on in (("transformers alone (three parses)", False), ("parsed once", True)):
        out = subprocess.run([sys.executable, "-m", "benchmarks.gguf_conversion", "--child", str(int(on))],
                             capture_output=True, text=True, check=True).stdout
        rows[label] = json.loads(out.strip().splitlines()[-1])
        print(f"{label:36s} {rows[label]['cpu_s']:6.1f} CPU-s  {rows[label]['wall_s']:6.1f} s wall", flush=True)
    before, after = rows.values()
    print(f"ratio (transformers alone / parsed once): {before['cpu_s'] / after['cpu_s']:.2f}x CPU, "
          f"{before['wall_s'] / after['wall_s']:.2f}x wall; same weights: {before['weights'] == after['weights']}, "
          f"same vocabulary: {before['vocab'] == after['vocab']}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2] == "1")))
    else:
        main()
