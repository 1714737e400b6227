"""docs/porting/lamorel.md and docs/porting/trlx.md show real code: their file blocks are the shipped
files, their configs are valid, the hand-written plugins of examples/ppo_lora_custom.py keep their contracts and
compute what the built-in ones do (the PPO loss equals the built-in updater's terms; the LoRA initializer trains
adapters only and starts as the plain model), the reward functions of examples/trlx_sentiments.py are trlX's (one
dense reward per generated token, on the middle and last ones), the trlX config sets every PPOConfig field the
guide maps, and both examples run end to end (slow)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest
import torch
import yaml

from llmrl.engine.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "porting", "lamorel.md")
TRLX_DOC = os.path.join(ROOT, "docs", "porting", "trlx.md")
EXAMPLE = os.path.join(ROOT, "examples", "ppo_lora_custom.py")
CUSTOM_CONFIG = os.path.join(ROOT, "configs", "ppo-babyai-custom.yaml")
TRLX_EXAMPLE = os.path.join(ROOT, "examples", "trlx_sentiments.py")
TRLX_CONFIG = os.path.join(ROOT, "configs", "trlx-sentiments.yaml")
SHIPPED = {DOC: {"configs/ppo-babyai.yaml", "configs/ppo-babyai-custom.yaml", "examples/ppo_lora_custom.py"},
           TRLX_DOC: {"configs/trlx-sentiments.yaml", "examples/trlx_sentiments.py"}}


def doc_blocks(doc: str = DOC) -> list[tuple[str | None, str, str]]:
    """``(file marker or None, language, text)`` of every fenced block of the doc."""
    text = open(doc).read()
    pattern = re.compile(r"(?:<!-- file: (\S+) -->\n)?```(\w*)\n(.*?)```", re.S)
    return [(m.group(1), m.group(2), m.group(3)) for m in pattern.finditer(text)]


def example_module(path: str = EXAMPLE):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("doc", [DOC, TRLX_DOC], ids=["lamorel", "trlx"])
def test_file_blocks_are_the_shipped_files(doc):
    marked = [(path, text) for path, _, text in doc_blocks(doc) if path]
    assert {p for p, _ in marked} == SHIPPED[doc]
    for path, text in marked:
        with open(os.path.join(ROOT, path)) as f:
            assert text == f.read(), f"the doc's copy of {path} differs from the file"


@pytest.mark.parametrize("doc", [DOC, TRLX_DOC], ids=["lamorel", "trlx"])
def test_every_config_and_python_block_is_valid(tiny, doc):
    for _, lang, text in doc_blocks(doc):
        if lang == "python":
            ast.parse(text)
        elif lang == "yaml":
            raw = yaml.safe_load(text)
            for llm in raw["llms"].values():
                llm["model"] = tiny["llama"]
                llm.pop("max_length", None)  # the guide's model's; over the tiny model's 512 positions
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
    from testkit.scripts import run_script

    # the tests' launcher (ranks forked from the preloaded server); `llmrl run` itself is test_launch_live's
    result = run_script(CUSTOM_CONFIG, EXAMPLE, ["--updates", "2", "--envs", "4", "--steps", "4"],
                        overrides=[f"llms.policy.model={tiny['llama']}", "threads_per_rank=1"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("update ")]
    assert [line.split(":")[0] for line in lines] == ["update 1", "update 2"], result.stdout[-3000:]
    assert all("policy loss" in line and "nan" not in line for line in lines)
    (scalars,) = (tmp_path / "runs").glob("ppo_lora_custom-*/scalars.csv")  # the config's tracking, default folder
    keys = {(line.split(",")[0], line.split(",")[1]) for line in scalars.read_text().splitlines()[1:]}
    assert {("1", "train/success_rate"), ("2", "update/policy_loss")} <= keys


def test_trlx_reward_functions_are_trlxs():
    """The dense reward: one number per generated token, 0 but the middle token (the first half's negative score)
    and the last (the second half's positive score), halves cut at the sample's full stops as trlX cuts them."""
    module = example_module(TRLX_EXAMPLE)
    first, second = "This movie was awful and boring", " Then it became wonderful, I loved it."
    sample = first + "." + second
    (dense,) = module.dense_reward_fn(samples=[sample], prompts=["This movie was"], outputs=[sample[14:]],
                                      tokens=[[11, 12, 13, 14, 15]])
    neg, pos = module.positive([first]), module.positive([second])
    assert dense == pytest.approx([0.0, 0.0, 1.0 - neg[0], 0.0, pos[0]])
    assert neg[0] < 0.5 < pos[0]  # VADER reads the halves as trlX's classifier would
    assert module.dense_reward_fn(samples=["x"], prompts=[""], outputs=["x"], tokens=[[]]) == [[]]
    assert module.reward_fn(samples=[sample, first], prompts=["", ""], outputs=["", ""]) == module.positive(
        [sample, first])


def test_trlx_config_sets_every_ppo_config_field_the_guide_maps():
    """Each PPOConfig field of trlX's default_ppo_config with an llmrl argument is set in the config, to trlX's
    default value, and the config's ppo_tokens arguments pass its schema."""
    from llmrl.plugins.checks import args_problem
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    raw = yaml.safe_load(open(TRLX_CONFIG))["llms"]["policy"]
    trlx_defaults = {"ppo_epochs": ("epochs", 4), "init_kl_coef": ("kl_coef", 0.001), "target": ("kl_target", None),
                     "horizon": ("kl_horizon", 10000), "gamma": ("gamma", 1.0), "lam": ("lam", 0.95),
                     "cliprange": ("clip_eps", 0.2), "cliprange_value": ("value_clip", 0.2),
                     "vf_coef": ("value_coef", 1.0), "cliprange_reward": ("reward_clip", 10),
                     "scale_reward": ("reward_scale", None)}
    args = raw["updater"]["args"]
    for field, (name, value) in trlx_defaults.items():
        assert args[name] == value, field
        assert f"`{field}" in open(TRLX_DOC).read(), f"the guide does not map {field}"
    assert args_problem(PPOTokensUpdater, args, "ppo_tokens") is None
    assert raw["max_length"] == 1024 and raw["training"]["micro_batch_size"] == 32  # seq_length, batch_size


@pytest.mark.slow
def test_trlx_example_runs(tmp_path, tiny):
    """The guide's command on a tiny model: two rounds with dense rewards, a clean exit."""
    from testkit.scripts import run_script

    result = run_script(TRLX_CONFIG, TRLX_EXAMPLE, ["--rounds", "2", "--num-rollouts", "4", "--max-new-tokens", "8",
                                                    "--dense"],
                        overrides=[f"llms.policy.model={tiny['llama']}", "llms.policy.max_length=null",  # 1024: over
                                   "threads_per_rank=1"], cwd=tmp_path)  # the tiny model's 512
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"], result.stdout[-3000:]
    assert all("kl" in line and "nan" not in line for line in lines)
    assert any(line.startswith("eval: ") for line in result.stdout.splitlines())
