"""A client script for launch tests: scores one request and reports what it saw as JSON. With several LLMs, it
first closes every LLM but the first (``Caller.close_llm``) and reports what a call to a closed one raised."""

import json
import os
import sys

from llmrl import Caller

if __name__ == "__main__":
    out = sys.argv[1]
    with open(f"{out}.ran.{os.getpid()}", "w"):
        pass
    with Caller() as caller:
        closed = {}
        for name in caller.llms[1:]:
            caller.close_llm(name)
            try:
                caller.score(["a"], [["b"]], llm=name)
            except Exception as err:  # noqa: BLE001 - reported to the test
                closed[name] = f"{type(err).__name__}: {err}"
        scores = caller.score(["You see a wall"], [[" turn left", " go forward"]])
        report = {"argv": sys.argv, "scores": [s.tolist() for s in scores], "closed": closed,
                  "servers": {str(k): v for k, v in caller.servers().items()}}
    with open(out, "w") as f:
        json.dump(report, f)
    if len(sys.argv) > 2 and sys.argv[2] == "--exit":
        sys.exit(int(sys.argv[3]))
