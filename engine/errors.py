"""Exceptions raised by llmrl, on the client and in the launcher.

Every error a user can cause carries what went wrong, where (a config path, a request
argument, a rank) and a hint. This module holds only the classes; it imports nothing heavy.
"""

from __future__ import annotations


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


class PluginError(LLMRLError):
    """A plugin could not be found, imported, built or run. The message names the plugin."""


class RequestError(LLMRLError):
    """A request failed on a server. ``rank`` is the global rank that reported it and
    ``remote_type`` / ``remote_traceback`` describe the original exception there.
    The servers keep serving after such an error."""

    def __init__(self, message: str, rank: int | None = None, remote_type: str | None = None,
                 remote_traceback: str | None = None):
        self.rank = rank
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        prefix = f"[rank {rank}] " if rank is not None else ""
        kind = f"{remote_type}: " if remote_type else ""
        super().__init__(f"{prefix}{kind}{message}")


class ServerDiedError(LLMRLError):
    """A server rank died or stopped answering. The run cannot continue."""

    def __init__(self, rank: int, reason: str, detail: str = ""):
        self.rank = rank
        self.reason = reason
        text = f"llmrl server rank {rank} is gone: {reason}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class RequestTimeoutError(LLMRLError, TimeoutError):
    """A request took longer than the request timeout (config key ``timeouts.request``)."""
