"""What every part of the :class:`~llmrl.engine.client.caller.Caller` shares: :class:`CallContext`, the run the
Caller reaches, its config, whether it is open, what each LLM's servers described at setup, and the wait on a
call's future (with the request timeout); and :func:`delegated`, which makes a Caller method a thin delegation to
the part that does the work.

The Caller is a composition of parts (:mod:`~llmrl.engine.client.inference_calls`,
:mod:`~llmrl.engine.client.training_calls`, :mod:`~llmrl.engine.client.adapter_calls`,
:mod:`~llmrl.engine.client.tracking_calls`, :mod:`~llmrl.engine.client.run_calls`); each receives this context
(and any other part it uses) in its constructor. This module sends nothing and checks no call's arguments but the
LLM it names and the contexts and candidates it hands to ``inputs``.
"""

from __future__ import annotations

import concurrent.futures
import inspect
from collections.abc import Callable

from llmrl.engine.client import chat
from llmrl.engine.errors import InvalidArgument, LLMClosedError, RequestTimeoutError, did_you_mean
from llmrl.engine.requests import inputs


class CallContext:
    """The run, the config and the state the Caller's parts share.

    Args:
        run: the run rank 0 hosts (:mod:`llmrl.engine.client.hosting`), with its links to every server rank.
        timeout: seconds a call may take before :class:`RequestTimeoutError`.

    Attributes:
        config: the run's validated configuration.
        info: per LLM, what its servers reported at setup (filled once, by the Caller's start-up).
        closed: True once the Caller is closed; every part's call then raises.
    """

    def __init__(self, run, timeout: float):
        self.run = run
        self.config = run.config
        self.timeout = timeout
        self.info: dict[str, dict] = {}
        self.closed = False
        self.tokenizers = chat.Tokenizers(self.config)

    def target(self, llm: str | None) -> str:
        """The name of the LLM a call is for (default: the config's first), refused when unknown or closed."""
        name = llm or self.config.default_llm
        if name not in self.config.llms:
            raise InvalidArgument(f"unknown llm {name!r}{did_you_mean(name, self.config.llms)}; this run serves "
                                  f"{', '.join(self.config.llms)}")
        if name in self.run.closed_llms:
            serving = [n for n in self.config.llms if n not in self.run.closed_llms]
            hint = " (a call without llm= goes to the first LLM of the config)" if llm is None else ""
            raise LLMClosedError(f"LLM {name!r} was closed with close_llm(); its servers have stopped{hint}; this run "
                                 f"still serves: {', '.join(serving) or 'none'}")
        return name

    def check_open(self) -> None:
        """Raise if the Caller is closed."""
        if self.closed:
            raise RuntimeError("this Caller is closed")

    def open(self, llm: str | None = None) -> str:
        """Check that the Caller is open and return the target LLM's name."""
        self.check_open()
        return self.target(llm)

    def wait(self, future: concurrent.futures.Future, timeout: float | None = None):
        """The future's result, or :class:`RequestTimeoutError` naming the ranks still at work after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            busy = self.run.links.busy_ranks(future)
            self.run.links.forget(future)
            raise RequestTimeoutError(f"the request took longer than {timeout:g} s (timeouts.request); ranks still "
                                      f"working on it: {busy}") from None

    def inputs(self, llm: str, contexts, candidates=None, *, candidates_needed: bool = False):
        """Checked contexts (chat messages rendered) and candidates (token ids within the LLM's vocabulary)."""
        contexts, candidates = chat.render(contexts, candidates, self.tokenizers.get, llm)
        contexts = inputs.check_contexts(contexts)
        if candidates is not None or candidates_needed:
            candidates = inputs.check_candidates(candidates, contexts)
        inputs.check_vocabulary(contexts, candidates, self.info.get(llm, {}).get("vocab_size"), llm)
        return contexts, candidates

    def head_levels(self, llm: str) -> dict[str, str]:
        """Each head's level ("context" or "candidate") on ``llm``, as its servers described them at setup."""
        return self.info[llm]["heads"]


def delegated(target: Callable) -> Callable:
    """Decorate a Caller method whose body hands the call to ``target``, a part's method: the Caller method gets
    ``target``'s docstring (the API reference shows it: docs/griffe_delegated.py), and a signature that differs
    from ``target``'s is refused when the class is defined, so the two cannot drift apart."""

    def decorate(method: Callable) -> Callable:
        if inspect.signature(method) != inspect.signature(target):
            raise TypeError(f"Caller.{method.__name__}{inspect.signature(method)} differs from the part it delegates "
                            f"to, {target.__qualname__}{inspect.signature(target)}")
        method.__doc__ = target.__doc__
        method.__delegates_to__ = target
        return method

    return decorate

