"""ZeRO-3's gathered calls take DeepSpeed's hooks off for the call and put the very same ones back, in their
order among the modules' other hooks (in-process, on a plain module: the hooks are plain functions)."""

from __future__ import annotations

import torch

from llmrl.engine.model.zero3_gather import _CallPlan, _without_hooks


def test_removed_hooks_come_back_in_place_and_others_are_kept():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    calls = []
    ours = [model[0].register_forward_pre_hook(lambda m, a: calls.append("ours-pre"))]
    model[0].register_forward_hook(lambda m, a, out: calls.append("other"))
    ours.append(model[0].register_forward_hook(lambda m, a, out: calls.append("ours-post"), always_call=True))
    with _without_hooks(_CallPlan(model, ours)):
        model(torch.zeros(1, 2))
        assert calls == ["other"]
        added = model[1].register_forward_hook(lambda m, a, out: calls.append("added inside"))
    calls.clear()
    model(torch.zeros(1, 2))
    assert calls == ["ours-pre", "other", "ours-post", "added inside"]
    for handle in ours:  # the original handles still remove them
        handle.remove()
    added.remove()
    calls.clear()
    model(torch.zeros(1, 2))
    assert calls == ["other"]
    assert list(model[0]._forward_hooks_always_called) == []


def test_hooks_come_back_after_an_error():
    model = torch.nn.Linear(2, 2)
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append("ours"))
    try:
        with _without_hooks(_CallPlan(model, [handle])):
            raise RuntimeError("the call failed")
    except RuntimeError:
        pass
    model(torch.zeros(1, 2))
    assert calls == ["ours"]
