"""The ``adapters`` request kind dispatches each operation explicitly: every known operation reaches its own
handler, and an unknown one is refused, on the client before anything is sent and on the server before anything
changes (it never falls through to deleting the adapter). In-process, no launch: the handlers' work functions are
replaced by recorders."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.model import adapter_operations, snapshots
from llmrl.engine.model.hf_backend import HFBackend
from llmrl.engine.model.training import adapter_state, new_adapters
from llmrl.engine.requests import adapters as kind

WORK = {  # operation -> (module, function its handler calls)
    "snapshot": (snapshots, "take_snapshot"),
    "drop_snapshot": (snapshots, "drop_snapshot"),
    "create_adapter": (new_adapters, "create_adapter"),
    "delete_adapter": (new_adapters, "delete_adapter"),
    "save_adapter": (adapter_state, "save_adapter"),
    "load_adapter": (adapter_state, "load_adapter"),
}
ARGS = {"snapshot": {"source": None}, "create_adapter": {"rank": 4, "alpha": None, "seed": 0, "targets": None},
        "save_adapter": {"path": "/nowhere"}, "load_adapter": {"path": "/nowhere", "optimizer": True}}


@pytest.fixture
def calls(monkeypatch):
    """The work functions, replaced by recorders of which one ran."""
    made = []
    for operation, (module, function) in WORK.items():
        monkeypatch.setattr(module, function,
                            lambda *args, _op=operation, **kwargs: made.append(_op) or {"ran": _op})
    return made


def backend():
    """An HFBackend's state as far as ``manage_adapters`` reads it (no model is loaded)."""
    return SimpleNamespace(served=object(), prefix_cache=None)


def test_the_client_and_the_server_know_the_same_operations():
    assert tuple(adapter_operations.HANDLERS) == kind.OPERATIONS
    assert set(WORK) == set(kind.OPERATIONS)


@pytest.mark.parametrize("operation", kind.OPERATIONS)
def test_each_known_operation_reaches_its_own_handler(calls, operation):
    answer = HFBackend.manage_adapters(backend(), operation, "a", ARGS.get(operation, {}))
    assert answer == {"ran": operation} and calls == [operation]


@pytest.mark.parametrize("operation", ["delete", "Delete_adapter", "", None, 3, "snapshots"])
def test_an_unknown_operation_is_refused_by_the_server_and_deletes_nothing(calls, operation):
    with pytest.raises(InvalidArgument, match="operation must be one of") as raised:
        HFBackend.manage_adapters(backend(), operation, "a", {})
    assert all(known in str(raised.value) for known in kind.OPERATIONS)
    assert calls == []


def test_the_request_handler_refuses_an_unknown_operation_before_the_backend(calls):
    seen = []
    replica = SimpleNamespace(answers=True, backend=SimpleNamespace(
        manage_adapters=lambda *args: seen.append(args) or HFBackend.manage_adapters(backend(), *args)))
    with pytest.raises(InvalidArgument, match="operation must be one of"):
        kind.handle(replica, kind.AdapterRequest("undo", "a", {}))
    assert seen == [] and calls == []
    assert kind.handle(replica, kind.AdapterRequest("delete_adapter", "a", {})) == {"ran": "delete_adapter"}
    assert calls == ["delete_adapter"]


def test_the_client_refuses_an_unknown_operation_before_sending():
    sent = []
    run = SimpleNamespace(replicas=lambda llm: [[1]], submit=lambda *args: sent.append(args))
    with pytest.raises(InvalidArgument, match="operation must be one of .*delete_adapter.*, got 'undo'"):
        kind.send(run, "policy", kind.AdapterRequest("undo", "a", {}))
    assert sent == []
    kind.send(run, "policy", kind.AdapterRequest("delete_adapter", "a", {}))
    assert len(sent) == 1
