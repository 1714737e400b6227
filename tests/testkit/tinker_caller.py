"""A stand-in for the Caller behind a :class:`~llmrl.engine.tinker.service.TinkerService`, for the tests of the
service's request plumbing without a model: it notes every call that makes or changes state (``calls``), writes a
small folder for ``save_adapter`` and reads it back in ``load_adapter`` (raising as the real one does, naming the
folder, when it holds no state), and answers ``forward_backward`` / ``forward`` with fixed numbers.

It computes nothing; what the service's calls do to a model is checked by the live tests.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

STATE_FILE = "adapter_state.pt"  # the name the real save_adapter writes (adapter_state.STATE_FILE)


class FakeCaller:
    def __init__(self):
        self.llms = ["main"]
        self.info = {"main": {"adapters": ["default"], "max_length": 64, "kind": "causal"}}
        optimizer = SimpleNamespace(type="adamw")
        self.config = SimpleNamespace(llms={"main": SimpleNamespace(model="tiny", tokenizer=None, replicas=1,
                                                                    training=SimpleNamespace(optimizer=optimizer))})
        self.calls: list[tuple] = []  # (method, the adapter or folder it acted on)

    def create_adapter(self, name, *, rank, seed, targets, llm):
        self.calls.append(("create_adapter", name))

    def load_adapter(self, path, name, *, optimizer=True, llm=None):
        folder = os.path.abspath(os.fspath(path))
        if not os.path.isfile(os.path.join(folder, STATE_FILE)):
            raise FileNotFoundError(f"{folder} holds no adapter state ({STATE_FILE}); save one with save_adapter")
        self.calls.append(("load_adapter", folder))
        return {"adapter": name, "path": folder, "created": True, "optimizer_state": optimizer, "rank": 4}

    def save_adapter(self, path, *, peft_adapter, llm):
        os.makedirs(path)
        with open(os.path.join(path, STATE_FILE), "w") as f:
            f.write(peft_adapter)
        self.calls.append(("save_adapter", peft_adapter))

    def forward_backward(self, data, loss_fn, config=None, *, llm, peft_adapter):
        self.calls.append(("forward_backward", peft_adapter))
        return _outputs(data)

    def forward(self, data, loss_fn="cross_entropy", config=None, *, llm, peft_adapter):
        self.calls.append(("forward", peft_adapter))
        return _outputs(data)

    def optim_step(self, params, *, llm, peft_adapter):
        self.calls.append(("optim_step", peft_adapter))
        return {"grad_norm": 1.0}

    def snapshot(self, name, *, llm, peft_adapter):
        self.calls.append(("snapshot", name))

    def drop_snapshot(self, name, *, llm):
        self.calls.append(("drop_snapshot", name))

    def count(self, method: str) -> int:
        return sum(1 for called, _ in self.calls if called == method)


def _outputs(data) -> dict:
    """Fixed outputs of a forward (log-prob -1 at every position)."""
    outputs = [{"logprobs": [-1.0] * len(d["model_input"])} for d in data]
    return {"loss_fn_outputs": outputs, "metrics": {"loss:sum": float(len(data))}}


def fake_service(save_dir: str):
    """A TinkerService on a :class:`FakeCaller`, saving under ``save_dir``; returns ``(service, caller)``."""
    from llmrl.engine.tinker.service import TinkerService

    caller = FakeCaller()
    return TinkerService(caller, save_dir=save_dir, poll_wait=0.1), caller
