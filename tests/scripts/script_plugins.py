"""A client script that defines its own head (servers import this file as a module to find it)."""

import json
import os
import sys

import torch

from llmrl import Caller
from llmrl.plugins import Head

OUT = os.environ["LLMRL_TEST_OUT"]
with open(f"{OUT}.imported.{os.getpid()}", "w"):  # top-level code runs wherever the script is imported
    pass


class ScriptHead(Head):
    """Returns its ``value`` argument for every context."""

    def __init__(self, llm, value: float = 0.0):
        super().__init__(llm)
        self.value = value
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, outputs):
        return torch.full((outputs.num_contexts,), float(self.value)) + 0 * self.unused


if __name__ == "__main__":
    with open(f"{OUT}.main.{os.getpid()}", "w"):
        pass
    with Caller(heads={"from_caller": (ScriptHead, {"value": 4.0})}) as caller:
        out = caller.custom_module_fns(["from_config", "from_caller"], ["a context", "another"])
        print(json.dumps([{k: v.tolist() for k, v in o.items()} for o in out]))
    sys.exit(0)
