"""docs/porting-from-lamorel.md shows real code: its file blocks are the shipped files, its configs are valid, the
hand-written plugins of examples/ppo_lora_custom.py keep their contracts and compute what the built-in ones do
(the PPO loss equals the built-in updater's terms; the LoRA initializer trains adapters only and starts as the
plain model), and the example runs end to end (slow)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from llmrl.engine.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "porting-from-lamorel.md")
EXAMPLE = os.path.join(ROOT, "examples", "ppo_lora_custom.py")
CUSTOM_CONFIG = os.path.join(ROOT, "configs", "ppo-babyai-custom.yaml")


def doc_blocks() -> list[tuple[str | None, str, str]]:
    """``(file marker or None, language, text)`` of every fenced block of the doc."""
    text = open(DOC).read()
    pattern = re.compile(r"(?:<!-- file: (\S+) -->\n)?```(\w*)\n(.*?)```", re.S)
    return [(m.group(1), m.group(2), m.group(3)) for m in pattern.finditer(text)]


def example_module():
    spec = importlib.util.spec_from_file_location("ppo_lora_custom", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_file_blocks_are_the_shipped_files():
    marked = [(path, text) for path, _, text in doc_blocks() if path]
    assert {p for p, _ in marked} == {"configs/ppo-babyai.yaml", "configs/ppo-babyai-custom.yaml",
                                      "examples/ppo_lora_custom.py"}
    for path, text in marked:
        with open(os.path.join(ROOT, path)) as f:
            assert text == f.read(), f"the doc's copy of {path} differs from the file"


def test_every_config_and_python_block_is_valid(tiny):
    for _, lang, text in doc_blocks():
        if lang == "python":
            ast.parse(text)
        elif lang == "yaml":
            raw = yaml.safe_load(text)
            for llm in raw["llms"].values():
                llm["model"] = tiny["llama"]
            load_config(raw=raw)  # schema, semantics, machine and the named plugins (``__main__:`` ones at start-up)


def test_custom_plugins_keep_their_contracts_and_config_arguments():
    from llmrl.plugins.checks import args_problem, check_contract

    module = example_module()
    raw = yaml.safe_load(open(CUSTOM_CONFIG))["llms"]["policy"]
    named = [("initializer", raw["initializers"][0]), ("head", raw["heads"]["value"]), ("updater", raw["updater"])]
    for kind, spec in named:
        cls = getattr(module, spec["plugin"].removeprefix("__main__:"))
        assert check_contract(kind, cls, spec["plugin"]) is None
        assert args_problem(cls, spec.get("args", {}), spec["plugin"]) is None


def test_custom_ppo_loss_equals_the_builtin_terms():
    from llmrl.plugins.contracts import ForwardOutputs, UpdateBatch
    from llmrl.plugins.ppo import ppo_terms

    module = example_module()
    torch.manual_seed(0)
    counts = [3, 2, 4, 3]  # candidates per context
    context_of = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    scores = -torch.rand(len(context_of)) * 3
    values = torch.randn(4)
    out = ForwardOutputs("causal", 4, scores, torch.ones_like(context_of), context_of, heads={"value": values},
                         head_levels={"value": "context"})
    kwargs = {"actions": [0, 1, 3, 2], "old_logprobs": [-1.2, -0.4, -1.6, -0.9], "advantages": [0.5, -1.0, 2.0, 0.1],
              "returns": [1.0, 0.0, 0.5, -0.5]}
    mb = UpdateBatch(["c"] * 4, [["x"] * n for n in counts], kwargs, [0, 1, 2, 3], 4, 0, 1, [4])
    loss, terms = module.ppo_loss(out, mb, clip_eps=0.2, value_coef=0.5, entropy_coef=0.01)
    logits, mask = out.scores_by_context()
    builtin = ppo_terms(logits, mask, torch.tensor(kwargs["actions"]), torch.tensor(kwargs["old_logprobs"]),
                        torch.tensor(kwargs["advantages"]), values, torch.tensor(kwargs["returns"]), None, 0.2, None)
    torch.testing.assert_close(terms["policy_loss"], builtin.policy_loss)
    torch.testing.assert_close(terms["value_loss"], builtin.value_loss)
    torch.testing.assert_close(terms["entropy"], builtin.entropy)
    torch.testing.assert_close(loss, builtin.policy_loss + 0.5 * builtin.value_loss - 0.01 * builtin.entropy)
    assert (builtin.clipped > 0).any() and (builtin.clipped == 0).any()  # both sides of the clip are covered


def test_custom_lora_initializer_trains_adapters_only(tiny):
    from transformers import AutoModelForCausalLM

    from llmrl.plugins.contracts import LLMInfo

    module = example_module()
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    info = LLMInfo("policy", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    served = module.LoraInitializer(r=4, alpha=8).initialize(model, info)
    trainable = [name for name, p in served.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    ids = torch.tensor([[1, 5, 9, 14]])
    with torch.no_grad():  # LoRA starts as a no-op: the served model is the plain one
        torch.testing.assert_close(served(input_ids=ids).logits, plain(input_ids=ids).logits)


@pytest.mark.slow
def test_custom_example_runs(tmp_path, tiny):
    """The doc's command on a tiny model: two updates through the hand-written plugins, a clean exit, the updates'
    statistics and the script's scalars tracked."""
    result = subprocess.run(
        [sys.executable, "-m", "llmrl.launch.cli", "run", "--config", CUSTOM_CONFIG,
         f"llms.policy.model={tiny['llama']}",
         "threads_per_rank=1", EXAMPLE, "--updates", "2", "--envs", "4", "--steps", "4"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("update ")]
    assert [line.split(":")[0] for line in lines] == ["update 1", "update 2"], result.stdout[-3000:]
    assert all("policy loss" in line and "nan" not in line for line in lines)
    (scalars,) = (tmp_path / "runs").glob("ppo_lora_custom-*/scalars.csv")  # the config's tracking, default folder
    keys = {(line.split(",")[0], line.split(",")[1]) for line in scalars.read_text().splitlines()[1:]}
    assert {("1", "train/success_rate"), ("2", "update/policy_loss")} <= keys
