"""verifiers tasks played by the run's model through llmrl's OpenAI endpoint, scored by their own rewards, and
returned as groups of token-exact episodes for ``grpo_turns`` / ``ppo_turns`` (``episode_batch``) or
``forward_backward`` (:meth:`Trajectory.datum`).

verifiers 0.4 (``verifiers.v1``) describes a task as a :class:`verifiers.v1.Task`: its data (``prompt``,
``system_prompt``, fields of its own) and its scoring, the ``@vf.reward`` methods (weighted) and ``@vf.metric``
ones, which read the finished :class:`verifiers.v1.Trace`. Its own runner plays a task with a *harness* program
started in a runtime (installed by ``uv``, sandboxed); :func:`run_verifiers` plays it in this process instead, with
an OpenAI client on the endpoint, so nothing is installed and every call is captured:

- each rollout (``k`` per task) sends its calls under its own rollout id (``X-Rollout-Id``), so the endpoint keeps
  the exact prompt ids and sampled ids of every turn (:class:`~llmrl.engine.openai_api.capture.CapturedRollout`);
- a turn whose answer calls tools (``Play.tools``: plain Python functions, offered to the model with a JSON schema
  made from their signatures and docstrings) runs them and sends their results back as ``tool`` messages; a tool
  that raises answers ``"error: ..."`` (the model sees it, as OpenAI-style agents do);
- a turn that answers in text ends the rollout, unless ``Play.respond(task, messages)`` replies (a game, a user
  simulator): its text is the next user message, ``None`` ends the rollout; ``Play.max_turns`` model calls end it
  in any case (``truncated``);
- the finished conversation becomes a ``verifiers`` ``Trace`` (the model's messages marked sampled) and
  ``task.score(trace)`` computes the rewards; the rollout's reward is ``trace.reward`` (the weighted sum).

Bad input does not end the batch: a rollout whose client call, tool loop, ``respond`` or scoring raises, or that
runs past ``Play.timeout`` seconds, ends with its error recorded (:attr:`Rollout.error`); a rollout whose capture
forked (the chat template re-rendered its history in other ids: :attr:`Rollout.reasons`) is kept but left out of
the episodes, since no single trajectory holds all its turns. :meth:`VerifiersResult.stats` counts both. This module
drives the endpoint over HTTP and calls ``verifiers`` for scoring; it computes no loss and starts no run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from llmrl.engine.client.episodes import Episode, episode_batch

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Play:
    """How :func:`run_verifiers` plays each task: ``k`` rollouts of it (a GRPO group), ``sampling`` (the chat call's
    fields: ``max_tokens``, ``temperature``, ``seed``...), ``tools`` (Python functions the model may call),
    ``respond(task, messages) -> str | None`` (the environment's reply to a text answer; ``None``: no reply),
    ``max_turns`` model calls at most, ``timeout`` seconds per rollout, ``concurrency`` rollouts at once."""

    k: int = 4
    sampling: dict = field(default_factory=dict)
    tools: tuple = ()
    respond: Callable | None = None
    max_turns: int = 8
    timeout: float = 300.0
    concurrency: int = 8

    def __post_init__(self):
        for name in ("k", "max_turns", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Play.{name} must be an int >= 1, got {value!r}")
        if not self.timeout > 0:
            raise ValueError(f"Play.timeout must be a positive number of seconds, got {self.timeout!r}")
        for tool in self.tools:
            if not callable(tool):
                raise TypeError(f"Play.tools holds {tool!r}, which is not callable: give Python functions")


@dataclass
class Rollout:
    """One rollout of a task: its conversation (OpenAI messages), its reward (``trace.reward``) and each named
    reward and metric, its captured trajectories (one unless it forked: ``reasons`` says why), and its error."""

    task: int  # the task's index in run_verifiers' tasks
    rollout_id: str
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    trajectories: list = field(default_factory=list)
    reasons: list = field(default_factory=list)
    calls: int = 0
    truncated: bool = False
    error: str | None = None

    @property
    def trainable(self) -> bool:
        """Whether it ended without error and one trajectory holds each of its model calls as a turn."""
        return (self.error is None and len(self.trajectories) == 1
                and len(self.trajectories[0].turns) == self.calls > 0)

    def episode(self) -> Episode:
        """The rollout as an :class:`~llmrl.engine.client.episodes.Episode`: its trajectory, the reward on its last
        turn (0 on the others: with ``gamma=1`` each turn's return is the reward)."""
        if not self.trainable:
            raise ValueError(f"rollout {self.rollout_id!r} is not trainable: "
                             f"{self.error or f'{len(self.trajectories)} trajectories for {self.calls} calls'}")
        turns = len(self.trajectories[0].turns)
        actions = [m.get("content") or "" for m in self.messages if m["role"] == "assistant"]
        infos = [{} for _ in range(turns - 1)] + [{"rewards": dict(self.rewards), "metrics": dict(self.metrics)}]
        return Episode(self.trajectories[0], actions, [0.0] * (turns - 1) + [float(self.reward)], infos, done=True,
                       truncated=self.truncated, cut_by="max_turns" if self.truncated else None)


@dataclass
class VerifiersResult:
    """The rollouts of :func:`run_verifiers`, ``rollouts[t]`` the ``k`` of task ``t`` in order."""

    rollouts: list[list[Rollout]]

    def groups(self, min_size: int = 2) -> list[list[Episode]]:
        """Each task's trainable rollouts as episodes (one group per task); a task with fewer than ``min_size``
        of them is left out (GRPO's advantages need two or more)."""
        groups = [[r.episode() for r in task if r.trainable] for task in self.rollouts]
        return [g for g in groups if len(g) >= min_size]

    def batch(self, min_size: int = 2) -> dict:
        """``caller.update(**result.batch())`` for ``grpo_turns`` (or ``ppo_turns``): ``episode_batch`` of
        :meth:`groups`."""
        groups = self.groups(min_size)
        if not groups:
            raise ValueError(f"no task has {min_size} or more trainable rollouts: {self.stats(min_size)}")
        return episode_batch(groups)

    def stats(self, min_size: int = 2) -> dict:
        """Counts: rollouts, trainable, failed (with their errors), forked, truncated, groups kept and left out,
        and the mean reward of the rollouts that were scored."""
        flat = [r for task in self.rollouts for r in task]
        scored = [r.reward for r in flat if r.reward is not None]
        kept = sum(sum(r.trainable for r in task) >= min_size for task in self.rollouts)
        return {"rollouts": len(flat), "trainable": sum(r.trainable for r in flat),
                "failed": sum(r.error is not None for r in flat),
                "forked": sum(r.error is None and len(r.trajectories) > 1 for r in flat),
                "truncated": sum(r.truncated for r in flat), "groups": kept,
                "groups_left_out": len(self.rollouts) - kept,
                "mean_reward": sum(scored) / len(scored) if scored else None,
                "errors": {r.rollout_id: r.error for r in flat if r.error is not None}}


def run_verifiers(endpoint, tasks, play: Play | None = None, *, model: str | None = None,
                  prefix: str | None = None) -> VerifiersResult:
    """Play ``play.k`` rollouts of each verifiers task through ``endpoint`` and score them (see the module).

    Args:
        endpoint: the running endpoint of ``llmrl.openai_endpoint(caller)``.
        tasks: ``verifiers.v1.Task`` objects (a taskset's ``load()``), or any object with ``data`` (a
            ``TaskData``) and an async ``score(trace)``.
        play: how to play them (:class:`Play`; default ``Play()``).
        model: the LLM to sample from (default: the endpoint's first).
        prefix: the rollout ids' prefix (default: a fresh one); rollout ``j`` of task ``t`` is ``{prefix}-{t}-{j}``.

    Returns:
        A :class:`VerifiersResult`: ``.batch()`` for ``grpo_turns``, ``.groups()`` of episodes, ``.stats()``.
    """
    from openai import OpenAI

    play = play or Play()
    tasks = list(tasks)
    if not tasks:
        raise ValueError("run_verifiers needs at least one task")
    for t, task in enumerate(tasks):
        if not hasattr(task, "data") or not callable(getattr(task, "score", None)):
            raise TypeError(f"tasks[{t}] is a {type(task).__name__}, not a verifiers Task (data and score(trace))")
    model = model or endpoint.service.served()[0]
    prefix = prefix or f"vf-{uuid.uuid4().hex[:8]}"
    client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, timeout=play.timeout)
    schemas = [_tool_schema(tool) for tool in play.tools]
    rollouts = [[Rollout(t, f"{prefix}-{t}-{j}") for j in range(play.k)] for t in range(len(tasks))]
    flat = [r for task in rollouts for r in task]
    jobs = [lambda r=r: _play_one(client, model, tasks[r.task], play, schemas, r) for r in flat]
    for rollout, error in zip(flat, _run_all(jobs, play.concurrency, play.timeout)):
        if error is not None:
            rollout.error = error
        try:
            captured = endpoint.pop(rollout.rollout_id)
        except KeyError:  # no call was made (or it never reached the endpoint)
            continue
        rollout.trajectories, rollout.reasons = captured.trajectories, captured.reasons
    return VerifiersResult(rollouts)


def _play_one(client, model: str, task, play: Play, schemas: list[dict], rollout: Rollout) -> None:
    """Play one rollout (its messages grow in place, so that a failure keeps what was played) and score it."""
    messages = rollout.messages
    messages += _prompt(task.data)
    tools = {tool.__name__: tool for tool in play.tools}
    while True:
        answer = client.chat.completions.create(model=model, messages=messages, tools=schemas or None,
                                                extra_headers={"X-Rollout-Id": rollout.rollout_id},
                                                **play.sampling)
        rollout.calls += 1
        message = answer.choices[0].message.model_dump(exclude_none=True)
        message = {key: message[key] for key in ("role", "content", "tool_calls") if key in message}
        messages.append(message)
        if message.get("tool_calls"):
            messages += [_tool_result(tools, call) for call in message["tool_calls"]]
        else:
            reply = play.respond(task, [dict(m) for m in messages]) if play.respond is not None else None
            if reply is None:
                break
            messages.append({"role": "user", "content": str(reply)})
        if rollout.calls >= play.max_turns:  # the conversation would go on: cut, its last reply kept for scoring
            rollout.truncated = True
            break
    rollout.reward, rollout.rewards, rollout.metrics = score(task, messages)


def score(task, messages: list[dict]) -> tuple[float, dict[str, float], dict[str, float | None]]:
    """``(reward, rewards, metrics)`` of ``task.score`` on a conversation of OpenAI messages: the weighted sum
    (``trace.reward``), each reward's weighted value by name, and the metrics."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    nodes = [MessageNode(parent=k - 1 if k else None, message=_vf_message(vf, m), sampled=m["role"] == "assistant")
             for k, m in enumerate(messages)]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)
    asyncio.run(task.score(trace))
    rewards = {name: r.value for name, r in trace.rewards.items() if r is not None}
    return float(trace.reward), rewards, dict(trace.metrics)


def _prompt(data) -> list[dict]:
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    if not data.prompt:
        raise ValueError("the task has no prompt: run_verifiers plays tasks whose data.prompt opens the conversation")
    return messages + [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt]


def _vf_message(vf, message: dict):
    role = message["role"]
    if role == "assistant":
        calls = [vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in message.get("tool_calls") or []]
        return vf.AssistantMessage(content=message.get("content"), tool_calls=calls or None)
    if role == "tool":
        return vf.ToolMessage(tool_call_id=message["tool_call_id"], content=message["content"])
    kind = {"system": vf.SystemMessage, "user": vf.UserMessage}[role]
    return kind(content=message["content"])


def _tool_result(tools: dict, call: dict) -> dict:
    name = call["function"]["name"]
    try:
        if name not in tools:
            raise KeyError(f"no tool named {name!r}; the tools are {', '.join(tools) or 'none'}")
        arguments = json.loads(call["function"]["arguments"] or "{}")
        content = str(tools[name](**arguments))
    except Exception as err:  # noqa: BLE001 - a tool's failure is the model's to see, not the batch's
        content = f"error: {type(err).__name__}: {err}"
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def _tool_schema(tool) -> dict:
    """OpenAI's function schema of a Python function: its name, its docstring, its parameters' JSON types (from
    their annotations; a parameter without a default is required)."""
    properties, required = {}, []
    for name, parameter in inspect.signature(tool).parameters.items():
        kind = parameter.annotation if parameter.annotation is not inspect.Parameter.empty else str
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(kind, kind)  # postponed annotations
        properties[name] = {"type": _JSON_TYPES.get(kind, "string")}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": tool.__name__, "description": inspect.getdoc(tool) or "",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def _run_all(jobs: list, concurrency: int, timeout: float) -> list[str | None]:
    """Run ``jobs`` on daemon threads, ``concurrency`` at once; each one's error (None: it ended well). A job past
    ``timeout`` seconds is abandoned (its thread runs on, its slot is freed) and its error says so."""
    finished: queue.Queue = queue.Queue()
    errors: list[str | None] = [None] * len(jobs)
    deadlines: dict[int, float] = {}
    waiting = list(range(len(jobs)))[::-1]

    def work(index: int) -> None:
        try:
            jobs[index]()
            finished.put((index, None))
        except BaseException as err:  # noqa: BLE001 - recorded on the rollout; the batch goes on
            finished.put((index, f"{type(err).__name__}: {err}"))

    while waiting or deadlines:
        while waiting and len(deadlines) < concurrency:
            index = waiting.pop()
            deadlines[index] = time.monotonic() + timeout
            threading.Thread(target=work, args=(index,), name=f"llmrl-verifiers-{index}", daemon=True).start()
        try:
            index, error = finished.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
        except queue.Empty:
            now = time.monotonic()
            for index in [i for i, deadline in deadlines.items() if deadline <= now]:
                errors[index] = f"TimeoutError: the rollout ran past its timeout of {timeout:g} s"
                del deadlines[index]
            continue
        if index in deadlines:  # a late answer of an abandoned job is ignored
            del deadlines[index]
            errors[index] = error
    return errors
