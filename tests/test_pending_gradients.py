"""Which pending gradients a failed call discards (``client_steps._discard``), in process with a real torch
optimizer whose groups belong to adapters: under ZeRO 0 the failed call's adapter's only, the others' kept on their
parameters; under ZeRO 1-3 every adapter's, each other adapter told once at its next call; a failed step of every
adapter (``optim_step()`` without one) discards all and tells no one, since the failure was each one's own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.model.served_state import PendingGradients, RunTimeAdapters
from llmrl.engine.model.training import client_steps
from llmrl.engine.model.training.optimizer import ADAPTER_KEY


def served_with(zero_stage: int):
    params = {name: torch.nn.Parameter(torch.ones(3)) for name in ("a", "b")}
    for p in params.values():
        p.grad = torch.full((3,), 2.0)
    optimizer = torch.optim.AdamW([{"params": [p], ADAPTER_KEY: name} for name, p in params.items()])
    served = SimpleNamespace(pending=PendingGradients(backwards=3, adapters={"a": 1, "b": 2}),
                             adapter_steps=SimpleNamespace(optimizer=optimizer),
                             engine=SimpleNamespace(optimizer=optimizer),
                             llm=SimpleNamespace(training=SimpleNamespace(zero_stage=zero_stage)),
                             run_time=RunTimeAdapters())

    def discard_partial_accumulation():  # as the trainer's: every gradient on every parameter goes
        for p in params.values():
            p.grad = None

    return served, SimpleNamespace(discard_partial_accumulation=discard_partial_accumulation), params


def test_under_zero_0_a_failed_call_discards_its_own_adapters_gradients_only():
    served, trainer, params = served_with(0)
    note = client_steps._discard(served, trainer, "b")
    assert "2 earlier forward_backward call(s) of adapter 'b'" in note and "those of ['a'] are kept" in note
    assert params["b"].grad is None and torch.equal(params["a"].grad, torch.full((3,), 2.0))
    assert served.pending.adapters == {"a": 1} and served.pending.backwards == 1 and served.pending.discarded == {}


def test_under_zero_2_every_adapters_go_and_each_other_one_is_told_once():
    served, trainer, params = served_with(2)
    client_steps._discard(served, trainer, "b")
    assert params["a"].grad is None and served.pending.adapters == {} and served.pending.backwards == 0
    client_steps._refuse_discarded(served, ["b"])  # the failed call's own adapter was told by its error
    with pytest.raises(ValueError, match="adapter 'a''s 1 forward_backward call.* discarded when a call on adapter "
                                         "'b'"):
        client_steps._refuse_discarded(served, ["a"])
    client_steps._refuse_discarded(served, ["a"])  # once


def test_a_failed_step_of_every_adapter_discards_all_and_tells_no_one_later():
    """It said 'no gradient of adapter None was pending' and refused each adapter's next call."""
    for zero_stage in (0, 2):
        served, trainer, params = served_with(zero_stage)
        note = client_steps._discard(served, trainer, None)
        assert note.startswith("the gradients of the 3 earlier forward_backward call(s)")
        assert all(p.grad is None for p in params.values()) and served.pending.adapters == {}
        assert served.pending.discarded == {}


def test_a_call_of_several_adapters_holds_their_earlier_gradients_apart():
    """A call of adapters a and b (each steppable alone): inside, their pending gradients are off the parameters; a
    success adds the call's gradients to them, a failure discards the call's alone and keeps the earlier ones (and
    their pending counts)."""
    served, trainer, params = served_with(0)
    with client_steps.set_aside(served, ("a", "b"), added_back=True):
        assert all(p.grad is None for p in params.values())
        for p in params.values():
            p.grad = torch.full((3,), 0.5)  # this call's
    assert all(torch.equal(p.grad, torch.full((3,), 2.5)) for p in params.values())
    served, trainer, params = served_with(0)
    with pytest.raises(RuntimeError, match="out of memory"), \
            client_steps.set_aside(served, ("a", "b"), added_back=True):
        params["a"].grad = torch.full((3,), 0.5)
        try:
            raise RuntimeError("out of memory")
        except RuntimeError:
            note = client_steps._discard_call(served, trainer, ("a", "b"))
            raise
    assert "this call's gradients were discarded" in note and "['a', 'b'] are kept" in note
    assert all(torch.equal(p.grad, torch.full((3,), 2.0)) for p in params.values())
    assert served.pending.adapters == {"a": 1, "b": 2} and served.pending.backwards == 3


def test_a_failed_call_of_several_adapters_names_them_all():
    served, trainer, params = served_with(2)
    note = client_steps._discard(served, trainer, ("a", "b"))
    assert "of adapters ['a', 'b']" in note and served.pending.adapters == {} and served.pending.discarded == {}
