"""The token-loss registry: one decorated function adds a loss that every caller (the configuration check, the
computation, the client's datum check, the Tinker service's name check) then serves; the views keep the tables
the registry replaced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine import token_losses
from llmrl.engine.token_losses import (
    OPTIONAL_INPUTS,
    REGISTRY,
    TOKEN_LOSSES,
    UNREAD_WHEN_ZERO,
    register_token_loss,
    token_loss,
    token_loss_settings,
)


@pytest.fixture
def toy_loss():
    """``toy``: ``-scale * weights * logp``, registered for the test and removed after."""

    @register_token_loss("toy", inputs=("weights",), config={"scale": 2.0}, optional_inputs=("bonus",),
                         unread_when_zero=("weights",))
    def toy(logprobs, inputs, settings):
        return -settings["scale"] * inputs["weights"] * logprobs

    yield "toy"
    del REGISTRY["toy"]


def test_a_registered_loss_is_served_everywhere(toy_loss):
    from llmrl.engine.tinker.params import check_loss, loss_inputs

    assert token_loss_settings(toy_loss, None) == {"scale": 2.0}
    assert token_loss_settings(toy_loss, {"scale": 3.0}) == {"scale": 3.0}
    with pytest.raises(ValueError, match="unknown key.*'beta'.*it takes \\['scale'\\]"):
        token_loss_settings(toy_loss, {"beta": 1.0})
    logp = torch.tensor([-1.0, -2.0])
    weights = torch.tensor([1.0, 0.5])
    assert torch.equal(token_loss(toy_loss, logp, {"weights": weights}), torch.tensor([2.0, 2.0]))
    assert torch.equal(token_loss(toy_loss, logp, {"weights": weights}, {"scale": 1.0}), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="'toy' needs the per-token input 'weights'"):
        token_loss(toy_loss, logp, {})
    check_loss(toy_loss)  # the Tinker service accepts its name
    assert set(loss_inputs(toy_loss, {"target_tokens": [1], "weights": [1.0], "bonus": [0.0], "x": [0.0]})) == {
        "target_tokens", "weights", "bonus"}
    assert TOKEN_LOSSES[toy_loss] == (("weights",), {"scale": 2.0})
    assert OPTIONAL_INPUTS[toy_loss] == ("bonus",) and UNREAD_WHEN_ZERO[toy_loss] == ("weights",)


def test_the_client_checks_a_registered_loss_by_its_declaration(toy_loss):
    from llmrl.engine.client.training_calls import ClientTraining
    from llmrl.engine.errors import InvalidArgument

    client = ClientTraining(SimpleNamespace(info={}), tracking=None)  # a part of the Caller, given what it reads
    datum = {"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.0]}}
    _, config = client._token_data("m", [datum], toy_loss, {"scale": 0.5})
    assert config == {"scale": 0.5}
    with pytest.raises(InvalidArgument, match="lacks 'weights', which this loss reads"):
        client._token_data("m", [{"model_input": [1], "loss_fn_inputs": {"target_tokens": [2]}}], toy_loss, None)


def test_an_unknown_loss_is_refused_with_the_registered_ones(toy_loss):
    from llmrl.engine.tinker.params import check_loss

    with pytest.raises(ValueError, match=r"unknown loss_fn 'nope'; the registered losses are \[.*'ppo'.*'toy'"):
        token_loss_settings("nope", None)
    with pytest.raises(ValueError, match=r"unknown loss_fn 'nope'.*'toy'"):
        token_loss("nope", torch.zeros(1), {})
    with pytest.raises(ValueError, match="'nope' is not supported; llmrl serves .*gspo, toy"):
        check_loss("nope")


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register_token_loss("ppo", inputs=())(lambda logprobs, inputs, settings: logprobs)
    assert REGISTRY["ppo"].compute is token_losses.ppo


def test_the_views_hold_the_tables_the_registry_replaced():
    assert dict(TOKEN_LOSSES) == {
        "cross_entropy": (("weights",), {}),
        "importance_sampling": (("logprobs", "advantages"), {}),
        "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        "dro": (("logprobs", "advantages"), {"beta": None}),
        "gspo": (("logprobs", "advantages", "sequence_ratio_mask"),
                 {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    }
    assert list(TOKEN_LOSSES) == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
    assert dict(OPTIONAL_INPUTS) == {name: ("clip_low_threshold", "clip_high_threshold")
                                     for name in ("ppo", "cispo", "gspo")}
    assert dict(UNREAD_WHEN_ZERO) == {"cross_entropy": ("weights",), "importance_sampling": ("advantages",),
                                      "ppo": ("advantages",), "cispo": ("advantages",),
                                      "gspo": ("advantages", "sequence_ratio_mask")}
    assert "dro" not in UNREAD_WHEN_ZERO and OPTIONAL_INPUTS.get("dro", ()) == ()
    with pytest.raises(TypeError):
        TOKEN_LOSSES["x"] = ((), {})  # read-only
    TOKEN_LOSSES["ppo"][1]["clip_low_threshold"] = 0.0  # a copy: the registry keeps its defaults
    assert token_loss_settings("ppo", None)["clip_low_threshold"] == 0.8


def test_another_package_adds_a_loss_with_one_module_and_one_entry_point(tmp_path, monkeypatch):
    """A module with the decorated function and one line in the package's entry points: the registry imports it on
    its first read, and the loss is then computed like a built-in one (here: ``-weights * logp`` by hand)."""
    from testkit.distributions import write_distribution

    site = tmp_path / "site"
    write_distribution(site, "fake-llmrl-losses", """
        [llmrl.token_losses]
        weighted_nll = fake_llmrl_losses:weighted_nll
    """)
    (site / "fake_llmrl_losses.py").write_text(
        "from llmrl.engine.token_losses import register_token_loss\n\n\n"
        "@register_token_loss('weighted_nll', inputs=('weights',))\n"
        "def weighted_nll(logprobs, inputs, settings):\n"
        "    return -inputs['weights'] * logprobs\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(REGISTRY, "_loaded", False)
    try:
        assert "weighted_nll" in TOKEN_LOSSES
        logprobs = torch.tensor([-0.5, -2.0])
        weights = torch.tensor([1.0, 0.25])
        assert torch.equal(token_loss("weighted_nll", logprobs, {"weights": weights}), torch.tensor([0.5, 0.5]))
    finally:
        if "weighted_nll" in REGISTRY:
            del REGISTRY["weighted_nll"]


def test_an_entry_point_that_does_not_register_its_loss_is_refused_naming_it(tmp_path, monkeypatch):
    from testkit.distributions import write_distribution

    site = tmp_path / "site"
    write_distribution(site, "fake-llmrl-bad-losses", """
        [llmrl.token_losses]
        forgotten = fake_llmrl_bad_losses:forgotten
    """)
    (site / "fake_llmrl_bad_losses.py").write_text("def forgotten(logprobs, inputs, settings):\n    return logprobs\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(REGISTRY, "_loaded", False)
    with pytest.raises(ValueError, match="'forgotten'.*not registered.*@register_token_loss"):
        list(REGISTRY)
