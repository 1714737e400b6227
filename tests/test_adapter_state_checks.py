"""A damaged or crafted adapter state is refused before anything changes, naming the field: moments of another
shape or dtype, step counts below 1, negative second moments, non-finite weights or moments, another optimizer's
state. A state as torch's own AdamW keeps it passes, and loads into an optimizer whose next step equals that of the
optimizer it was saved from."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.model.training.adapter_state_checks import check_against, check_values, loaded

HOW = {"rank": 2, "alpha": 4.0, "seed": 0, "targets": ["q_proj"], "dropout": 0.0}


def trained_state():
    """A weight stepped twice by plain AdamW, its state saved as save_adapter saves it; and that optimizer."""
    w = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(2):
        w.grad = torch.ones_like(w)
        optimizer.step()
    saved = {k: v.detach().clone() for k, v in optimizer.state[w].items()}
    return {"weights": {"w": w.detach().clone()}, "optimizer": {"w": saved}, "how": dict(HOW)}, w, optimizer


def refused(state, params, optimizer, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_values(state, "saved", optimizer=True)
        check_against(state, params, optimizer, "saved")


def test_a_state_saved_from_plain_adamw_passes_and_steps_on_as_the_original():
    state, w, original = trained_state()
    here = torch.nn.Parameter(state["weights"]["w"].clone())
    optimizer = torch.optim.AdamW([here], lr=1e-2)
    check_values(state, "saved", optimizer=True)
    check_against(state, {"w": here}, optimizer, "saved")
    optimizer.state[here] = {k: loaded(v, k, here.device) for k, v in state["optimizer"]["w"].items()}
    for p, opt in ((w, original), (here, optimizer)):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    assert torch.equal(here, w)  # the third step, as the original optimizer took it


def test_each_damaged_or_crafted_field_is_refused_naming_it():
    state, w, optimizer = trained_state()
    params = {"w": torch.nn.Parameter(w.detach().clone())}
    here = torch.optim.AdamW(params.values(), lr=1e-2)
    cases = [
        (("optimizer", "w", "exp_avg"), torch.zeros(1), r"optimizer\['w'\]\['exp_avg'\] has shape \[1\], and the "
                                                        r"weight it belongs to \[4, 6\]"),
        (("optimizer", "w", "step"), torch.tensor(-1.0), r"optimizer\['w'\]\['step'\] must be a whole number >= 1.* "
                                                         r"got -1; .*optimizer=False"),
        (("optimizer", "w", "step"), torch.tensor(0.0), r"\['step'\] must be a whole number >= 1"),
        (("optimizer", "w", "step"), 2.5, r"\['step'\] must be a whole number >= 1.* got 2.5"),
        (("optimizer", "w", "exp_avg_sq"), torch.ones(4, 6, dtype=torch.bfloat16),
         r"optimizer\['w'\]\['exp_avg_sq'\] is torch.bfloat16, and the weight it belongs to torch.float32"),
        (("optimizer", "w", "exp_avg"), torch.full((4, 6), float("nan")),
         r"optimizer\['w'\]\['exp_avg'\] holds a value that is not finite \(nan\)"),
        (("optimizer", "w", "exp_avg_sq"), -torch.ones(4, 6), r"\['exp_avg_sq'\] holds a negative value"),
        (("optimizer", "w", "momentum_buffer"), torch.zeros(4, 6),
         r"optimizer\['w'\] holds \['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step'\], and this LLM's "
         r"optimizer \(AdamW\) keeps \['exp_avg', 'exp_avg_sq', 'step'\]"),
        (("weights", "w"), torch.full((4, 6), float("inf")), r"weights\['w'\] holds a value that is not finite "
                                                             r"\(inf\); the file is damaged"),
        (("weights", "w"), torch.ones(4, 6, dtype=torch.int64), r"weights\['w'\] must be a floating-point tensor"),
        (("how", "rank"), -3, r"how\['rank'\] must be a positive int, got -3"),
        (("optimizer", "ghost"), {}, r"optimizer\['ghost'\] belongs to no saved weight"),
    ]
    for (part, *keys), value, match in cases:
        bad = copy.deepcopy(state)
        target = bad[part]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        refused(bad, params, here, match)
    sgd = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"keeps \['momentum_buffer'\]: it was saved by another kind of optimizer"):
        check_against(state, params, sgd, "saved")
    moments_only = copy.deepcopy(state)
    moments_only["optimizer"]["w"]["step"] = torch.tensor(-1.0)
    check_values(moments_only, "saved", optimizer=False)  # not loaded: not in the way of the weights
