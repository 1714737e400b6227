"""An OpenEnv environment client as an environment of :func:`~llmrl.engine.client.episodes.run_episodes`: its
observations rendered as the text of chat messages, the model's text parsed into its actions.

OpenEnv (``openenv-core``) serves an environment over HTTP/WebSocket (``openenv.core.create_app`` on a
``openenv.core.Environment``) and talks to it through an ``EnvClient`` (``reset() / step(action)`` giving a
``StepResult``: ``observation``, ``reward``, ``done``). :class:`OpenEnvEnv` wraps one client, one episode at a
time (make one per episode, as ``run_episodes`` needs), as a gymnasium-style text environment:

- ``reset()`` gives ``(render(observation), info)`` and ``step(text)`` gives ``(render(observation), reward, done,
  False, info)``; ``info["observation"]`` is the observation itself and ``info["metadata"]`` its ``metadata``;
- ``render(observation) -> str`` (default :func:`render_observation`: a string field named ``text``, ``message``,
  ``prompt`` or ``content``, else the observation's fields as JSON) and ``parse(text) -> action`` (default
  :func:`parse_json_action`: the text's first JSON object, built into ``action_type`` when given, else sent as a
  dict, as ``GenericEnvClient`` takes it) are the user's to replace;
- **a parse failure ends the episode**: ``parse`` raising gives ``("", parse_penalty, True, False, info)`` with
  ``info["error"]`` naming the text and the error, and nothing is sent to the environment;
- a step the client fails (the server gone, an error answered, a timeout) also ends the episode, reward 0 and
  ``info["error"]`` set, so one broken environment does not end the batch (``reset`` errors propagate: there is no
  episode yet). A ``StepResult`` without a reward counts 0.

An async ``EnvClient`` is used through its ``.sync()`` wrapper. This module adapts; it starts no server and
calls no model.
"""

from __future__ import annotations

import json
from collections.abc import Callable

TEXT_FIELDS = ("text", "message", "prompt", "content")


def render_observation(observation) -> str:
    """An observation's text: its first string field among ``text``, ``message``, ``prompt``, ``content``; else
    its fields (without ``done``, ``reward``, ``metadata``) as JSON."""
    fields = _fields(observation)
    for name in TEXT_FIELDS:
        if isinstance(fields.get(name), str):
            return fields[name]
    if isinstance(observation, str):
        return observation
    rest = {k: v for k, v in fields.items() if k not in ("done", "reward", "metadata")}
    return json.dumps(rest, sort_keys=True, default=str)


def parse_json_action(text: str, action_type=None):
    """The first JSON object in ``text`` (a dict), or ``action_type(**it)`` (an OpenEnv ``Action`` class, whose
    validation errors are parse failures). Raises ValueError when the text holds no JSON object."""
    decoder = json.JSONDecoder()
    for start in [k for k, ch in enumerate(text) if ch == "{"]:
        try:
            value, _ = decoder.raw_decode(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return action_type(**value) if action_type is not None else value
    raise ValueError("the text holds no JSON object")


class OpenEnvEnv:
    """One OpenEnv client as a ``run_episodes`` environment (see the module).

    Args:
        client: an ``EnvClient`` (async: its ``.sync()`` is used) or ``SyncEnvClient``, or any object whose
            ``reset(**kwargs)`` and ``step(action)`` give ``StepResult``-like objects.
        render: ``observation -> str``, the text of the message the model reads.
        parse: ``text -> action``, what is sent to ``client.step``; its exception is a parse failure.
        parse_penalty: the reward of a step whose text did not parse (the episode ends there).
        reset_kwargs: passed to ``client.reset`` (``seed``, ``episode_id``...).

    Example::

        envs = [OpenEnvEnv(GenericEnvClient(base_url=url).sync()) for _ in range(8)]
        episodes = caller.run_episodes(envs, mode="write", max_turns=6)
    """

    def __init__(self, client, *, render: Callable = render_observation, parse: Callable = parse_json_action,
                 parse_penalty: float = 0.0, reset_kwargs: dict | None = None):
        if hasattr(client, "sync") and not hasattr(client, "async_client"):
            client = client.sync()  # an async EnvClient
        for name in ("reset", "step"):
            if not callable(getattr(client, name, None)):
                raise TypeError(f"client must have reset() and step(action) (an OpenEnv EnvClient); "
                                f"{type(client).__name__} has no {name}()")
        self.client = client
        self.render = render
        self.parse = parse
        self.parse_penalty = float(parse_penalty)
        self.reset_kwargs = dict(reset_kwargs or {})
        self.done = True

    def reset(self):
        result = self.client.reset(**self.reset_kwargs)
        self.done = bool(getattr(result, "done", False))
        return self.render(result.observation), self._info(result)

    def step(self, text: str):
        if self.done:
            raise RuntimeError("step() after the episode ended: reset() first")
        try:
            action = self.parse(text)
        except Exception as err:  # noqa: BLE001 - the documented outcome: the episode ends, the error recorded
            self.done = True
            return "", self.parse_penalty, True, False, {"error": f"the action {text!r} did not parse: "
                                                                  f"{type(err).__name__}: {err}", "parsed": False}
        try:
            result = self.client.step(action)
            observation = self.render(result.observation)
        except Exception as err:  # noqa: BLE001 - a broken environment ends its episode, not the batch
            self.done = True
            return "", 0.0, True, False, {"error": f"the environment failed on step({action!r}): "
                                                   f"{type(err).__name__}: {err}", "parsed": True}
        self.done = bool(result.done)
        reward = 0.0 if result.reward is None else float(result.reward)
        return observation, reward, self.done, False, {**self._info(result), "parsed": True}

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if callable(close):
            close()

    @staticmethod
    def _info(result) -> dict:
        fields = _fields(result.observation)
        return {"observation": result.observation, "metadata": fields.get("metadata") or {}}


def _fields(observation) -> dict:
    if isinstance(observation, dict):
        return observation
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    return dict(getattr(observation, "__dict__", {}))
