"""Token-exact capture of the endpoint's calls, by rollout: the prompt ids each call generated from, and the ids it
sampled with their log-probs, kept as :class:`~llmrl.engine.client.trajectory.Trajectory` objects built from those
ids, never re-tokenised.

A rollout (one agent episode: the calls a client makes under one rollout id) holds one or more *branches*. A call
extends the branch whose ids its prompt starts with (the longest such): the prompt's new ids (the environment's
reply, the template's turn markers) are added as given, then the sampled ids as the model's turn. A prompt that
extends no branch starts a new one, which says why (:attr:`CapturedRollout.reasons`): a chat template that rewrote
the history (Qwen3 dropping earlier reasoning), a completion that re-tokenised into other ids, or an earlier prompt
sampled again. Training on the old branch as if the model had seen the new prompt would train on tokens the model
never saw. A call with ``n`` choices continues its branch with the first choice; each other choice is a sibling
branch sharing the prefix.

The RL script reads a rollout (:meth:`Captures.rollout`) or takes it out (:meth:`Captures.pop`); a rollout that
no call touched for ``timeout`` seconds is dropped with a warning when the next call is recorded, so that memory
stays bounded whatever the clients do. This module keeps ids; it calls no model and formats no message.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from llmrl.engine.log import logger

DEFAULT_TIMEOUT = 600.0  # seconds a rollout is kept after its last call


@dataclass
class Branch:
    llm: str
    start: list[int]  # the prompt of its first call
    steps: list[tuple[str, object]] = field(default_factory=list)  # ("ids", [...]) or ("sample", {...}), in order
    ids: list[int] = field(default_factory=list)  # every id so far
    reason: str | None = None  # why it does not continue the rollout's earlier branches (None: the first)

    def extend(self, prompt: list[int], sample: dict) -> None:
        if prompt[len(self.ids):]:
            self.steps.append(("ids", prompt[len(self.ids):]))
        self.steps.append(("sample", sample))
        self.ids = list(prompt) + list(sample["tokens"])


@dataclass
class _Rollout:
    branches: list[Branch] = field(default_factory=list)
    calls: int = 0
    touched: float = 0.0


@dataclass
class CapturedRollout:
    """A rollout's calls as trajectories: ``trajectories[0]`` is the first branch; ``reasons[k]`` says why
    trajectory ``k`` starts anew (None for the first), ``llms[k]`` which LLM sampled it."""

    rollout_id: str
    trajectories: list
    reasons: list[str | None]
    llms: list[str]
    calls: int


class Captures:
    """The rollouts of an endpoint, by id (thread-safe: the HTTP server records from many threads)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, clock=time.monotonic):
        if not timeout > 0:
            raise ValueError(f"the rollout timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = timeout
        self._clock = clock
        self._rollouts: dict[str, _Rollout] = {}
        self._lock = threading.Lock()

    def record(self, rollout_id: str, llm: str, prompt: list[int], samples: list[dict]) -> None:
        """Record a call: its prompt ids and its samples (``tokens``, ``logprobs``, ``sampling_logprobs``)."""
        prompt = [int(t) for t in prompt]
        samples = [_kept(s) for s in samples]
        with self._lock:
            self._drop_expired()
            rollout = self._rollouts.setdefault(rollout_id, _Rollout())
            rollout.calls += 1
            rollout.touched = self._clock()
            branch = _extended(rollout.branches, llm, prompt)
            if branch is None:
                branch = Branch(llm, prompt, reason=_why(rollout.branches, llm, prompt))
                rollout.branches.append(branch)
            siblings = [Branch(llm, branch.start, list(branch.steps), list(branch.ids),
                               f"choice {k} of the {len(samples)} sampled by call {rollout.calls}")
                        for k in range(1, len(samples))]
            branch.extend(prompt, samples[0])
            for sibling, sample in zip(siblings, samples[1:]):
                sibling.extend(prompt, sample)
            rollout.branches += siblings

    def ids(self) -> list[str]:
        """The ids of the rollouts kept now."""
        with self._lock:
            return list(self._rollouts)

    def rollout(self, rollout_id: str, tokenizer_of) -> CapturedRollout:
        """The rollout's trajectories (it stays kept); ``tokenizer_of(llm)`` gives each trajectory's tokenizer."""
        with self._lock:
            rollout = self._find(rollout_id)
            branches, calls = list(rollout.branches), rollout.calls
        return _captured(rollout_id, branches, calls, tokenizer_of)

    def pop(self, rollout_id: str, tokenizer_of) -> CapturedRollout:
        """The rollout's trajectories, and the rollout forgotten (its id may start a new rollout)."""
        with self._lock:
            rollout = self._find(rollout_id)
            del self._rollouts[rollout_id]
        return _captured(rollout_id, rollout.branches, rollout.calls, tokenizer_of)

    def _find(self, rollout_id: str) -> _Rollout:
        if rollout_id not in self._rollouts:
            raise KeyError(f"no rollout {rollout_id!r} was captured (or it was popped, or dropped after "
                           f"{self.timeout:g} s without a call); calls are captured under the X-Rollout-Id header "
                           "or the body's user field")
        return self._rollouts[rollout_id]

    def _drop_expired(self) -> None:
        now = self._clock()
        for rollout_id in [r for r, rollout in self._rollouts.items() if now - rollout.touched > self.timeout]:
            rollout = self._rollouts.pop(rollout_id)
            logger.warning("the OpenAI endpoint dropped rollout %r (%d call(s)): no call for %g s and the script "
                           "did not pop it; pop each rollout once its episode ends (endpoint.pop)", rollout_id,
                           rollout.calls, self.timeout)


def _kept(sample: dict) -> dict:
    tokens = [int(t) for t in _list(sample["tokens"])]
    raw = [float(x) for x in _list(sample["logprobs"])]
    sampled = sample.get("sampling_logprobs")
    return {"tokens": tokens, "logprobs": raw, "sampling_logprobs": raw if sampled is None else
            [float(x) for x in _list(sampled)]}


def _extended(branches: list[Branch], llm: str, prompt: list[int]) -> Branch | None:
    """The branch with the most ids that ``prompt`` starts with (the latest of equals), or None."""
    best = None
    for branch in branches:
        if branch.llm == llm and prompt[:len(branch.ids)] == branch.ids and (best is None or
                                                                              len(branch.ids) >= len(best.ids)):
            best = branch
    return best


def _why(branches: list[Branch], llm: str, prompt: list[int]) -> str | None:
    """Why ``prompt`` starts a new branch instead of continuing the latest one of its LLM (None: the first)."""
    latest = next((b for b in reversed(branches) if b.llm == llm), None)
    if latest is None:
        return None if not branches else f"the first call to LLM {llm!r} in this rollout"
    ids = latest.ids
    at = next((k for k, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
    if at == len(prompt):
        return f"the prompt ({len(prompt)} ids) is a prefix of the earlier trajectory: an earlier prompt sampled again"
    completion = len(ids) - len(latest.steps[-1][1]["tokens"])
    if at >= completion:
        return (f"the prompt differs from the earlier trajectory at id {at}, inside the model's last completion: "
                "the chat template or the client gave it back in other ids (reasoning dropped, its text tokenised "
                "another way, an edit)")
    return (f"the prompt differs from the earlier trajectory at id {at}, before the model's last completion: the "
            "chat template (or the client) rewrote the history (earlier reasoning dropped, a message edited)")


def _captured(rollout_id: str, branches: list[Branch], calls: int, tokenizer_of) -> CapturedRollout:
    from llmrl.engine.client.trajectory import Trajectory

    trajectories = []
    for branch in branches:
        trajectory = Trajectory(tokenizer_of(branch.llm), branch.start)
        for kind, value in branch.steps[1 if branch.steps and branch.steps[0][0] == "ids" else 0:]:
            trajectory.add_ids(value) if kind == "ids" else trajectory.add_sample(value)
        trajectories.append(trajectory)
    return CapturedRollout(rollout_id, trajectories, [b.reason for b in branches], [b.llm for b in branches], calls)


def _list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)
