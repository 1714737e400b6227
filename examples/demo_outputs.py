"""What the examples write besides their summary: ``metrics.csv`` (one row per update) and the parts of
``curve.png`` they share (a figure with the training curve on the left and the held-out measure before and after
training as two bars, with their 95% intervals, on the right).

The examples import this module from their own folder (``llmrl run`` puts a script's folder on the path, as Python
does). It draws and writes; what is measured is the example's.
"""

from __future__ import annotations

import csv


def write_metrics(history: list[dict], path: str) -> None:
    """``metrics.csv``: one row per update, the columns of the first row."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(history[0]))
        writer.writeheader()
        writer.writerows(history)


def curve_and_bars_figure():
    """``(pyplot, figure, left axis, right axis)``: a wide left axis for the curve, a narrow right one for the bars
    (matplotlib's Agg back end: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    return plt, fig, left, right


def before_after_bars(axis, before: dict, after: dict, key: str = "mean_reward") -> None:
    """A held-out measure (``key``) before and after training as two bars, with their 95% intervals."""
    values = [before[key], after[key]]
    errors = [[max(0.0, v - e["ci95"][0]) for v, e in zip(values, (before, after))],  # never below 0 (rounding)
              [max(0.0, e["ci95"][1] - v) for v, e in zip(values, (before, after))]]
    axis.bar(["before", "after"], values, yerr=errors, capsize=8, color=["#bbbbbb", "#4c72b0"])


def reward_curve(history: list[dict], before: dict, after: dict, path: str, *, title: str, reward_label: str,
                 kl_label: str, kl_unit: str) -> None:
    """``curve.png`` of a reward-trained example: the sampled training reward per update (with the KL per update on
    a second axis, when the rows have one), and the greedy held-out reward before and after as bars."""
    plt, fig, left, right = curve_and_bars_figure()
    x = [row["update"] for row in history]
    left.plot(x, [row["reward"] for row in history], "o-", label="training reward (sampled)")
    left.set_xlabel("update")
    left.set_ylabel(reward_label)
    left.set_title(title)
    if all("kl" in row for row in history):
        kl_axis = left.twinx()
        kl_axis.plot(x, [row["kl"] for row in history], "s--", color="#c44e52", label=kl_label)
        kl_axis.set_ylabel(f"KL (nats per {kl_unit})")
        kl_axis.legend(loc="lower right")
    left.legend(loc="upper left")
    before_after_bars(right, before, after)
    right.set_title(f"greedy, {before['prompts']} held-out\nprompts (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
