"""Plugin discovery: entry points (built-in and third-party), module:attr, contracts, argument schemas,
and the errors for unknown names, failing imports and bad arguments."""

from __future__ import annotations

import sys
import textwrap

import pytest

from llmrl.engine.config import PluginSpec, load_config
from llmrl.engine.errors import ConfigError, PluginError
from llmrl.plugins import checks, registry
from testkit.distributions import write_distribution


def make_fake_distribution(root):
    """Write a distribution into ``root`` that registers plugins through entry points, one of them broken."""
    write_distribution(root, "fake-llmrl-plugins", """
        [llmrl.heads]
        fake_head = fake_llmrl_module:FakeHead
        broken_head = fake_llmrl_broken:Anything
        [llmrl.updaters]
        fake_updater = fake_llmrl_module:FakeUpdater
    """)
    (root / "fake_llmrl_module.py").write_text(textwrap.dedent("""
        import torch
        from llmrl.plugins import Head, Updater

        class FakeHead(Head):
            args_schema = {"type": "object", "properties": {"scale": {"type": "number"}},
                           "additionalProperties": False}

            def __init__(self, llm, scale=1.0):
                super().__init__(llm)
                self.scale = scale

            def forward(self, outputs):
                return self.scale * outputs.context_hidden.sum(-1)

        class FakeUpdater(Updater):
            def update(self, batch, trainer):
                return {}
    """))
    (root / "fake_llmrl_broken.py").write_text("raise ImportError('boom: a missing dependency')\n")
    return root


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    make_fake_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fake_llmrl_module", "fake_llmrl_broken"):
        sys.modules.pop(name, None)
    return tmp_path


def test_built_in_plugins_are_entry_points():
    from llmrl.plugins.lora import LoraInitializer
    from llmrl.plugins.ppo import PPOUpdater
    from llmrl.plugins.value_head import ValueHead

    assert registry.resolve("head", "value") is ValueHead
    assert registry.resolve("initializer", "lora") is LoraInitializer
    assert registry.resolve("updater", "ppo") is PPOUpdater
    from llmrl.plugins.grpo import GRPOUpdater
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater
    from llmrl.plugins.reward_model import PairwiseRewardUpdater, RewardHead
    from llmrl.plugins.value_head import TokenValueHead

    assert registry.resolve("head", "token_value") is TokenValueHead
    assert registry.resolve("head", "reward") is RewardHead
    from llmrl.plugins.next_token import NextTokenHead

    assert registry.resolve("head", "next_token") is NextTokenHead
    assert registry.resolve("updater", "ppo_tokens") is PPOTokensUpdater
    assert registry.resolve("updater", "grpo") is GRPOUpdater
    assert registry.resolve("updater", "pairwise_reward") is PairwiseRewardUpdater
    names = {(r["group"], r["name"]) for r in registry.installed_plugins() if r["package"].startswith("llmrl ")}
    assert {("llmrl.heads", "value"), ("llmrl.heads", "token_value"), ("llmrl.heads", "reward"),
            ("llmrl.initializers", "lora"), ("llmrl.initializers", "freeze"), ("llmrl.updaters", "ppo"),
            ("llmrl.updaters", "ppo_tokens"), ("llmrl.updaters", "grpo"),
            ("llmrl.updaters", "pairwise_reward")} <= names


def test_third_party_entry_points_are_listed_without_importing(fake_distribution):
    rows = {(r["group"], r["name"]): r for r in registry.installed_plugins()}
    assert rows[("llmrl.heads", "fake_head")]["package"] == "fake-llmrl-plugins 1.0"
    assert "fake_llmrl_module" not in sys.modules and "fake_llmrl_broken" not in sys.modules
    cls = registry.resolve("head", "fake_head")
    assert cls.__name__ == "FakeHead"


def test_unknown_name_lists_the_installed_and_suggests(fake_distribution):
    with pytest.raises(PluginError) as err:
        registry.resolve("head", "fake_haed")
    message = str(err.value)
    assert "did you mean 'fake_head'" in message and "value" in message and "llmrl.heads" in message


def test_failing_import_names_the_plugin_and_keeps_the_cause(fake_distribution):
    with pytest.raises(PluginError, match="head plugin 'broken_head' .* failed to import: ImportError: boom") as err:
        registry.resolve("head", "broken_head")
    assert isinstance(err.value.__cause__, ImportError)
    with pytest.raises(PluginError, match="importing 'no_such_module' failed: ModuleNotFoundError") as err:
        registry.resolve("head", "no_such_module:Head")
    assert isinstance(err.value.__cause__, ModuleNotFoundError)


def test_module_attr_plugins_and_contract_checks():
    assert registry.resolve("head", "llmrl_test_plugins:ConstantHead").__name__ == "ConstantHead"
    with pytest.raises(PluginError, match="has no attribute 'ConstantHaed' \\(did you mean 'ConstantHead'"):
        registry.resolve("head", "llmrl_test_plugins:ConstantHaed")
    with pytest.raises(PluginError, match="must subclass llmrl.plugins.Head"):
        registry.resolve("head", "llmrl_test_plugins:ChosenScoreUpdater")
    with pytest.raises(PluginError, match="does not implement update\\(batch, trainer\\)"):
        registry.resolve("updater", "llmrl.plugins.contracts:Updater")


def test_arguments_are_checked_against_schema_and_constructor(fake_distribution):
    with pytest.raises(PluginError, match="bad arguments: scale: 'x' is not of type 'number'"):
        registry.build("head", PluginSpec("fake_head", {"scale": "x"}), llm=None)
    assert checks.args_problem(registry.resolve("updater", "llmrl_test_plugins:ChosenScoreUpdater"),
                                 {"haed": "v"}, "x").startswith("unknown argument(s) ['haed']")


def test_config_reports_plugin_problems_before_any_model_loads(tiny, fake_distribution):
    config = {"llms": {"main": {
        "model": tiny["llama"],
        "heads": {"a": "fake_haed", "b": "broken_head", "c": {"plugin": "fake_head", "args": {"scale": "big"}},
                  "d": "fake_head"},
        "updater": {"plugin": "ppo", "args": {"epoch": 3}},
    }}}
    with pytest.raises(ConfigError) as err:
        load_config(raw=config)
    problems = dict(err.value.problems)
    assert "did you mean 'fake_head'" in problems["llms.main.heads.a"]
    assert "ImportError: boom" in problems["llms.main.heads.b"]
    assert "'big' is not of type 'number'" in problems["llms.main.heads.c.args"]
    assert "epoch" in problems["llms.main.updater.args"]
    assert "llms.main.heads.d" not in problems


def test_rlhf_plugin_arguments_are_checked_with_the_config(tiny):
    config = {"llms": {
        "policy": {"model": tiny["llama"], "heads": {"v": {"plugin": "token_value", "args": {"hidden": 0}}},
                   "updater": {"plugin": "grpo", "args": {"loss": "tokens"}}},
        "dr-grpo": {"model": tiny["llama"], "updater": {"plugin": "grpo", "args": {"loss": "fixed_length"}}},
        "rm": {"model": tiny["llama"], "heads": {"r": "reward"}, "updater": {"plugin": "ppo_tokens",
                                                                            "args": {"kl_target": -1}}},
    }}
    with pytest.raises(ConfigError) as err:
        load_config(raw=config)
    problems = dict(err.value.problems)
    assert ("'tokens' is not one of ['sequence', 'token', 'batch_token', 'fixed_length']"
            in problems["llms.policy.updater.args"])
    assert "'max_new_tokens' is a required property" in problems["llms.dr-grpo.updater.args"]
    assert "hidden" in problems["llms.policy.heads.v.args"] and "0" in problems["llms.policy.heads.v.args"]
    assert "-1" in problems["llms.rm.updater.args"]
    assert "llms.rm.heads.r" not in problems


def test_the_arguments_updaters_share_are_checked_alike():
    from llmrl.plugins.grpo import GRPOUpdater
    from llmrl.plugins.ppo import PPOUpdater
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater
    from llmrl.plugins.reward_model import PairwiseRewardUpdater
    from llmrl.plugins.updater_args import updater_schema

    for cls in (PPOUpdater, PPOTokensUpdater, GRPOUpdater, PairwiseRewardUpdater):
        assert checks.args_problem(cls, {"epochs": 0}, "u") == "epochs: 0 is less than the minimum of 1"
        assert checks.args_problem(cls, {"seed": 1.5}, "u") == "seed: 1.5 is not of type 'integer'"
        assert checks.args_problem(cls, {"epochs": 2, "seed": 3}, "u") is None
    for cls in (PPOUpdater, PPOTokensUpdater, GRPOUpdater):
        assert checks.args_problem(cls, {"clip_eps": 0}, "u") == "clip_eps: 0 is less than or equal to the minimum of 0"
    with pytest.raises(KeyError, match="epohcs"):
        updater_schema("epohcs")


def test_a_name_two_packages_register_with_different_targets_is_refused_naming_both(fake_distribution):
    """Which entry point importlib returns last depends on sys.path's order: a review's run got another package's
    `value` head and `ppo` updater without a word. Now refused, naming both targets."""
    dist = fake_distribution / "shadowing_llmrl_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shadowing-llmrl-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[llmrl.heads]\nvalue = fake_llmrl_module:FakeHead\n")
    with pytest.raises(PluginError, match="head plugin 'value' is registered by several installed packages, with "
                                          "different targets: fake_llmrl_module:FakeHead, llmrl.plugins"):
        registry.resolve("head", "value")
    assert registry.resolve("head", "fake_llmrl_module:FakeHead").__name__ == "FakeHead"  # named exactly: fine
    assert registry.resolve("head", "fake_head").__name__ == "FakeHead"  # one target (found once per path entry)


def test_a_head_whose_forward_requires_a_keyword_is_told_to_give_it_a_default():
    from llmrl.plugins import Head

    class NeedsBonus(Head):
        def forward(self, outputs, bonus):
            return bonus

    assert checks.contract_problem("head", NeedsBonus, "needs_bonus").endswith(
        "does not match the contract forward(outputs); a head's other arguments come from a call's head_kwargs, "
        "which may leave them out: give bonus a default (e.g. bonus=None)")
