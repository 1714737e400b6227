"""One run's experiment tracking on the client: :class:`Tracker` names the run, counts its steps, and sends each
batch of scalars to every open back end (named in :mod:`llmrl.engine.client.tracking.registry`).

The step is the number of training steps taken through the Caller (``update`` and ``optim_step`` calls): an
update's statistics are written at the step it ends, and a script's scalars logged without ``step`` go to the
current one, so a batch's rewards logged after its update line up with the update's loss. Back ends open at their
first write (a missing package is refused when the tracker is made) and close with :meth:`Tracker.close`, which
also runs at exit.

This module asks the servers nothing itself (the Caller hands it a function for that) and computes scalars only
through :mod:`llmrl.engine.client.tracking.scalars`.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from llmrl.engine.client.tracking.registry import GROUP, BackendMissing, open_backend
from llmrl.engine.client.tracking.registry import names as backend_names
from llmrl.engine.client.tracking.scalars import (
    check_step,
    flatten,
    server_scalars,
    server_totals,
    update_scalars,
)
from llmrl.engine.config.types import TrackingConfig
from llmrl.engine.errors import InvalidArgument, InvalidArgumentType, did_you_mean


def default_run_name(script: str | None = None, clock: Callable[[], float] = time.time) -> str:
    """``<script name>-<YYYYmmdd-HHMMSS>`` (the script: ``sys.argv[0]``)."""
    stem = Path(script if script is not None else (sys.argv[0] if sys.argv and sys.argv[0] else "run")).stem
    return f"{stem or 'run'}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(clock()))}"


def config_params(config) -> dict[str, str | float]:
    """A run's config as flat hyperparameters (``llms/policy/training/optimizer/lr``: numbers stay numbers)."""
    out: dict[str, str | float] = {}

    def walk(value, name: str) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(item, f"{name}/{key}" if name else str(key))
        elif isinstance(value, (bool, int, float)) and name:
            out[name] = value
        elif name:
            out[name] = str(value)

    walk(config, "")
    return out


def check_backends(names) -> tuple[str, ...]:
    """Back end names given to a call, checked against the registry."""
    known = backend_names()
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)):
        raise InvalidArgumentType(f"backends must be a list of tracking back end names ({', '.join(known)})"
                                  f", got {type(names).__name__}")
    for name in names:
        if name not in known:
            raise InvalidArgument(f"unknown tracking back end {name!r}{did_you_mean(str(name), known)}; "
                                  f"the back ends are {', '.join(known)} (more come from packages, through the "
                                  f"entry-point group {GROUP})")
    return tuple(names)


class Tracker:
    """Where one run's scalars go.

    Args:
        settings: the ``tracking`` section (back ends, dir, run name, project, server_stats_every).
        llms: the run's LLMs, in config order (names are prefixed with the LLM only when there are several).
        params: the hyperparameters recorded by the back ends that keep them (W&B, MLflow, trackio, TensorBoard).
    """

    def __init__(self, settings: TrackingConfig, llms: list[str], params: dict | None = None):
        from llmrl.engine.config.checks import tracking_problems

        if settings.backends:
            check_backends(settings.backends)
        problems = tracking_problems(settings.backends)
        if problems:
            raise BackendMissing(problems[0][1])
        self.settings = settings
        self.step = 0
        self.root = Path(settings.dir)
        self.run_name = settings.run_name or default_run_name()
        if settings.run_name is None:  # a new name: never append to another run's files
            base, k = self.run_name, 1
            while (self.root / self.run_name).exists():
                k += 1
                self.run_name = f"{base}-{k}"
        self.run_dir = self.root / self.run_name
        self._several = len(llms) > 1
        self._params = dict(params or {})
        self._open: dict[str, object] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._updates = 0
        self._servers_before: tuple[dict, float] | None = None
        self._exit_hook = False

    @property
    def backends(self) -> tuple[str, ...]:
        """The back ends every write goes to (the config's, or ``Caller(tracking=...)``'s)."""
        return self.settings.backends

    def _writer(self, name: str):
        writer = self._open.get(name)
        if writer is None:
            writer = open_backend(name, self.run_dir, self.root, self.settings.project, self.run_name, self._params)
            self._open[name] = writer
            if not self._exit_hook:
                atexit.register(self.close)
                self._exit_hook = True
        return writer

    def write(self, scalars: dict[str, float], step: int, backends=None) -> None:
        """Write flat scalars at ``step`` to ``backends`` (default: :attr:`backends`)."""
        names = self.backends if backends is None else backends
        if not names or not scalars:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("the tracker is closed (Caller.close() closed it)")
            stamp = time.time()
            for name in names:
                self._writer(name).write(scalars, step, stamp)

    def log(self, metrics: Mapping, step: int | None = None, backends=None) -> None:
        """A script's scalars (a dict of numbers, nested dicts flattened with ``/``) at ``step`` (default: the
        current step). ``backends``: these back ends instead of the configured ones (opened if needed)."""
        scalars = flatten(metrics)
        step = check_step(step)
        names = None if backends is None else check_backends(backends)
        self.write(scalars, self.step if step is None else step, names)

    def position(self) -> dict:
        """Where the run's steps stand, for a checkpoint (a resumed run goes on from there: :meth:`resume`)."""
        with self._lock:
            return {"step": self.step, "updates": self._updates}

    def resume(self, position: dict) -> None:
        """Go on from a checkpoint's :meth:`position`, so that a resumed run writes after the steps it saved, not
        over them (a named run's files are appended to)."""
        with self._lock:
            self.step, self._updates = int(position["step"]), int(position["updates"])

    def _name(self, kind: str, llm: str) -> str:
        return f"{kind}/{llm}" if self._several else kind

    def log_update(self, llm: str, stats, samples: int | None, seconds: float,
                   server_stats: Callable[[], tuple[dict, dict]] | None = None) -> dict[str, float]:
        """Count a training step and write what it reported: its statistics averaged over the replicas
        (``update/<stat>``; ``update/<llm>/<stat>`` in a run of several LLMs), the call's time and samples per
        second, and, every ``server_stats_every`` steps, the servers' figures (``server/<llm>/<figure>``) from
        ``server_stats() -> ({rank: stats reply}, {rank: llm})``. Returns what was written."""
        with self._lock:
            self.step += 1
            self._updates += 1
            prefix = self._name("update", llm)
            scalars = {f"{prefix}/{k}": v for k, v in update_scalars(stats, samples, seconds).items()}
            every = self.settings.server_stats_every
            if self.backends and server_stats is not None and every and self._updates % every == 0:
                scalars.update(self._server_figures(*server_stats()))
            self.write(scalars, self.step)
            return scalars

    def _server_figures(self, stats: dict, llm_of: dict) -> dict[str, float]:
        totals = server_totals(stats, llm_of)
        now = time.monotonic()
        before, then = self._servers_before or (None, None)
        self._servers_before = (totals, now)
        per_llm = server_scalars(totals, before, None if then is None else now - then)
        return {f"server/{llm}/{k}": v for llm, figures in per_llm.items() for k, v in figures.items()}

    def close(self) -> None:
        """Flush and close every open back end (once; later writes raise)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors = []
            for name, writer in self._open.items():
                try:
                    writer.close()
                except Exception as err:  # noqa: BLE001 - every back end is closed, then the first error is raised
                    errors.append(f"{name}: {type(err).__name__}: {err}")
            self._open.clear()
        if self._exit_hook:
            atexit.unregister(self.close)
        if errors:
            raise RuntimeError(f"closing the tracking back ends failed: {'; '.join(errors)}")
