"""What a tracking back end is: :class:`TrackerBackend`, the three things the run's tracker asks of one (open it for a
run, write a batch of scalars at a step, close it), method by method. Built-in and third-party back ends are plain
classes that follow it; none needs to inherit from it.

This module holds the contract and the check of a class against it; it opens, names and registers no back end
(:mod:`llmrl.engine.client.tracking.registry` does) and imports nothing beyond the standard library.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class TrackerBackend(Protocol):
    """One tool's writer for one run, opened when the run first writes to it and closed once, by
    :class:`~llmrl.engine.client.tracking.Tracker`, always from the client (rank 0), one call at a time.

    Opening: the class is called with keyword arguments only, and should take ``**_`` for the ones it does not use
    (more may be added)::

        Backend(run_dir=..., root=..., project=..., run_name=..., config=...)

    - ``run_dir`` (:class:`~pathlib.Path`): this run's folder, ``<dir>/<run_name>``, made before the call.
    - ``root`` (:class:`~pathlib.Path`): the ``tracking.dir`` folder, shared by runs (a store that keeps several
      runs, such as MLflow's, goes under it).
    - ``project`` (str): ``tracking.project``; ``run_name`` (str): the run's name.
    - ``config`` (dict): the run's config as flat hyperparameters (``llms/policy/training/optimizer/lr``: numbers
      stay numbers, everything else is a string); a back end that keeps hyperparameters records them when it
      opens. It may be empty.

    Opening may raise :class:`~llmrl.engine.client.tracking.BackendMissing` (an ``ImportError``) when the tool's
    package is not installed, saying what to install; any other error propagates to the call that wrote.
    """

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        """Record ``scalars`` at ``step``.

        Args:
            scalars: flat ``/``-joined names (``update/loss``, ``server/policy/rss_mb``) to floats; never empty.
            step: the run's step, an integer >= 0; steps usually grow but may repeat or go back (a script may log
                at any step, a resumed run starts again from its checkpoint's).
            wall_time: when the batch was written, in seconds since the epoch (``time.time()``), the same for every
                scalar of the batch.

        The data should be on disk (or handed to the tool) when it returns, so that a run that dies loses little.
        """

    def close(self) -> None:
        """Flush and release what the back end holds (files, the tool's run). Called once; no write follows.
        An error raised here is reported after every other back end has been closed."""


def contract_problem(name: str, cls) -> str | None:
    """Why ``cls``, registered as back end ``name``, cannot be a :class:`TrackerBackend`, or None."""
    if not isinstance(cls, type):
        return f"tracking back end {name!r} must be a class, got {type(cls).__name__}"
    missing = [method for method in ("write", "close") if not callable(getattr(cls, method, None))]
    if missing:
        return (f"tracking back end {name!r} ({cls.__module__}.{cls.__qualname__}) has no {' or '.join(missing)} "
                "method: a back end is a class with write(scalars, step, wall_time) and close() "
                "(llmrl.engine.client.tracking.protocol.TrackerBackend)")
    return None


__all__ = ["TrackerBackend", "contract_problem"]
