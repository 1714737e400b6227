"""Frozen-trunk reuse (issue 14): the updater's passes replayed through the trainable top layers from states
recorded while scoring give the same scores, hidden states and gradients as whole passes, whatever the
batching of either; calls whose tokens were never scored run whole; a model whose every layer adapts has no trunk.

Reference: the same pipeline run without a trunk on an identical PEFT model (itself equal to plain Hugging Face
per ``test_scoring``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from llmrl.engine.model.reuse.trunk import Trunk, trunk_depth
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
from llmrl.engine.model.scoring.tokenization import tokenize

CONTEXTS = ["Goal: go to the red ball. You see a wall 2 steps forward.", "Goal: go to the red ball. You see a key.",
            "Goal: open the door. The door is locked.", "x x x"]
CANDIDATES = [[" turn left", " turn right", " go forward"], [" pick up", " drop"], [" toggle", " go back", " wait"],
              [" a", " b c"]]


@pytest.fixture
def lora_top(reference_models):
    """The tiny Llama (2 layers) with LoRA on its top layer only."""
    from peft import LoraConfig, get_peft_model

    model, tok = reference_models["llama"]
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1])
    peft = get_peft_model(copy.deepcopy(model), config)
    for name, p in peft.named_parameters():
        if "lora_B" in name:  # non-zero, so that the adapter changes the top layer's output
            torch.nn.init.normal_(p, std=0.1)
    return peft, tok


def run(model, tok, needs, budget, rows, trunk=None, mode=None, contexts=CONTEXTS, candidates=CANDIDATES,
        packed=False):
    plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
    results = []
    with trunk.active(mode) if trunk else contextlib.nullcontext():
        for batch in plan_batches(plan, budget, rows, needs, packed=packed):
            results.append((batch.contexts, run_batch(model, plan, batch, needs, tok.pad_token_id, "cpu",
                                                      accepts_logits_to_keep(model), trunk=trunk)))
    return results


def loss_and_grads(model, results):
    loss = sum(r.scores.sum() + (r.context_hidden[-1].sum() if r.context_hidden else 0) for _, r in results)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads


@pytest.mark.parametrize("record,replay", [((8192, 64), (8192, 64)), ((8192, 64), (90, 3)), ((90, 3), (8192, 64))],
                         ids=["same-batching", "replay-split", "record-split"])
@pytest.mark.parametrize("packed", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["chunked", "packed", "record-packed", "replay-packed"])
def test_replayed_passes_equal_whole_passes(lora_top, record, replay, packed):
    model, tok = lora_top
    assert trunk_depth(model) == 1
    needs = Needs(context_hidden=True)
    trunk = Trunk(model, 1, 2**30)
    with torch.no_grad():
        run(model, tok, needs, *record, trunk=trunk, mode="record", packed=packed[0])
    replayed = run(model, tok, needs, *replay, trunk=trunk, mode="replay", packed=packed[1])
    assert trunk.replayed_calls > 0 and trunk.whole_calls == 0
    whole = run(model, tok, needs, *replay, packed=packed[1])
    for (_, a), (_, b) in zip(replayed, whole):
        torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-6)  # (float32 sums of order 40)
        torch.testing.assert_close(a.context_hidden[-1], b.context_hidden[-1], atol=1e-5, rtol=0)
    loss_a, grads_a = loss_and_grads(model, replayed)
    loss_b, grads_b = loss_and_grads(model, whole)
    torch.testing.assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-6)  # a sum of ~250 in float32
    assert any(float(g.abs().max()) > 1e-3 for g in grads_b)
    for a, b in zip(grads_a, grads_b):  # states recorded by calls of other shapes: float32 rounding of ~1e-5
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_calls_whose_tokens_were_never_scored_run_whole_and_are_recorded(lora_top):
    model, tok = lora_top
    trunk = Trunk(model, 1, 2**30)
    with torch.no_grad():
        run(model, tok, Needs(), 8192, 64, trunk=trunk, mode="record", contexts=CONTEXTS[:2],
            candidates=CANDIDATES[:2])
    replayed = run(model, tok, Needs(), 8192, 64, trunk=trunk, mode="replay")
    whole = run(model, tok, Needs(), 8192, 64)
    assert trunk.whole_calls > 0 and trunk.replayed_calls == 0
    for (_, a), (_, b) in zip(replayed, whole):
        torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-6)  # (float32 sums of order 40)
    # what that pass ran whole it recorded (an update's first pass over generated tokens): the next one replays
    again = run(model, tok, Needs(), 8192, 64, trunk=trunk, mode="replay")
    assert trunk.replayed_calls > 0
    for (_, a), (_, b) in zip(again, whole):
        torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-6)  # (float32 sums of order 40)


def test_hidden_states_of_the_skipped_layers_are_never_replayed(lora_top):
    model, tok = lora_top
    trunk = Trunk(model, 1, 2**30)
    needs = Needs(context_hidden=True, layers=(0, -1))  # the embeddings: skipped layers' territory
    with torch.no_grad():
        run(model, tok, needs, 8192, 64, trunk=trunk, mode="record")
        replayed = run(model, tok, needs, 8192, 64, trunk=trunk, mode="replay")
        whole = run(model, tok, needs, 8192, 64)
    assert trunk.replayed_calls == 0
    for (_, a), (_, b) in zip(replayed, whole):
        torch.testing.assert_close(a.context_hidden[0], b.context_hidden[0], atol=1e-6, rtol=0)


def test_a_model_adapted_in_every_layer_has_no_trunk(reference_models):
    from peft import LoraConfig, get_peft_model

    model, _ = reference_models["llama"]
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"]))
    assert trunk_depth(peft) == 0
    with pytest.raises(ValueError, match="no frozen trunk"):
        Trunk(peft, 0, 2**20)
