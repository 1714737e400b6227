"""The examples' command lines keep the defaults their ``Args`` dataclasses state: a boolean field that defaults to
True stays True unless ``--no-<name>`` is given (it was once a ``store_true`` flag that no run could turn on, so the
BabyAI demo never described walls)."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import asdict

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example(name: str):
    sys.path.insert(0, EXAMPLES)
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(EXAMPLES)


def parsed(module, argv: list[str], monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script", *argv])
    return module.parse_args()


@pytest.mark.parametrize("name", ["ppo_babyai", "rlhf_sentiment", "rlhf_grpo_in_script", "textworld_agent"])
def test_no_flags_give_the_stated_defaults(name, monkeypatch):
    module = example(name)
    assert asdict(parsed(module, [], monkeypatch)) == asdict(module.Args())


def test_boolean_defaults_can_be_turned_either_way(monkeypatch):
    babyai, textworld = example("ppo_babyai"), example("textworld_agent")
    assert textworld.Args().objective is True and parsed(textworld, [], monkeypatch).objective is True
    assert parsed(textworld, ["--no-objective"], monkeypatch).objective is False
    assert babyai.Args().walls is False and parsed(babyai, ["--walls"], monkeypatch).walls is True
    assert parsed(babyai, ["--walls", "--no-walls"], monkeypatch).walls is False
    assert parsed(babyai, ["--normalize-advantages"], monkeypatch).normalize_advantages is True


@pytest.mark.parametrize("name", ["ppo_babyai", "textworld_agent"])
def test_the_success_rates_interval_holds_the_rate_at_every_count(name):
    """Wilson's upper bound at 100% came out 0.9999999999999999 (float rounding): the plot's error bar went negative
    and matplotlib refused it, after a whole run (a review's DPO-in-script run, whose interval is the same)."""
    wilson = example(name).wilson
    for n in range(1, 200):
        for successes in range(n + 1):
            low, high = wilson(successes, n)
            assert 0.0 <= low <= successes / n <= high <= 1.0, (successes, n, low, high)


WITH_FLAGS = ["dpo_in_script", "dpo_sentiment", "grpo_custom_reward", "ilql_sentiment", "ppo_babyai", "ppo_lora_custom",
              "reasoning_gym_grpo", "rlhf_grpo_in_script", "rlhf_sentiment", "score_and_generate", "textworld_agent",
              "trlx_sentiments"]


def test_the_list_of_examples_with_flags_is_whole():
    def parses_flags(name: str) -> bool:
        text = open(os.path.join(EXAMPLES, name)).read()
        return "argparse" in text or "flags_parser(" in text

    helpers = {"dataclass_flags.py"}  # builds the parsers of the examples with an Args dataclass
    with_argparse = sorted(name[:-3] for name in os.listdir(EXAMPLES)
                           if name.endswith(".py") and name not in helpers and parses_flags(name))
    assert with_argparse == WITH_FLAGS


@pytest.mark.parametrize("name", WITH_FLAGS)
def test_every_flag_of_an_example_says_what_it_does(name, monkeypatch, capsys):
    module = example(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        (getattr(module, "parse_args", None) or module.main)()
    assert done.value.code == 0
    options = capsys.readouterr().out.split("options:\n", 1)[1]
    flags = []
    for line in options.splitlines():
        if line.startswith("  -"):
            flags.append(line.split())
        elif line.startswith("      "):  # a description on the lines below its flag
            flags[-1] += line.split()
    assert len(flags) > 1
    for words in flags:
        described = [w for w in words if not w.startswith("-") and not w.isupper() and w not in ("|", "{", "}")]
        assert described, f"{name}: {' '.join(words)} has no description"
