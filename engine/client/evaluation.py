"""The Caller's evaluation harness: :meth:`Evaluation.evaluate` generates completions for a task's prompts, scores
them with the task's reward and reports the mean reward and pass@k, each with a confidence interval, greedy and
sampled, and logs them through the run's tracking.

A task is any :class:`~llmrl.engine.envs.eval_task.EvalTask` (``prompts()`` and ``reward(prompt_index,
completion)``): a reasoning-gym dataset, a :class:`~llmrl.engine.envs.eval_task.FunctionTask`, an adapter. The
greedy pass decodes one completion per prompt (``do_sample=False``); the sampled pass draws ``samples`` per prompt
with the call's ``seed``, so a seeded evaluation of the same weights gives the same report. pass@k is the unbiased
estimator of :func:`~llmrl.engine.eval_statistics.pass_at_k`, averaged over prompts; intervals come from
:func:`~llmrl.engine.eval_statistics.mean_interval`, over prompts.

:class:`Evaluation` is a part of :class:`~llmrl.engine.client.caller.Caller`, given the Caller's ``generate`` and
``log`` (any functions of the same form: the unit tests give it fakes). It computes no statistic itself and sends
nothing but through ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llmrl.engine.envs.eval_task import check_task, task_name
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.eval_statistics import CI_METHODS, mean_interval, pass_at_k

DEFAULT_MAX_NEW_TOKENS = 64
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "typical_p")  # left out of the greedy pass
SET_HERE = ("do_sample", "num_return_sequences", "num_beams")


def default_ks(samples: int) -> list[int]:
    """1, 2, 4, ... up to ``samples``, and ``samples`` itself."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples] if samples else []


class Evaluation:
    """``evaluate``: a task's mean reward and pass@k with confidence intervals.

    Args:
        generate: a function like :meth:`Caller.generate` (contexts and keyword options -> per context a list of
            dicts with ``text``).
        log: a function like :meth:`Caller.log` (scalars -> written at the current step), or None.
    """

    def __init__(self, generate: Callable[..., list[list[dict]]], log: Callable[[dict], Any] | None = None):
        self._generate = generate
        self._log = log

    def evaluate(self, task, *, samples: int = 0, k: Sequence[int] | None = None, greedy: bool = True,
                 seed: int = 0, ci: str = "normal", confidence: float = 0.95, log: bool | str = True,
                 **generate_kwargs) -> dict:
        """Evaluate the LLM on ``task``: its mean reward and pass@k, each with a confidence interval over prompts.

        Args:
            task: an evaluation task: ``prompts()`` and ``reward(prompt_index, completion) -> float``
                (:class:`llmrl.engine.envs.ReasoningGymTask`, :class:`llmrl.engine.envs.FunctionTask`, ...). A
                completion passes when its reward reaches the task's ``pass_threshold`` (1.0 when it has none).
            samples: completions sampled per prompt (``do_sample=True``); 0 for the greedy pass only.
            k: the pass@k to report from the samples (default 1, 2, 4, ... up to ``samples``); each in
                ``1..samples``.
            greedy: also decode one greedy completion per prompt (its pass rate is greedy pass@1).
            seed: the sampling seed (the same seed and weights give the same samples) and the bootstrap's.
            ci: ``"normal"`` (mean ± z·s/√m over the m prompts) or ``"bootstrap"`` (percentile, 2,000 resamples of
                the prompts, seeded with ``seed``).
            confidence: the intervals' level.
            log: write the scalars through the run's tracking under ``eval/<task name>/`` (True), under another
                prefix (a string), or not (False). They go at the current step (the number of updates so far).
            **generate_kwargs: for :meth:`Caller.generate`: ``llm``, ``peft_adapter``, ``max_new_tokens``
                (default 64), ``temperature``, ``top_p``, ``stop``, ... (sampling options apply to the sampled pass).

        Returns:
            A JSON-ready dict: ``task``, ``prompts``, ``ci`` (method and confidence), ``greedy`` (``mean_reward``
            and ``pass@1``) and/or ``sampled`` (``samples``, ``seed``, ``mean_reward``, ``pass@K`` per k), each
            figure as ``{"value": v, "ci": [low, high]}`` (``ci`` None with one prompt), and ``per_prompt``:
            the rewards of each prompt's greedy and sampled completions.

        Raises:
            InvalidArgument: no prompts, ``k`` outside ``1..samples``, nothing to do, or an option the harness sets
                itself (``do_sample``, ``num_return_sequences``, ``num_beams``).

        Example::

            task = ReasoningGymTask("leg_counting", size=50, seed=10_000)
            report = caller.evaluate(task, samples=8, k=(1, 4, 8), temperature=1.0, seed=0)
            report["sampled"]["pass@4"]        # {"value": 0.41, "ci": [0.30, 0.52]}
        """
        task = check_task(task)
        prompts = list(task.prompts())
        ks = self._check(prompts, samples, k, greedy, ci, generate_kwargs)
        generate_kwargs.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        threshold = float(getattr(task, "pass_threshold", 1.0))
        report: dict[str, Any] = {"task": task_name(task), "prompts": len(prompts),
                                  "ci": {"method": ci, "confidence": confidence}}
        per_prompt: list[dict] = [{} for _ in prompts]
        if greedy:
            options = {key: value for key, value in generate_kwargs.items() if key not in SAMPLING_ONLY}
            rewards = [r[0] for r in self._rewards(task, prompts, do_sample=False, num_return_sequences=1, **options)]
            for row, reward in zip(per_prompt, rewards):
                row["greedy"] = reward
            report["greedy"] = {
                "mean_reward": mean_interval(rewards, ci, confidence, seed),
                "pass@1": bounded(mean_interval([float(r >= threshold) for r in rewards], ci, confidence, seed))}
        if samples:
            drawn = self._rewards(task, prompts, do_sample=True, num_return_sequences=samples, seed=seed,
                                  **generate_kwargs)
            for row, rewards in zip(per_prompt, drawn):
                row["sampled"] = rewards
            passes = [sum(r >= threshold for r in rewards) for rewards in drawn]
            sampled: dict[str, Any] = {
                "samples": samples, "seed": seed,
                "mean_reward": mean_interval([sum(r) / samples for r in drawn], ci, confidence, seed)}
            for size in ks:
                estimates = [pass_at_k(samples, c, size) for c in passes]
                sampled[f"pass@{size}"] = bounded(mean_interval(estimates, ci, confidence, seed))
            report["sampled"] = sampled
        report["per_prompt"] = per_prompt
        if log and self._log is not None:
            self._log(scalars(report, log if isinstance(log, str) else f"eval/{report['task']}"))
        return report

    def _rewards(self, task, prompts: list, **options) -> list[list[float]]:
        """Per prompt, the rewards of the completions ``generate`` returns for it."""
        outputs = self._generate(prompts, **options)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"generate returned {len(outputs)} results for {len(prompts)} prompts")
        return [[float(task.reward(i, out["text"])) for out in completions] for i, completions in enumerate(outputs)]

    @staticmethod
    def _check(prompts: list, samples: int, k, greedy: bool, ci: str, generate_kwargs: dict) -> list[int]:
        """The ks to report, after refusing what cannot be evaluated."""
        if not prompts:
            raise InvalidArgument("evaluate: the task has no prompts")
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise InvalidArgument(f"evaluate: samples={samples!r}; give a count of completions per prompt (0: none)")
        if not samples and not greedy:
            raise InvalidArgument("evaluate: samples=0 and greedy=False leave nothing to evaluate")
        if ci not in CI_METHODS:
            raise InvalidArgument(f"evaluate: ci={ci!r}; give one of {', '.join(CI_METHODS)}")
        taken = [key for key in SET_HERE if key in generate_kwargs]
        if taken:
            raise InvalidArgument(f"evaluate sets {', '.join(taken)} itself (greedy: one completion, do_sample=False; "
                                  "sampled: samples=N completions): leave them out")
        ks = default_ks(samples) if k is None else [int(size) for size in k]
        bad = [size for size in ks if not 1 <= size <= samples]
        if bad:
            raise InvalidArgument(f"evaluate: k={bad} outside 1..samples (samples={samples}); pass@k needs k "
                                  "sampled completions per prompt")
        return ks


def bounded(figure: dict) -> dict:
    """A rate's figure with its interval clipped to [0, 1] (the normal approximation may overshoot)."""
    if figure["ci"] is not None:
        figure["ci"] = [max(0.0, figure["ci"][0]), min(1.0, figure["ci"][1])]
    return figure


def scalars(report: dict, prefix: str) -> dict[str, float]:
    """The report's figures as tracker scalars: ``PREFIX/greedy/pass@1``, ``PREFIX/greedy/pass@1_low``, ... """
    out: dict[str, float] = {}
    for mode in ("greedy", "sampled"):
        for name, figure in report.get(mode, {}).items():
            if isinstance(figure, dict):
                out[f"{prefix}/{mode}/{name}"] = figure["value"]
                if figure["ci"] is not None:
                    out[f"{prefix}/{mode}/{name}_low"], out[f"{prefix}/{mode}/{name}_high"] = figure["ci"]
    return out
