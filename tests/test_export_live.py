"""What ``save()`` exports through Hugging Face from a server rank is really written (issue 17, point 4), with
tensor-parallel 2 (a full model) and with ZeRO-3 over 2 replicas (a LoRA adapter): plain transformers and
peft reload each export and get the run's own weights (and, for the full model, its scores), the config,
generation config, adapter config and tokenizer files are all there, and the heads match.

transformers 5's model ``save_pretrained`` writes nothing on a process that is not rank 0 of its process
group; the export writes weights with safetensors on the group leader and saves only configs and the
tokenizer through Hugging Face (not rank-gated; tests/test_builtin_live.py checks them on rank 1 too).
(2 replicas with ZeRO-2 and ZeRO-3 full models are covered by tests/test_checkpoint_live.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from testkit import LiveRun, reference_scores

pytestmark = pytest.mark.slow
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "open the door"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" slowly", " fast"]]
UPDATE = {"actions": [1, 2, 0], "weights": [1.0, -0.5, 0.8], "targets": [0.5, -1.0, 1.0]}


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    """One run: update both LLMs (so the weights differ from the base), save, and read what the run holds."""
    updater = {"plugin": "llmrl_test_plugins:ChosenScoreUpdater", "args": {"head": "value"}}
    heads = {"value": {"plugin": "value", "args": {"hidden": 8}}}
    training = {"optimizer": {"type": "sgd", "lr": 0.5}, "micro_batch_size": 2}
    llms = {
        "tp2": {"model": tiny["llama"], "tensor_parallel": 2, "heads": heads, "updater": updater,
                "training": {**training, "zero_stage": 1}},
        "z3lora": {"model": tiny["llama"], "replicas": 2, "heads": heads, "updater": updater,
                   "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}],
                   "training": {**training, "zero_stage": 3}},
    }
    path = str(tmp_path_factory.mktemp("export") / "checkpoint")
    out = {"path": path}
    with LiveRun({"llms": llms, "threads_per_rank": 1}) as run:
        for name in llms:
            run.update(CONTEXTS, CANDIDATES, llm=name, **UPDATE)
        run.save(path)
        out["tp2", "scores"] = run.score(CONTEXTS, CANDIDATES, llm="tp2")
        # Not run.score on z3lora: scoring a ZeRO-3 LoRA model with 2 replicas after update() hangs today
        # (a separate engine bug, reported with issue 17); its export is checked against its state_dict.
        for name in llms:
            out[name, "state"] = run.state_dict(llm=name)
        assert run.close() == 0
    return out


def test_tensor_parallel_export_reloads_with_plain_transformers(exported, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    export = os.path.join(exported["path"], "tp2", "export")
    wanted = {"config.json", "generation_config.json", "model.safetensors"}
    assert wanted <= set(os.listdir(os.path.join(export, "model")))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(export, "model")).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(export, "tokenizer"))
    state = exported["tp2", "state"]
    reloaded = model.state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).state_dict()
    moved = 0
    for key, value in reloaded.items():
        torch.testing.assert_close(value, state[f"model.{key}"], atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        moved += not torch.equal(value, base[key])
    assert moved > 0  # the export holds the trained weights, not the starting ones
    for got, want in zip(reference_scores(model, tok, CONTEXTS, CANDIDATES), exported["tp2", "scores"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert GenerationConfig.from_pretrained(os.path.join(export, "model")).pad_token_id == tok.pad_token_id
    _check_heads(export, state)


def test_zero3_adapter_export_reloads_with_plain_peft(exported, tiny):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = os.path.join(exported["path"], "z3lora", "export")
    adapter = os.path.join(export, "adapters", "default")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert PeftConfig.from_pretrained(adapter).r == 4
    tok = AutoTokenizer.from_pretrained(os.path.join(export, "tokenizer"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["llama"]), adapter).eval()
    state = exported["z3lora", "state"]
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert lora and any(not torch.all(v == 0) for k, v in lora.items() if "lora_B" in k)  # trained, not fresh
    for key, value in lora.items():
        torch.testing.assert_close(value, state[f"model.{key}"], atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    # The reloaded PEFT model scores differently from its base: the adapter is applied, not just loaded.
    base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    adapted, plain = (reference_scores(m, tok, CONTEXTS, CANDIDATES) for m in (model, base))
    assert any(not torch.allclose(a, p, atol=1e-3) for a, p in zip(adapted, plain))
    _check_heads(export, state)


def _check_heads(export, state):
    from safetensors.torch import load_file

    heads = load_file(os.path.join(export, "heads.safetensors"))
    assert heads.keys() == {k[len("heads."):] for k in state if k.startswith("heads.")}
    for key, value in heads.items():
        torch.testing.assert_close(value, state[f"heads.{key}"], atol=0, rtol=0)


def test_base_weights_trained_beside_lora_are_exported_with_it(tiny, tmp_path):
    """The freeze initializer's unfreeze trains base weights (the final norm, a layer LoRA wraps) beside the adapter:
    the export writes them to trained_base_weights.safetensors, and the base model with them, then the adapter,
    scores as the run does (the adapter alone would not)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llms = {"p": {"model": tiny["llama"], "trainable": True, "training": {"optimizer": {"type": "adam", "lr": 1e-2}},
                  "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}},
                                   {"plugin": "freeze", "args": {"freeze": [], "unfreeze": [
                                       "*model.norm.weight", "*layers.0.mlp.down_proj.base_layer.weight"]}}]}}
    with LiveRun({"llms": llms, "threads_per_rank": 1}) as run:
        tokens = list(range(5, 14))
        datum = {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:], "weights": [1.0] * 8}}
        for _ in range(2):
            run.forward_backward([datum], "cross_entropy", llm="p")
            run.optim_step({"learning_rate": 5e-2}, llm="p")
        served = run.score(CONTEXTS, CANDIDATES, llm="p")
        run.save(str(tmp_path / "ckpt"))
    export = tmp_path / "ckpt" / "p" / "export"
    trained = load_file(export / "trained_base_weights.safetensors")
    # a layer LoRA wraps too: named as in the base model (its ".base_layer." name was skipped by strict=False)
    assert sorted(trained) == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    assert not torch.equal(trained["model.norm.weight"], base.state_dict()["model.norm.weight"])
    tok = AutoTokenizer.from_pretrained(export / "tokenizer")
    adapter_only = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["llama"]),
                                             export / "adapters" / "default").eval()
    assert base.load_state_dict(trained, strict=False).unexpected_keys == []
    whole = PeftModel.from_pretrained(base, export / "adapters" / "default").eval()
    for got, want in zip(reference_scores(whole, tok, CONTEXTS, CANDIDATES), served):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert any(not torch.allclose(a, w, atol=1e-3)
               for a, w in zip(reference_scores(adapter_only, tok, CONTEXTS, CANDIDATES), served))
