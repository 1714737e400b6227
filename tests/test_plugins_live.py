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
from testkit import reference_scores

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
        "lora": {"model": tiny["llama"], "updater": updater, "training": sgd,
                 "initializers": [{"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}]},
        "qlora": {"model": tiny["llama"], "updater": updater, "training": sgd, "quantization": {"bits": 4},
                  "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}]},
    }, "threads_per_rank": 1}
    pythonpath = os.pathsep.join([plugin_path, HERE, os.environ.get("PYTHONPATH", "")])
    live = LiveRun(config, env={"PYTHONPATH": pythonpath})
    yield live
    live.close()


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


def test_lora_adapters_are_selected_per_request(run, reference_models):
    model, tok = reference_models["llama"]
    base = reference_scores(model, tok, CONTEXTS, CANDIDATES)
    for adapter in ("a", "b"):  # LoRA starts as the identity
        for got, want in zip(run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter=adapter), base):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    run.update(CONTEXTS, CANDIDATES, llm="lora", adapter="a", **UPDATE)
    trained = run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="a")
    untouched = run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="b")
    default = run.score(CONTEXTS, CANDIDATES, llm="lora")  # the first adapter is the active one
    for t, u, d, want, action in zip(trained, untouched, default, base, UPDATE["actions"]):
        torch.testing.assert_close(u, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(d, t, atol=1e-6, rtol=0)
        assert t[action] > want[action] + 1e-3  # the update raised the chosen action's log-prob
    with pytest.raises(RequestError, match="unknown peft_adapter 'c' for LLM 'lora'; adapters: a, b"):
        run.score(CONTEXTS, CANDIDATES, llm="lora", peft_adapter="c")


def test_qlora_trains_on_cpu(run):
    before = run.state_dict(llm="qlora")
    first = run.score(CONTEXTS, CANDIDATES, llm="qlora")
    for _ in range(2):
        run.update(CONTEXTS, CANDIDATES, llm="qlora", **UPDATE)
    after = run.state_dict(llm="qlora")
    lora = [k for k in before if "lora_" in k]
    quantized = [k for k in before if k.endswith("proj.base_layer.weight")]
    assert lora and quantized and before[quantized[0]].dtype == torch.uint8
    assert any(not torch.equal(before[k], after[k]) for k in lora)
    assert all(torch.equal(before[k], after[k]) for k in quantized)
    later = run.score(CONTEXTS, CANDIDATES, llm="qlora")
    assert all(new[a] > old[a] for new, old, a in zip(later, first, UPDATE["actions"]))


def test_head_defined_in_the_rl_script(tmp_path, tiny):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"llms": {"main": {"model": tiny["llama"], "heads": {
        "from_config": {"plugin": "__main__:ScriptHead", "args": {"value": 3.0}}}}}}))
    out = str(tmp_path / "marks")
    env = {**os.environ, "LLMRL_TEST_OUT": out}
    result = subprocess.run([sys.executable, "-m", "llmrl.launch.cli", "run", "--config", str(config),
                             os.path.join(HERE, "scripts", "script_plugins.py")], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("[{")))
    assert report == [{"from_config": 3.0, "from_caller": 4.0}] * 2
    assert len(glob.glob(f"{out}.main.*")) == 1  # the RL loop ran on the client only
    assert len(glob.glob(f"{out}.imported.*")) == 2  # client + the server that imported the script for its head
