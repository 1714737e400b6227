"""The Caller's experiment tracking: :func:`start_tracker` (the run's tracker, from the config and
``Caller(tracking=...)``), :meth:`TrackingCalls.log` for a script's own scalars, ``server_memory`` (the servers'
own figures), and the statistics that each ``update`` and ``optim_step`` returns, written with the call's time and
the servers' memory and cache figures, by the run's :class:`~llmrl.engine.client.tracking.Tracker` (back ends from
the config's ``tracking`` section, or ``Caller(tracking=...)``).

:class:`TrackingCalls` is a part of :class:`~llmrl.engine.client.caller.Caller`, given the Caller's shared
:class:`~llmrl.engine.client.call_context.CallContext` and the tracker. It tracks the blocking calls: a future
from ``update_async`` is not tracked (log what it returns with :meth:`TrackingCalls.log`). This module writes no
file and computes no scalar itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.log import logger
from llmrl.engine.requests import admin

if TYPE_CHECKING:
    from llmrl.engine.client.call_context import CallContext
    from llmrl.engine.client.tracking import Tracker


def start_tracker(config, tracking) -> Tracker:
    """The run's :class:`~llmrl.engine.client.tracking.Tracker`: the config's ``tracking`` section with
    ``Caller(tracking=...)``'s replacements, its steps going on from a resumed checkpoint's."""
    from llmrl.engine.client.saving import resumed_tracking
    from llmrl.engine.client.tracking import Tracker, config_params
    from llmrl.engine.config.loading import tracking_config

    try:
        settings = tracking_config(config.tracking, tracking)
    except ValueError as err:
        raise InvalidArgument(f"Caller(tracking=...): {err}") from None
    tracker = Tracker(settings, list(config.llms), config_params(config))
    position = resumed_tracking(config)
    if position:  # steps go on from the checkpoint's
        tracker.resume(position)
    return tracker


class TrackingCalls:
    """``log``, ``server_memory`` and the tracking of training steps.

    Args:
        context: the Caller's shared run and wait.
        tracker: the run's tracker (:func:`start_tracker`).
    """

    def __init__(self, context: CallContext, tracker: Tracker):
        self._context: CallContext = context
        self.tracker = tracker

    def log(self, metrics: dict, step: int | None = None, *, backends=None) -> None:
        """Write your script's own scalars through the run's tracking (the back ends of the config's ``tracking``
        section, or of ``Caller(tracking=...)``); nothing is written when there are none.

        Args:
            metrics: names to numbers (ints, floats, bools, one-element tensors or arrays); nested dicts are
                flattened with ``/`` (``{"eval": {"success": 0.8}}`` is ``eval/success``).
            step: the step to write them at (default: the current one, the number of ``update`` and ``optim_step``
                calls so far, so a batch's rewards logged after its update line up with the update's statistics).
            backends: write to these back ends instead (opened for this run if the config does not name them).

        Raises:
            InvalidArgumentType: a name that is not a string, or a value that is not a number.

        Example::

            stats = caller.update(contexts, candidates, **batch)   # written on its own: update/loss, ...
            caller.log({"reward": mean_reward, "success": success_rate})
        """
        self._context.check_open()
        self.tracker.log(metrics, step, backends)

    def tracked(self, llm: str | None, samples, send: Callable):
        """The result of the future ``send()`` returns, after writing what it reported as one training step of
        ``llm`` (a failed write is logged as an error, and the result still returned: the servers took the step)."""
        name = self._context.open(llm)
        start = time.perf_counter()
        result = self._context.wait(send())
        seconds = time.perf_counter() - start
        count = len(samples) if samples is not None and hasattr(samples, "__len__") else None
        try:
            self.tracker.log_update(name, result, count, seconds, self._server_stats)
        except Exception as err:  # noqa: BLE001 - the step was taken; its result must reach the script
            logger.error("tracking the step of LLM %r failed (its result is returned): %s: %s", name,
                         type(err).__name__, err)
        return result

    def server_memory(self) -> dict[int, dict]:
        """Memory use of every server rank still serving (resident set size, peak, CUDA allocations, parameter
        bytes, the key/value cache's and the frozen trunk's statistics when they are on), and under ``"requests"``
        how many requests of each kind (``"score"``, ``"generate"``, ...) the rank received."""
        self._context.open()
        return self._context.wait(admin.send_stats(self._context.run))

    def _server_stats(self) -> tuple[dict, dict]:
        """Every serving rank's ``stats`` reply and the LLM each rank serves."""
        return self.server_memory(), {rank: role.llm for rank, role in self._context.run.roles.items()}

    def close(self, quiet: bool) -> None:
        """Close the tracking back ends; with ``quiet``, a failure is logged instead of raised."""
        try:
            self.tracker.close()
        except Exception as err:  # noqa: BLE001 - see quiet
            if not quiet:
                raise
            logger.error("closing the tracking back ends failed: %s", err)
