"""Activation checkpointing (engine/model/training/checkpointing.py) in-process, against the same model without it:
the gradients of a pass that reads a key/value cache written with gradients (a context, then its continuation
attending to the context's cache, as llmrl's unpacked passes run) equal plain autograd's to 1e-6 in float32, the
layers are really recomputed, and passes without gradients run as they are."""

from __future__ import annotations

import copy

import pytest
import torch


def two_passes(model, ids: torch.Tensor, cut: int) -> torch.Tensor:
    """A loss from a context pass with gradients, then a continuation pass that reads its cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    first = model(input_ids=ids[:, :cut], past_key_values=cache, use_cache=True)
    second = model(input_ids=ids[:, cut:], past_key_values=cache, use_cache=True)
    logits = torch.cat([first.logits, second.logits], 1)[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])
    return -(logp.squeeze(-1) * torch.linspace(0.5, 1.5, ids.shape[1] - 1)).sum()


def gradients(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_checkpointed_gradients_equal_plain_gradients_through_a_cache(reference_models, kind):
    from llmrl.engine.model.training.checkpointing import checkpointable_layers, enable_checkpointing

    model, _ = reference_models[kind]
    plain = copy.deepcopy(model).float().eval()
    for p in plain.parameters():
        p.requires_grad_(True)
    checked = copy.deepcopy(plain)
    calls = []
    first_layer = checkpointable_layers(checked)[0]
    inner = first_layer.forward  # counted under the checkpointing wrapper: recomputations run it again
    first_layer.forward = lambda *a, **k: (calls.append(torch.is_grad_enabled()), inner(*a, **k))[1]
    assert enable_checkpointing(checked) == len(checkpointable_layers(checked)) > 0, "every layer is trained"
    ids = torch.randint(3, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    two_passes(plain, ids, 6).backward()
    loss = two_passes(checked, ids, 6)
    forward_calls = len(calls)
    loss.backward()
    assert forward_calls == 2 and len(calls) == 4, "each pass's layer ran once forward and once again in backward"
    want, got = gradients(plain), gradients(checked)
    assert want.keys() == got.keys() and len(want) > 4
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(checked(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_only_the_layers_from_the_first_trained_one_up_are_checkpointed(reference_models):
    from peft import LoraConfig, get_peft_model

    from llmrl.engine.model.training.checkpointing import checkpointable_layers, trained_layers

    model, _ = reference_models["llama"]
    base = copy.deepcopy(model)
    layers = checkpointable_layers(base)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[len(layers) - 1]))
    assert trained_layers(peft) == layers[-1:]
    frozen = copy.deepcopy(model).requires_grad_(False)
    assert trained_layers(frozen) == []


def test_a_cache_the_checkpointing_cannot_restore_is_refused_by_name():
    from llmrl.engine.model.training.checkpointing import cache_restorer

    with pytest.raises(TypeError, match="cannot restore a tuple key/value cache.*gradient_checkpointing to false"):
        cache_restorer(((torch.zeros(1),),))
