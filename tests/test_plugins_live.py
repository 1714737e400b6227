"""Plugins in live runs: heads from an installed entry-point package, a fake distribution, module:attr and
the RL script itself; candidate-level heads; LoRA adapters selected per request; QLoRA training on CPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from test_plugins import make_fake_distribution

from llmrl.engine.errors import RequestError
from testkit import LiveRun, reference_scores

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "open the door"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" slowly", " fast"]]
UPDATE = {"actions": [1, 0, 1], "weights": [1.0, 1.0, 1.0]}


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """The example plugin package installed (really, with pip) into a folder, next to a fake distribution."""
    root = tmp_path_factory.mktemp("plugins")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(root), os.path.join(ROOT, "examples", "plugin_package")], check=True)
    make_fake_distribution(root)
    return str(root)


@pytest.fixture(scope="module")
def run(tiny, plugin_path):
    from testkit import LiveRun

    sgd = {"optimizer": {"type": "sgd", "lr": 0.5}, "micro_batch_size": 4}
    updater = "llmrl_test_plugins:ChosenScoreUpdater"
    config = {"llms": {
        "plugins": {"model": tiny["llama"], "heads": {
            "q": {"plugin": "action_value", "args": {"hidden": 8}},
            "fake": {"plugin": "fake_head", "args": {"scale": 2.0}},
            "constant": {"plugin": "llmrl_test_plugins:ConstantHead", "args": {"value": 2.5}},
            "length": "llmrl_test_plugins:CandidateLengthHead",
            "value": "value"}},
        "lora": {"model": tiny["llama"], "updater": updater, "training": sgd, "heads": {"value": "value"},
                 "initializers": [{"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}]},
        "qlora": {"model": tiny["llama"], "updater": updater, "quantization": {"bits": 4},
                  "training": {"optimizer": {"type": "sgd", "lr": QLORA_LR}, "micro_batch_size": 4},
                  "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}]},
    }, "threads_per_rank": 1}
    pythonpath = os.pathsep.join([plugin_path, HERE, os.environ.get("PYTHONPATH", "")])
    live = LiveRun(config, env={"PYTHONPATH": pythonpath})
    yield live
    assert live.close() == 0


def test_heads_from_every_source_in_one_forward_pass(run, reference_models):
    model, tok = reference_models["llama"]
    out = run.score(CONTEXTS, CANDIDATES, llm="plugins",
                    additional_module_function_keys=["q", "fake", "constant", "length", "value"])
    expected = reference_scores(model, tok, CONTEXTS, CANDIDATES)
    for i, entry in enumerate(out):
        torch.testing.assert_close(entry["score"], expected[i], atol=1e-4, rtol=0)
        assert entry["q"].shape == (len(CANDIDATES[i]),)
        assert float(entry["constant"]) == 2.5 and entry["value"].shape == ()
        counts = [len(tok(CONTEXTS[i] + c)["input_ids"]) - len(tok(CONTEXTS[i])["input_ids"]) for c in CANDIDATES[i]]
        assert entry["length"].tolist() == counts
        with torch.no_grad():
            hidden = model(**tok(CONTEXTS[i], return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0, -1]
        assert float(entry["fake"]) == pytest.approx(2.0 * float(hidden.sum()), abs=1e-3)
    heads_only = run.custom_module_fns(["constant", "q"], CONTEXTS, CANDIDATES, llm="plugins")
    assert [float(h["constant"]) for h in heads_only] == [2.5, 2.5, 2.5]


def test_unknown_head_is_a_clear_request_error(run):
    with pytest.raises(RequestError, match="unknown head\\(s\\) \\['nope'\\] for LLM 'plugins'; available: constant"):
        run.custom_module_fns(["nope"], CONTEXTS, llm="plugins")
    assert float(run.custom_module_fns(["constant"], CONTEXTS[:1], llm="plugins")[0]["constant"]) == 2.5


def peft_reference(tiny, state: dict, adapter: str):
    """A plain PEFT model with adapters a and b (as the lora initializer makes them) holding the server's weights,
    with ``adapter`` active."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny["llama"]), LoraConfig(**config), adapter_name="a")
    peft.add_adapter("b", LoraConfig(**config))
    peft.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    peft.set_adapter(adapter)
    return peft.eval()


def test_lora_adapters_are_selected_per_request(run, reference_models, tiny):
    """score, custom_module_fns and generate use the adapter a request names (update_async trains adapter a only),
    each equal to a plain PEFT model with that adapter active."""
    model, tok = reference_models["llama"]
    base = reference_scores(model, tok, CONTEXTS, CANDIDATES)
    for adapter in ("a", "b"):  # LoRA starts as the identity
        for got, want in zip(run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter=adapter), base):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    (stats,) = run.many("update", [((CONTEXTS, CANDIDATES), {"llm": "lora", "adapter": "a", **UPDATE})])
    assert stats[0]["optimizer_steps"] == 1
    state = run.state_dict(llm="lora")
    heads = {k[len("heads.value."):]: v for k, v in state.items() if k.startswith("heads.value.")}
    for adapter in ("a", "b"):
        peft = peft_reference(tiny, state, adapter)
        want = reference_scores(peft, tok, CONTEXTS, CANDIDATES)
        for got, w in zip(run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter=adapter), want):
            torch.testing.assert_close(got, w, atol=1e-4, rtol=0)
        values = run.custom_module_fns(["value"], CONTEXTS, llm="lora", peft_adapter=adapter)
        generated = run.generate(CONTEXTS, llm="lora", peft_adapter=adapter, max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            for context, got, sample in zip(CONTEXTS, values, generated):
                enc = tok(context, return_tensors="pt")
                hidden = peft(**enc, output_hidden_states=True).hidden_states[-1][0, -1]
                mlp = torch.nn.Sequential(torch.nn.Linear(hidden.shape[0], 256), torch.nn.Tanh(),
                                          torch.nn.Linear(256, 1))
                mlp.load_state_dict({k[len("mlp."):]: v for k, v in heads.items()})
                assert float(got["value"]) == pytest.approx(float(mlp(hidden)), abs=1e-4)
                plain = peft.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
                assert sample[0]["tokens"].tolist() == plain[0, enc["input_ids"].shape[1]:].tolist()
    trained = run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="a")
    untouched = run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="b")
    for t, u, want in zip(trained, untouched, base):
        torch.testing.assert_close(u, want, atol=1e-4, rtol=0)
        assert (t - want).abs().max() > 1e-3  # adapter a moved
    with pytest.raises(RequestError, match="unknown peft_adapter 'c' for LLM 'lora'; adapters: a, b"):
        run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="c")


def test_an_updater_handed_to_the_caller(tiny):
    """Caller(updater=(Class, args)) replaces the config's updater (the class travels by reference)."""
    from llmrl_test_plugins import ChosenScoreUpdater

    config = {"llms": {"main": {"model": tiny["llama"], "heads": {"value": {"plugin": "value", "args": {"hidden": 8}}},
                                "training": {"optimizer": {"type": "sgd", "lr": 0.1}, "micro_batch_size": 4}}},
              "threads_per_rank": 1}
    with LiveRun(config, caller_kwargs={"updater": (ChosenScoreUpdater, {"head": "value"})}) as live:
        assert live.info["main"]["updater"] == "ChosenScoreUpdater"
        (stats,) = live.update(CONTEXTS, CANDIDATES, targets=[0.0, 1.0, 2.0], **UPDATE)
        assert stats["micro_steps"] == 1 and stats["optimizer_steps"] == 1


QLORA_LR = 0.05
# The 16 NF4 levels (Dettmers et al. 2023, QLoRA, appendix E), written here so the reference owes nothing to
# bitsandbytes.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int = 64) -> torch.Tensor:
    """bitsandbytes' 4-bit storage: two level indices per byte, the first in the high nibble; one scale per block."""
    b = packed.reshape(-1).to(torch.int64)
    idx = torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[: shape[0] * shape[1]]
    return (NF4[idx].view(-1, blocksize) * absmax.float().view(-1, 1)).reshape(shape)


def qlora_reference_step(path, before):
    """LoRA weights after one plain SGD step of ChosenScoreUpdater's loss, on a float32 PEFT model whose linear
    weights are the server's 4-bit weights dequantised here, with the server's own initial LoRA weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    errors = []
    for name, module in model.named_modules():
        key = next((k for k in before if k.endswith(f"{name}.base_layer.weight")), None)
        if not isinstance(module, torch.nn.Linear) or key is None:
            continue
        weight = dequantize_nf4(before[key], before[key.replace(".weight", ".weight.absmax")], module.weight.shape)
        errors.append(float((weight - module.weight.detach()).norm() / module.weight.detach().norm()))
        with torch.no_grad():
            module.weight.copy_(weight)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
    lora = {n.removeprefix("base_model.model."): p for n, p in peft.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in lora.items():
            p.copy_(before[next(k for k in before if k.endswith(n))])
    chosen = []
    for context, cands, action in zip(CONTEXTS, CANDIDATES, UPDATE["actions"]):
        ctx, full = tok(context)["input_ids"], tok(context + cands[action])["input_ids"]
        p = next(i for i in range(len(full)) if i >= len(ctx) or ctx[i] != full[i])
        logp = torch.log_softmax(peft(input_ids=torch.tensor([full])).logits[0], -1)
        chosen.append(sum(logp[t - 1, full[t]] for t in range(p, len(full))))
    loss = -torch.stack(chosen).mean()
    grads = torch.autograd.grad(loss, list(lora.values()))
    return {n: (p - QLORA_LR * g).detach() for (n, p), g in zip(lora.items(), grads)}, errors, float(loss)


def test_qlora_update_equals_a_plain_step_on_the_dequantised_model(run, tiny):
    """One QLoRA update on the CPU path equals a plain PyTorch step on the same weights dequantised in float32
    (the 4-bit layers' forward and input gradients are exact), and the 4-bit weights do not move."""
    before = run.state_dict(llm="qlora")
    run.score(CONTEXTS, CANDIDATES, llm="qlora")  # a no-grad pass first: no layer may switch to another kernel
    (stats,) = run.update(CONTEXTS, CANDIDATES, llm="qlora", **UPDATE)
    after = run.state_dict(llm="qlora")
    expected, errors, loss = qlora_reference_step(tiny["llama"], before)
    assert errors and max(errors) < 0.1  # the dequantised weights are the original ones within NF4 error
    assert stats["loss"] == pytest.approx(loss, abs=1e-4)
    moved = 0
    for name, want in expected.items():
        got = after[next(k for k in after if k.endswith(name))]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        moved += int((want - before[next(k for k in before if k.endswith(name))]).abs().max() > 1e-3)
    assert moved >= len(expected) // 2, "the step must move the LoRA weights far more than the tolerance"
    quantized = [k for k in before if k.endswith("proj.base_layer.weight")]
    assert quantized and before[quantized[0]].dtype == torch.uint8
    assert all(torch.equal(before[k], after[k]) for k in quantized)


def test_head_defined_in_the_rl_script(tmp_path, tiny):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"llms": {"main": {"model": tiny["llama"], "heads": {
        "from_config": {"plugin": "__main__:ScriptHead", "args": {"value": 3.0}}}}}}))
    out = str(tmp_path / "marks")
    from testkit.scripts import run_script

    result = run_script(str(config), os.path.join(HERE, "scripts", "script_plugins.py"),
                        env={"LLMRL_TEST_OUT": out}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("[{")))
    assert report == [{"from_config": 3.0, "from_caller": 4.0}] * 2
    assert len(glob.glob(f"{out}.main.*")) == 1  # the RL loop ran on the client only
    assert len(glob.glob(f"{out}.imported.*")) == 2  # client + the server that imported the script for its head


def test_an_initializer_that_returns_no_model_is_named(tiny):
    """It failed with "AttributeError: 'str' object has no attribute 'config'", naming no plugin."""
    from testkit import LiveRun

    with pytest.raises(Exception, match="initializer 'llmrl_test_plugins:NotAModelInitializer' returned str, not the "
                                        "model"):
        LiveRun({"llms": {"main": {"model": tiny["llama"], "initializers": [
            "llmrl_test_plugins:NotAModelInitializer"]}}, "threads_per_rank": 1})
