"""What an evaluation or a reward loop needs of a task: :class:`EvalTask`, a list of prompts and a reward for a
completion of each, and :class:`FunctionTask`, a task made of prompts and a plain Python function.

Any object with ``prompts()`` and ``reward(prompt_index, completion)`` is a task (the protocol is structural): a
reasoning-gym dataset (:class:`~llmrl.engine.envs.reasoning_gym_tasks.ReasoningGymTask`), or an adapter over
another library's environments. :func:`check_task` refuses an object that is not one, naming what it lacks. This
module generates nothing and computes no statistic (:mod:`llmrl.engine.client.evaluation` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EvalTask(Protocol):
    """A task: prompts, and a reward for a completion of each.

    Optional attributes: ``name`` (a label for logs and reports) and ``pass_threshold`` (the reward at or above
    which a completion counts as a pass for pass@k; 1.0 when absent).
    """

    def prompts(self) -> list:
        """The prompts, in a fixed order: strings, or chat messages (lists of ``{"role", "content"}`` dicts) that
        the served tokenizer's chat template renders."""
        ...

    def reward(self, prompt_index: int, completion: str) -> float:
        """The reward of ``completion`` (the generated text alone, without the prompt) for prompt ``prompt_index``
        (its position in :meth:`prompts`)."""
        ...


class FunctionTask:
    """A task made of prompts and a function ``reward_fn(prompt, completion) -> float``.

    Args:
        prompts: the prompts (strings or chat messages).
        reward_fn: called with the prompt itself (not its index) and the completion's text.
        name: a label for logs and reports.
        pass_threshold: the reward at or above which a completion passes (pass@k).

    Example::

        task = FunctionTask(["2+2=", "3+4="], lambda p, c: float(c.strip().startswith(str(eval(p[:-1])))))
    """

    def __init__(self, prompts: Sequence, reward_fn: Callable[[Any, str], float], *, name: str = "function",
                 pass_threshold: float = 1.0):
        self._prompts = list(prompts)
        self.reward_fn = reward_fn
        self.name = name
        self.pass_threshold = pass_threshold

    def prompts(self) -> list:
        return list(self._prompts)

    def reward(self, prompt_index: int, completion: str) -> float:
        return float(self.reward_fn(self._prompts[prompt_index], completion))


def check_task(task: Any) -> EvalTask:
    """``task`` itself, after checking it has callable ``prompts`` and ``reward``; TypeError naming what it lacks."""
    missing = [name for name in ("prompts", "reward") if not callable(getattr(task, name, None))]
    if missing:
        raise TypeError(f"{type(task).__name__} is not an evaluation task: it lacks {' and '.join(missing)}() "
                        "(a task has prompts() -> list and reward(prompt_index, completion) -> float; "
                        "wrap prompts and a function with llmrl.engine.envs.FunctionTask)")
    return task


def task_name(task: Any) -> str:
    """The task's ``name`` attribute, else its class name."""
    name = getattr(task, "name", None)
    return str(name) if name else type(task).__name__
