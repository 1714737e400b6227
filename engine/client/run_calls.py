"""The Caller's calls about the run as a whole: ``save`` (a checkpoint of every LLM), ``ping``, ``servers``,
``close_llm`` (one LLM's servers stopped while the others go on) and ``sync_weights`` / ``sync_weights_async`` (one
LLM's weights copied into another's: a learner's into a sampler's).

:class:`RunCalls` is a part of :class:`~llmrl.engine.client.caller.Caller`, given the Caller's shared
:class:`~llmrl.engine.client.call_context.CallContext`, the generator of ``generate``'s seeds and the tracker (a
checkpoint holds both). This module writes no checkpoint itself (:mod:`llmrl.engine.client.saving` does) and stops
no rank itself (the run's links do).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import threading
import time
from typing import TYPE_CHECKING

from llmrl.engine.client import saving
from llmrl.engine.errors import InvalidArgument, InvalidArgumentType, LLMClosedError, RequestTimeoutError
from llmrl.engine.requests import admin, read_weights, write_weights
from llmrl.engine.requests.base import every_rank

if TYPE_CHECKING:
    from llmrl.engine.client.call_context import CallContext
    from llmrl.engine.client.tracking import Tracker


class RunCalls:
    """``save``, ``ping``, ``servers``, ``close_llm`` and ``sync_weights``.

    Args:
        context: the Caller's shared run, config and wait.
        seeds: the generator of ``generate``'s seeds, whose state a checkpoint keeps.
        tracker: the run's tracker, whose step a checkpoint keeps.
    """

    def __init__(self, context: CallContext, seeds: random.Random, tracker: Tracker):
        self._context: CallContext = context
        self._seeds = seeds
        self._tracker = tracker
        self._syncs_lock = threading.Lock()
        self._group_syncs: dict[str, list[concurrent.futures.Future]] = {}  # source -> its syncs via a group

    def save(self, path: str | os.PathLike, *, client_state=None) -> str:
        """Write a checkpoint of every LLM to ``path`` atomically (see :mod:`llmrl.engine.client.saving`), with
        ``client_state``, the script's own plain-data state (its data cursor, an ``AsyncRollouts.state_dict()``),
        when given: a run resuming from the checkpoint reads it with ``resumed_client_state()``."""
        self._context.open()
        run = self._context.run
        if run.closed_llms:
            raise LLMClosedError(f"cannot save: LLM(s) {sorted(run.closed_llms)} were closed with close_llm(), "
                                 "and a checkpoint holds every LLM of the run; save before closing an LLM")
        return saving.save_run(run, self._context.wait, os.fspath(path), self._seeds, self._tracker.position(),
                               client_state)

    def resumed_client_state(self):
        """The ``client_state`` that ``save`` kept in the checkpoint this run resumes from (``llms.<name>.checkpoint``),
        or None: a fresh run, or a checkpoint saved without one."""
        return saving.resumed_client_state(self._context.run.config)

    def sync_weights(self, source: str, target: str, *, peft_adapter: str | None = None,
                     in_flight: bool = False, via: str = "group") -> dict:
        """Copy LLM ``source``'s weights into LLM ``target``: a learner's into a sampler that serves the same model
        (see :mod:`llmrl.engine.model.weight_sync`). With LoRA, one adapter's weights (``peft_adapter``, default
        the source's active adapter) into the target's adapter of that name; without, the whole model. The target's
        samples then carry the source's ``policy_version``.

        It takes its turn among the target's requests: a ``generate`` sent before it samples from the old weights,
        one sent after from the new. With ``in_flight=True`` a ``generate`` in progress on the target takes the new
        weights between two of its decode batches, when the sync is the next request queued (its batch in progress
        finishes on the weights it started with): that call's samples may then come from two versions, and each
        says which in its ``policy_version``. Not for a ``generate`` with prompt log-probs or a ``steer``, nor one
        reading a weight snapshot: they finish on their weights first.

        ``via="group"`` (the default): the source's group leader sends the weights straight to the target's ranks
        over a gloo group with each (:mod:`llmrl.engine.model.weight_channel`), on threads of its own,
        and the client relays only their layout and digest. ``via="client"``: the weights come to the client and
        go from it to each target rank (for nodes that reach rank 0 but not each other).

        Returns the target's answer: ``tensors`` and ``bytes`` copied, ``policy_version``, and ``adapter``."""
        return self._context.wait(self.sync_weights_async(source, target, peft_adapter=peft_adapter,
                                                          in_flight=in_flight, via=via))

    def sync_weights_async(self, source: str, target: str, *, peft_adapter: str | None = None,
                           in_flight: bool = False, via: str = "group") -> concurrent.futures.Future:
        """``sync_weights`` that returns once the source's weights are read and sent to the target: the future of
        the target's answer. A learner goes on training while its sampler takes the weights (with ``in_flight``,
        between two decode batches of the ``generate`` it is running)."""
        self._context.check_open()
        source, target = self._context.target(source), self._context.target(target)
        if source == target:
            raise InvalidArgument(f"sync_weights copies one LLM's weights into another; source and target are both "
                                  f"{source!r}")
        if peft_adapter is not None and not isinstance(peft_adapter, str):
            raise InvalidArgumentType(f"peft_adapter must be an adapter's name (a string) or None, got "
                                      f"{type(peft_adapter).__name__}")
        if not isinstance(in_flight, bool):
            raise InvalidArgumentType(f"in_flight must be True or False, got {type(in_flight).__name__}")
        if via not in ("group", "client"):
            raise InvalidArgument(f"via must be 'group' (the weights go from the source's ranks to the target's) or "
                                  f"'client' (through this process), got {via!r}")
        run = self._context.run
        to, to_rank_count = (target, len(every_rank(run, [target]))) if via == "group" else (None, 0)
        with self._syncs_lock:  # a pair's syncs reach the target in the order their weights were read
            read = self._context.wait(read_weights.send(
                run, source, read_weights.ReadWeightsRequest(peft_adapter, to, to_rank_count)))
            checks = {key: read[key] for key in ("scalings", "base") if key in read}
            request = write_weights.WriteWeightsRequest(read.get("weights"), read["adapter"], read["version"],
                                                        source, checks or None, in_flight, read.get("staged"))
            future = write_weights.send(run, target, request)
            if via == "group":
                pending = [f for f in self._group_syncs.get(source, []) if not f.done()]
                self._group_syncs[source] = [*pending, future]
            return future

    def ping(self, rank: int | None = None) -> float:
        """Round-trip time in seconds of a minimal request to one server rank (default: the first)."""
        self._context.open()
        rank = self._context.run.ping_target(rank)
        start = time.perf_counter()
        self._context.wait(admin.send_ping(self._context.run, rank))
        return time.perf_counter() - start

    def servers(self) -> dict[int, dict]:
        """Every server rank: its LLM, replica, tensor-parallel rank, host, pid, and whether its LLM was closed."""
        return {rank: {"llm": h.llm, "replica": h.replica, "tp_rank": h.tp_rank, "host": h.host, "pid": h.pid,
                       "closed": h.llm in self._context.run.closed_llms}
                for rank, h in sorted(self._context.run.links.hellos.items())}

    def close_llm(self, llm: str) -> None:
        """Stop one LLM's servers cleanly while the run's other LLMs go on serving (free its memory once it is no
        longer needed: a reward model after scoring, a reference policy).

        Calls already sent to it are answered first, and so are syncs of its weights to other LLMs (its ranks
        send them); this returns when its ranks have exited (code 0: the run
        still ends cleanly). Later calls naming it raise :class:`~llmrl.engine.errors.LLMClosedError`, and so does
        ``save`` (a checkpoint holds every LLM). Closing an LLM twice does nothing.

        Raises:
            InvalidArgument: ``llm`` is not an LLM of this run.
            ServerDiedError: one of its ranks died instead of stopping.
        """
        self._context.check_open()
        if not isinstance(llm, str):
            llms = ", ".join(self._context.config.llms)
            raise InvalidArgumentType(f"close_llm needs the name of an LLM (one of {llms}), got {type(llm).__name__}")
        if llm in self._context.run.closed_llms:
            return
        name = self._context.target(llm)
        for sync in self._group_syncs.pop(name, []):  # its ranks send these weights: let them arrive first
            concurrent.futures.wait([sync], timeout=self._context.timeout)
        try:
            self._context.run.close_llm(name, self._context.timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"LLM {name!r} did not stop within {self._context.timeout:g} s (timeouts.request)"
                                      ) from None
