"""reasoning-gym datasets as tasks: :class:`ReasoningGymTask` turns ``reasoning_gym.create_dataset(name, size=,
seed=)`` into prompts (chat messages or text, with a system prompt that asks for the answer in a set form) and a
verifier reward (a completion's text -> the dataset's own ``score_answer`` on the answer extracted from it), with
held-out splits (:meth:`ReasoningGymTask.held_out`).

Answer extraction (``answer_format``): ``"tag"`` takes the last ``<answer>...</answer>`` (reasoning-gym's own
convention, as ``reasoning_gym.utils.extract_answer``), ``"last_line"`` the last non-empty line, ``"last_number"``
the last number (numeric datasets, small models that answer in a sentence), ``"full"`` the whole completion
stripped; or pass a function ``completion -> str | None``. A completion with no answer scores what
``score_answer(None, entry)`` gives (0.0 for every dataset we know).

reasoning-gym draws entry ``i`` of a dataset with seed ``s`` from ``Random(s + i)``: seed 1's first entry is seed 0's
second, so two seeds close together share most entries. :meth:`ReasoningGymTask.held_out` therefore starts past
this task's range of entries and also drops any entry whose question this task holds.

The task is an :class:`~llmrl.engine.envs.eval_task.EvalTask`. This module generates nothing; reasoning-gym is
imported when a task is built (``pip install reasoning-gym``, or the ``envs`` extra).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
DEFAULT_SYSTEM_PROMPT = ("Answer the question. Give only the final answer between <answer> and </answer> tags, "
                         "for example <answer>42</answer>.")
LAST_LINE_SYSTEM_PROMPT = "Answer the question. Write the final answer alone on the last line."


def extract_tag(completion: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` in ``completion``, stripped; None when there is none."""
    matches = ANSWER_TAG.findall(completion)
    return matches[-1].strip() if matches else None


def extract_last_line(completion: str) -> str | None:
    """The last non-empty line of ``completion``, stripped; None when there is none."""
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract_last_number(completion: str) -> str | None:
    """The last number in ``completion`` (``-12``, ``3.5``); None when there is none. For small models that answer
    in a sentence ("6 + 5 = 11, so the answer is 11.")."""
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def extract_full(completion: str) -> str | None:
    """The whole completion, stripped; None when empty."""
    return completion.strip() or None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "tag": extract_tag, "last_line": extract_last_line, "last_number": extract_last_number, "full": extract_full}


def extractor(answer_format: str | Callable[[str], str | None]) -> Callable[[str], str | None]:
    """The extraction function ``answer_format`` names (a key of :data:`EXTRACTORS`), or the function itself."""
    if callable(answer_format):
        return answer_format
    if answer_format not in EXTRACTORS:
        raise ValueError(f"answer_format={answer_format!r}: give one of {', '.join(EXTRACTORS)} or a function "
                         "completion -> answer")
    return EXTRACTORS[answer_format]


class ReasoningGymTask:
    """A reasoning-gym dataset as prompts and a verifier reward.

    Args:
        name: the dataset's name in reasoning-gym (``"basic_arithmetic"``, ``"leg_counting"``, ...).
        size: how many entries.
        seed: the dataset's seed (entry ``i`` comes from ``seed + i``).
        dataset_args: the dataset's own settings (``{"min_digits": 1, "max_digits": 1}``), as
            ``reasoning_gym.create_dataset`` takes them.
        system_prompt: the instruction put before each question (a system message, or the first paragraph of a
            text prompt); None for none. The default asks for ``<answer>...</answer>``; with
            ``answer_format="last_line"`` or ``"last_number"``, for the answer on the last line.
        answer_format: how the answer is taken out of a completion: ``"tag"``, ``"last_line"``,
            ``"last_number"``, ``"full"`` or a function ``completion -> str | None``.
        chat: prompts as chat messages (for an instruct model's chat template); False: plain text.
        exclude_questions: questions to skip (the entries kept are the first ``size`` others).

    Raises:
        ValueError: an unknown dataset or setting (reasoning-gym's message), or too few distinct entries.

    Example::

        train = ReasoningGymTask("leg_counting", size=200, seed=0)
        test = train.held_out(size=50)
        reward = test.reward(0, "<answer>12</answer>")   # the dataset's score_answer("12", entry)
    """

    def __init__(self, name: str, *, size: int = 100, seed: int = 0, dataset_args: dict | None = None,
                 system_prompt: str | None | bool = True, answer_format: str | Callable = "tag", chat: bool = True,
                 exclude_questions: Collection[str] = ()):
        import reasoning_gym

        if size < 1:
            raise ValueError(f"size={size}: give at least 1 entry")
        self.name, self.size, self.seed, self.chat = name, size, seed, chat
        self.dataset_args = dict(dataset_args or {})
        self.answer_format = answer_format
        self.extract = extractor(answer_format)
        if system_prompt is True:
            last = answer_format in ("last_line", "last_number")
            system_prompt = LAST_LINE_SYSTEM_PROMPT if last else DEFAULT_SYSTEM_PROMPT
        self.system_prompt = system_prompt or None
        excluded = set(exclude_questions)
        scan = 4 * (size + len(excluded)) + 16  # entries are drawn lazily: a large size costs nothing
        self.dataset = reasoning_gym.create_dataset(name, size=scan, seed=seed, **self.dataset_args)
        self.entries: list[dict] = []
        self.scanned = 0  # entries of the dataset looked at (kept or skipped): this task's range of seeds
        for index in range(scan):
            self.scanned = index + 1
            entry = self.dataset[index]
            if entry["question"] not in excluded:
                self.entries.append(entry)
                if len(self.entries) == size:
                    break
        if len(self.entries) < size:
            raise ValueError(f"{name}: only {len(self.entries)} of {scan} entries (seed {seed}) are not excluded; "
                             f"ask for fewer than {size}, or widen the dataset's settings")

    def prompts(self) -> list:
        """Per entry, its question with the system prompt: chat messages, or (``chat=False``) text."""
        return [self.prompt(entry["question"]) for entry in self.entries]

    def prompt(self, question: str) -> Any:
        """One question as this task asks it."""
        if self.chat:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return [*system, {"role": "user", "content": question}]
        return f"{self.system_prompt}\n\n{question}\n" if self.system_prompt else f"{question}\n"

    def answers(self) -> list[str]:
        """The reference answer of each entry."""
        return [entry["answer"] for entry in self.entries]

    def reward(self, prompt_index: int, completion: str) -> float:
        """The dataset's ``score_answer`` of the answer extracted from ``completion`` (None when there is none)."""
        entry = self.entries[prompt_index]
        return float(self.dataset.score_answer(self.extract(completion), entry))

    def held_out(self, size: int, seed: int | None = None) -> ReasoningGymTask:
        """A task of ``size`` entries of the same dataset that this task does not hold: drawn from ``seed`` (default:
        the first seed past this task's range, ``self.seed + scanned``), skipping every question of this task.
        The same settings (system prompt, extraction, chat) apply."""
        return ReasoningGymTask(self.name, size=size, seed=self.seed + self.scanned if seed is None else seed,
                                dataset_args=self.dataset_args, system_prompt=self.system_prompt or False,
                                answer_format=self.answer_format, chat=self.chat,
                                exclude_questions={entry["question"] for entry in self.entries})

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.name!r}, size={self.size}, seed={self.seed})"
