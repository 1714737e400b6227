"""Every adapter operation is a request kind of its own (``engine/requests/adapters/``): each one's handler reaches
its own work function, with the payload's fields, through the backend method of its name; the client sends each to
every rank; and the server refuses an unknown kind, or a payload of another kind, before anything changes (no
operation is ever a fallback for another). In-process, no launch: the work functions are replaced by recorders."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from llmrl.engine.model import snapshots
from llmrl.engine.model.hf_backend import HFBackend
from llmrl.engine.model.training import adapter_state, new_adapters
from llmrl.engine.requests import KINDS
from llmrl.engine.requests.adapters import (
    create_adapter,
    delete_adapter,
    drop_snapshot,
    load_adapter,
    save_adapter,
    snapshot,
)
from llmrl.engine.server.serve import Server
from llmrl.engine.transport.messages import Request

SERVED, CACHE = object(), object()
CASES = {  # kind -> (its module, a payload, the work function its backend method calls, the arguments it gets)
    "snapshot": (snapshot, snapshot.SnapshotRequest("s", "a"), (snapshots, "take_snapshot"),
                 ((SERVED, "s", "a", CACHE), {})),
    "drop_snapshot": (drop_snapshot, drop_snapshot.DropSnapshotRequest("s"), (snapshots, "drop_snapshot"),
                      ((SERVED, "s", CACHE), {})),
    "create_adapter": (create_adapter, create_adapter.CreateAdapterRequest("b", 4, None, 7, "mlp"),
                       (new_adapters, "create_adapter"),
                       ((SERVED, "b", 4, None, 7, "mlp"), {"prefix_cache": CACHE})),
    "delete_adapter": (delete_adapter, delete_adapter.DeleteAdapterRequest("b"), (new_adapters, "delete_adapter"),
                       ((SERVED, "b", CACHE), {})),
    "save_adapter": (save_adapter, save_adapter.SaveAdapterRequest(None, "/nowhere"), (adapter_state, "save_adapter"),
                     ((SERVED, None, "/nowhere"), {})),
    "load_adapter": (load_adapter, load_adapter.LoadAdapterRequest("b", "/nowhere", False),
                     (adapter_state, "load_adapter"), ((SERVED, "b", "/nowhere", False, CACHE), {})),
}


@pytest.fixture
def calls(monkeypatch):
    """The work functions, replaced by recorders of which one ran and with what."""
    made = []
    for name, (_, _, (module, function), _) in CASES.items():
        monkeypatch.setattr(module, function,
                            lambda *args, _name=name, **kwargs: made.append((_name, args, kwargs)) or {"ran": _name})
    return made


def replica():
    """A replica whose backend is an HFBackend's state as far as the adapter methods read it (no model loaded)."""
    backend = SimpleNamespace(served=SERVED, prefix_cache=CACHE)
    methods = {name: (lambda request, _name=name: getattr(HFBackend, _name)(backend, request)) for name in CASES}
    return SimpleNamespace(answers=True, ready=True, handled=Counter(), device=SimpleNamespace(type="cpu"),
                           backend=SimpleNamespace(**methods))


def test_each_operation_is_a_kind_of_its_own_named_in_kinds():
    for name, (module, payload, _, _) in CASES.items():
        assert KINDS[name] is module.KIND and isinstance(payload, module.KIND.payload)
        assert module.KIND.backend_method == name
    assert "adapters" not in KINDS  # no kind carries an operation string any more


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_kind_reaches_its_own_work_function_with_the_payloads_fields(calls, name):
    module, payload, _, (args, kwargs) = CASES[name]
    assert module.handle(replica(), payload) == {"ran": name}
    assert calls == [(name, args, kwargs)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_client_sends_each_kind_to_every_rank_and_returns_the_first_replicas_answer(name):
    module, payload, _, _ = CASES[name]
    sent = []
    run = SimpleNamespace(replicas=lambda llm: [[1, 2], [3, 4]], submit=lambda *args: sent.append(args))
    module.send(run, "policy", payload)
    [(kind, parts, assemble)] = sent
    assert kind == name and parts == [([1, 2], payload), ([3, 4], payload)]
    assert assemble({1: "first", 3: "second"}) == "first"


def _dispatch(kind: str, payload):
    server = SimpleNamespace(replica=replica(), role=SimpleNamespace(global_rank=1))
    return Server._dispatch(server, Request(1, kind, payload))


@pytest.mark.parametrize("kind", ["adapters", "delete", "Delete_adapter", "", "snapshots"])
def test_the_server_refuses_an_unknown_kind_and_deletes_nothing(calls, kind):
    with pytest.raises(ValueError, match=f"unknown request kind {kind!r}; this server knows .*'delete_adapter'"):
        _dispatch(kind, delete_adapter.DeleteAdapterRequest("b"))
    assert calls == []


def test_the_server_refuses_a_payload_of_another_kind_and_deletes_nothing(calls):
    with pytest.raises(TypeError, match="a 'delete_adapter' request carries a DeleteAdapterRequest, got Drop"):
        _dispatch("delete_adapter", drop_snapshot.DropSnapshotRequest("b"))
    assert calls == []
    assert _dispatch("delete_adapter", delete_adapter.DeleteAdapterRequest("b")) == {"ran": "delete_adapter"}
    assert [call[0] for call in calls] == ["delete_adapter"]


def test_a_new_adapter_over_a_frozen_trunk_takes_the_layers_above_it_and_refuses_those_below(reference_models):
    """``above_trunk`` on the tiny Llama (2 layers) with the trunk ending at layer 1: the default targets are the
    attention and MLP linears of layer 1 only, ``unembed`` the output layer, a full module name above the trunk is
    kept, and a name that reaches layer 0 (``q_proj`` names both layers' q_proj) is refused naming the module."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(reference_models["llama"][0]),
                           LoraConfig(r=2, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]))
    chosen = new_adapters.above_trunk(model, None, 1, "LLM 'p'")
    assert chosen and all(".layers.1." in name for name in chosen), chosen
    everything = new_adapters.target_modules(model, ["attention", "mlp"])
    assert sorted(chosen) == sorted(n for n in everything if ".layers.1." in n)  # none of layer 1 left out
    assert new_adapters.above_trunk(model, ["unembed"], 1, "LLM 'p'") == ["lm_head"]
    assert new_adapters.above_trunk(model, ["layers.1.mlp.up_proj"], 1, "LLM 'p'") == ["layers.1.mlp.up_proj"]
    with pytest.raises(ValueError, match=r"LLM 'p': model\.layers\.0\.self_attn\.q_proj is in layer 0, below layer 1"):
        new_adapters.above_trunk(model, ["q_proj"], 1, "LLM 'p'")
