"""Exceptions raised by llmrl, on the client, on the servers and in the launcher, and the one helper that
words "did you mean ...?" hints.

Every error a user can cause carries what went wrong, where (a config path, a request argument, a rank)
and a hint. This module imports nothing heavy.
"""

from __future__ import annotations

import difflib


class LLMRLError(Exception):
    """Base class of every error llmrl raises on purpose."""


class ConfigError(LLMRLError):
    """The configuration is invalid. ``problems`` lists every problem found, each a
    ``(dotted_path, message)`` pair, so that all of them can be fixed at once."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} problem(s) in the llmrl config{where}:"]
        lines += [f"  - {path or '<root>'}: {message}" for path, message in self.problems]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return type(self), (self.problems, self.source)


class PluginError(LLMRLError):
    """A plugin could not be found, imported, built or run. The message names the plugin; ``plugin``
    holds its name when the error comes from running it."""

    plugin: str | None = None


def plugin_error(message: str, plugin: str) -> PluginError:
    """A :class:`PluginError` that names ``plugin`` (the client reports it as ``RequestError.plugin``)."""
    error = PluginError(message)
    error.plugin = plugin
    return error


class RequestError(LLMRLError):
    """A request was refused or failed. From a server: ``rank`` is the global rank that reported it and
    ``remote_type`` / ``remote_traceback`` describe the original exception there. Refused on the client before
    anything was sent: ``rank`` is None (see :class:`InvalidArgument`). The servers keep serving either way."""

    def __init__(self, message: str, rank: int | None = None, remote_type: str | None = None,
                 remote_traceback: str | None = None):
        self.rank = rank
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.plugin: str | None = None
        self.raw_message = message
        prefix = f"[rank {rank}] " if rank is not None else ""
        kind = f"{remote_type}: " if remote_type else ""
        super().__init__(f"{prefix}{kind}{message}")

    def __reduce__(self):
        return _rebuild_request_error, (self.raw_message, self.rank, self.remote_type, self.remote_traceback,
                                        self.plugin)


class InvalidArgument(RequestError, ValueError):
    """A call's argument was refused on the client, before anything was sent (also a ValueError)."""

    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.raw_message,)


class InvalidArgumentType(RequestError, TypeError):
    """A call's argument has the wrong type; refused on the client, before anything was sent (also a TypeError)."""

    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.raw_message,)


class ServerDiedError(LLMRLError):
    """A server rank died or stopped answering. The run cannot continue."""

    def __init__(self, rank: int, reason: str, detail: str = ""):
        self.rank = rank
        self.reason = reason
        self.detail = detail
        text = f"llmrl server rank {rank} is gone: {reason}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)

    def __reduce__(self):
        return type(self), (self.rank, self.reason, self.detail)


class LLMClosedError(LLMRLError, RuntimeError):
    """A call named an LLM whose servers were stopped with ``Caller.close_llm``; the run's other LLMs still serve."""


class RequestTimeoutError(LLMRLError, TimeoutError):
    """A request took longer than the request timeout (config key ``timeouts.request``)."""


class PeerAborted(LLMRLError):
    """Raised on a server rank that stopped because another rank of its LLM failed first; the client
    reports the rank that failed first-hand instead."""


def _rebuild_request_error(message, rank, remote_type, remote_traceback, plugin) -> RequestError:
    err = RequestError(message, rank=rank, remote_type=remote_type, remote_traceback=remote_traceback)
    err.plugin = plugin
    return err


def did_you_mean(word, choices, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""
