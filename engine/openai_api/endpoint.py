"""The OpenAI-compatible endpoint inside an RL script: ``with llmrl.openai_endpoint(caller) as endpoint:`` serves the
run's LLMs on a thread of the script, for any agent framework that speaks OpenAI's API, and hands the script each
rollout's token-exact trajectories.

Example::

    with Caller() as caller, openai_endpoint(caller) as endpoint:
        agent = MyAgent(base_url=endpoint.base_url, api_key=endpoint.api_key)   # any OpenAI client
        agent.play(episode_id="ep-0")         # its calls carry X-Rollout-Id: ep-0 (or user="ep-0")
        rollout = endpoint.pop("ep-0")        # CapturedRollout: trajectories, why each one forked
        datum = rollout.trajectories[0].datum(advantages=[1.0] * len(rollout.trajectories[0].turns))

This module starts and stops the server on a thread; the calls are :mod:`llmrl.engine.openai_api.service`'s, the
capture :mod:`llmrl.engine.openai_api.capture`'s.
"""

from __future__ import annotations

import secrets
import threading

from llmrl.engine.openai_api.capture import DEFAULT_TIMEOUT, CapturedRollout


class Endpoint:
    """A running endpoint: ``base_url`` (ends with ``/v1``, as the OpenAI SDK's ``base_url`` takes it), ``api_key``,
    and the captured rollouts (:meth:`rollout`, :meth:`trajectories`, :meth:`pop`, :meth:`rollout_ids`)."""

    def __init__(self, service, server, api_key: str):
        self.service = service
        self._server = server
        host, port = server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self.base_url = f"{self.url}/v1"
        self.api_key = api_key
        threading.Thread(target=server.serve_forever, args=(0.1,), name="llmrl-openai-http",  # close waits <= 0.1 s
                         daemon=True).start()

    def rollout(self, rollout_id: str) -> CapturedRollout:
        """The calls captured under ``rollout_id`` so far, as trajectories (the rollout stays kept).

        Raises:
            KeyError: no rollout of that id is kept (never captured, popped, or dropped after its timeout).
        """
        return self.service.captures.rollout(rollout_id, self.service.tokenizer)

    def trajectories(self, rollout_id: str) -> list:
        """The rollout's :class:`~llmrl.Trajectory` objects: one for an episode whose every prompt extended the
        previous prompt and completion, more where it forked (:meth:`rollout` says why)."""
        return self.rollout(rollout_id).trajectories

    def pop(self, rollout_id: str) -> CapturedRollout:
        """Like :meth:`rollout`, and the rollout is forgotten: pop each rollout once its episode ends (one left
        unpopped is dropped, with a warning, ``rollout_timeout`` seconds after its last call)."""
        return self.service.captures.pop(rollout_id, self.service.tokenizer)

    def rollout_ids(self) -> list[str]:
        """The ids of the rollouts kept now."""
        return self.service.captures.ids()

    def close(self) -> None:
        """Stop serving (a request in progress is answered first); the rollouts stay readable."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def openai_endpoint(caller, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                    llm: str | None = None, rollout_timeout: float = DEFAULT_TIMEOUT) -> Endpoint:
    """Serve OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on ``caller``'s run, from a
    thread of this process, until the returned :class:`Endpoint` is closed (it is a context manager).

    Args:
        caller: the script's :class:`~llmrl.Caller`.
        host: the address to listen on (default: this machine only; another exposes the run to the network).
        port: the port (0: a free one; ``endpoint.base_url`` tells which).
        api_key: the key clients send as ``Authorization: Bearer KEY`` (default: one drawn now, in
            ``endpoint.api_key``).
        llm: serve this LLM only (default: every LLM of the run, by name: the request's ``model``).
        rollout_timeout: seconds a rollout is kept after its last call unless popped.

    Returns:
        The running :class:`Endpoint`.
    """
    from llmrl.engine.openai_api.http import make_server
    from llmrl.engine.openai_api.service import OpenAIService

    key = api_key or f"llmrl-{secrets.token_urlsafe(24)}"
    service = OpenAIService(caller, llm, rollout_timeout)
    return Endpoint(service, make_server(service, host, port, key), key)
