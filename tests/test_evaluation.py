"""The evaluation harness (unit tier: no server, a fake ``generate``): pass@k equals Chen et al.'s
``1 - C(n-c, k) / C(n, k)`` worked out by hand and averaged over prompts; the normal interval is ``mean ± z·s/√m``
computed by hand; the bootstrap interval equals a plain loop over ``random.Random(seed)``; a seeded evaluation
repeats exactly and another seed draws other samples; the greedy pass asks for one greedy completion per prompt
without sampling options; the scalars reach ``log`` under ``eval/<task>/``; bad arguments are refused by name; the
``llmrl eval`` command line splits into the launcher's part and the script's."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from llmrl.engine.client.evaluation import Evaluation, default_ks
from llmrl.engine.envs import FunctionTask
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.eval_statistics import bootstrap_interval, mean_interval, normal_interval, pass_at_k

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile (tables)


class FakeGenerate:
    """Completions "yes" / "no": greedy from a fixed list; sampled, each "yes" with the prompt's probability, drawn
    from ``random.Random(seed)`` (the same seed, the same draws). Records each call's options."""

    def __init__(self, greedy: list[str], chances: list[float]):
        self.greedy, self.chances, self.calls = greedy, chances, []

    def __call__(self, prompts, **options):
        self.calls.append(options)
        if not options["do_sample"]:
            return [[{"text": self.greedy[i]}] for i in range(len(prompts))]
        rng = random.Random(options["seed"])
        return [[{"text": "yes" if rng.random() < self.chances[i] else "no"}
                 for _ in range(options["num_return_sequences"])] for i in range(len(prompts))]


def yes_task(prompts=("a", "b", "c", "d")) -> FunctionTask:
    return FunctionTask(list(prompts), lambda prompt, completion: 1.0 if completion == "yes" else 0.0, name="yes")


class FixedSamples:
    """Sampled completions with a fixed number of "yes" per prompt (greedy: the first sample)."""

    def __init__(self, passes: list[int], n: int):
        self.passes, self.n = passes, n

    def __call__(self, prompts, **options):
        rows = [["yes"] * c + ["no"] * (self.n - c) for c in self.passes]
        return [[{"text": t} for t in row[:options["num_return_sequences"]]] for row in rows]


def test_pass_at_k_by_hand():
    # n=4 samples: C(4,2)=6; c=1: 1 - C(3,2)/6 = 1 - 3/6; c=2: 1 - C(2,2)/6 = 5/6; c=0: 0; c=4: 1
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_normal_interval_by_hand():
    values = [0.0, 0.5, 5 / 6, 1.0]
    mean = (0 + 0.5 + 5 / 6 + 1) / 4
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    low, high = normal_interval(values, 0.95)
    assert low == pytest.approx(mean - Z95 * s / 2) and high == pytest.approx(mean + Z95 * s / 2)
    assert normal_interval([1.0], 0.95) is None
    assert mean_interval([0.0, 0.0, 0.0])["ci"] == [0.0, 0.0]  # no spread: the interval collapses


def test_bootstrap_interval_equals_a_plain_loop():
    values = [0.0, 1.0, 1.0, 0.25, 0.0, 1.0]
    rng = random.Random(7)
    means = []
    for _ in range(500):
        draw = [values[math.floor(rng.random() * len(values))] for _ in values]  # random.choices' own rule
        means.append(sum(draw) / len(draw))
    means.sort()
    assert bootstrap_interval(values, 0.9, seed=7, resamples=500) == pytest.approx((means[24], means[474]))
    assert bootstrap_interval(values, 0.9, seed=8, resamples=500) != bootstrap_interval(values, 0.9, 7, 500)


def test_the_report_by_hand_from_fixed_samples():
    passes, n = [0, 1, 2, 4], 4
    generate = FixedSamples(passes, n)
    logged = []
    report = Evaluation(generate, logged.append).evaluate(yes_task(), samples=n, k=(1, 2, 4))
    per_prompt_at_2 = [0.0, 0.5, 5 / 6, 1.0]
    pass_2 = report["sampled"]["pass@2"]
    assert pass_2["value"] == pytest.approx(sum(per_prompt_at_2) / 4)
    mean = sum(per_prompt_at_2) / 4
    half = Z95 * statistics.stdev(per_prompt_at_2) / 2
    assert pass_2["ci"] == pytest.approx([max(0.0, mean - half), min(1.0, mean + half)])
    # pass@4 with n=4 is "any pass": 3 of 4 prompts; pass@1 the mean pass rate (0 + 1/4 + 2/4 + 1) / 4
    assert report["sampled"]["pass@4"]["value"] == pytest.approx(0.75)
    assert report["sampled"]["pass@1"]["value"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert report["sampled"]["mean_reward"]["value"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    # greedy: the first completion of each prompt: no, yes, yes, yes
    assert report["greedy"]["pass@1"]["value"] == pytest.approx(0.75)
    assert report["per_prompt"][1] == {"greedy": 1.0, "sampled": [1.0, 0.0, 0.0, 0.0]}
    (scalars,) = logged
    assert scalars["eval/yes/sampled/pass@2"] == pass_2["value"]
    assert scalars["eval/yes/sampled/pass@2_low"] == pass_2["ci"][0]
    assert scalars["eval/yes/greedy/pass@1"] == pytest.approx(0.75)


def test_a_seeded_evaluation_repeats_and_another_seed_draws_again():
    chances = [0.1, 0.4, 0.6, 0.9, 0.5, 0.3]
    task = yes_task("abcdef")
    first = Evaluation(FakeGenerate(["no"] * 6, chances)).evaluate(task, samples=8, seed=3, ci="bootstrap")
    again = Evaluation(FakeGenerate(["no"] * 6, chances)).evaluate(task, samples=8, seed=3, ci="bootstrap")
    other = Evaluation(FakeGenerate(["no"] * 6, chances)).evaluate(task, samples=8, seed=4, ci="bootstrap")
    assert first == again
    assert first["per_prompt"] != other["per_prompt"]
    assert set(first["sampled"]) == {"samples", "seed", "mean_reward", "pass@1", "pass@2", "pass@4", "pass@8"}


def test_the_greedy_pass_asks_for_one_greedy_completion():
    generate = FakeGenerate(["yes", "no"], [1.0, 1.0])
    Evaluation(generate).evaluate(yes_task("ab"), samples=2, temperature=0.7, top_p=0.9, llm="main")
    greedy, sampled = generate.calls
    assert greedy == {"do_sample": False, "num_return_sequences": 1, "llm": "main", "max_new_tokens": 64}
    assert sampled == {"do_sample": True, "num_return_sequences": 2, "seed": 0, "temperature": 0.7, "top_p": 0.9,
                       "llm": "main", "max_new_tokens": 64}


def test_logging_prefixes_and_opt_out():
    logged = []
    evaluation = Evaluation(FakeGenerate(["yes", "no"], [1.0, 0.0]), logged.append)
    evaluation.evaluate(yes_task("ab"), log="heldout")
    evaluation.evaluate(yes_task("ab"), log=False)
    (scalars,) = logged
    assert scalars["heldout/greedy/pass@1"] == 0.5 and scalars["heldout/greedy/mean_reward"] == 0.5


def test_bad_arguments_are_refused_by_name():
    evaluation = Evaluation(FakeGenerate(["yes"], [1.0]))
    with pytest.raises(InvalidArgument, match=r"k=\[4\]"):
        evaluation.evaluate(yes_task("a"), samples=2, k=(1, 4))
    with pytest.raises(InvalidArgument, match="num_return_sequences"):
        evaluation.evaluate(yes_task("a"), num_return_sequences=3)
    with pytest.raises(InvalidArgument, match="nothing to evaluate"):
        evaluation.evaluate(yes_task("a"), greedy=False)
    with pytest.raises(InvalidArgument, match="no prompts"):
        evaluation.evaluate(yes_task(()))
    with pytest.raises(InvalidArgument, match="ci="):
        evaluation.evaluate(yes_task("a"), ci="wilson")
    with pytest.raises(TypeError, match="lacks reward"):
        evaluation.evaluate(type("Prompts", (), {"prompts": lambda self: ["a"]})())
    assert default_ks(6) == [1, 2, 4, 6] and default_ks(8) == [1, 2, 4, 8]


def test_the_eval_command_line_splits_into_the_launchers_part_and_the_scripts():
    from llmrl.launch.eval import split_argv

    rest, script = split_argv(["--config", "c.yaml", "reasoning_gym:leg_counting", "--samples", "4",
                               "llms.main.replicas=2", "--no-greedy", "--dry-run", "--k=1,4"])
    assert rest == ["--config", "c.yaml", "llms.main.replicas=2", "--dry-run"]
    assert script == ["reasoning_gym:leg_counting", "--samples", "4", "--no-greedy", "--k=1,4"]
    with pytest.raises(ValueError, match="one TASK"):
        split_argv(["--config", "c.yaml"])
