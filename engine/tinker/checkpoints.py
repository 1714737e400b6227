"""Tinker's training runs and checkpoints on an llmrl service: the ``tinker://`` paths, where a saved state lies on
disk, and the REST views (``training_runs``, their ``checkpoints``) that the SDK's RestClient and the cookbook's
resume read.

A training run is a training client (its id, ``<session>:train:<n>``, is the run's id). A **training** checkpoint
(``save_state``) is a folder written by ``Caller.save_adapter`` at ``<save_dir>/<run>/weights/<name>`` (each part
``%``-escaped, so that two names never share a folder), path
``tinker://<run>/weights/<name>``: it outlives the service, so a later service on the same ``--save-dir`` loads it
(``create_training_client_from_state[_with_optimizer]``). A **sampler** checkpoint
(``save_weights_for_sampler(name)``) is a snapshot held in memory, path ``tinker://<run>/sampler_weights/<name>``;
it ends with the service. Session ids carry a token drawn when the service starts, so runs of two services never
share a folder.

A path never leads out of ``--save-dir``: a part that is empty, ``.``, ``..`` or absolute is refused, and so is a
folder whose real path (links resolved) lies outside it. Errors name the ``tinker://`` path, never the host's folders
(:meth:`Registry.naming` rewrites the Caller's).

This module keeps the records and answers the listings; it saves, loads and deletes nothing itself
(:mod:`llmrl.engine.tinker.service` does, through the Caller).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass, field

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> Tinker's checkpoint type


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def folder_name(name) -> str:
    """``name`` as one folder name, reversibly (``%``-escaped): two names never share a folder."""
    return urllib.parse.quote(str(name), safe="")


def checkpoint_name(name) -> str | None:
    """A checkpoint's name as the script gave it (None: none given); it ends a ``tinker://`` path, so no ``/``."""
    if not name:
        return None
    if not isinstance(name, str) or "/" in name or name in (".", ".."):
        raise ValueError(f"checkpoint name {name!r} must be a string without '/' (it ends a tinker:// path)")
    return name


def parse_path(path) -> tuple[str, str, str]:
    """``(run_id, segment, name)`` of ``tinker://<run>/<weights|sampler_weights>/<name>``; ValueError otherwise, and
    for a part that is empty, ``.``, ``..`` or absolute (a path never leads out of the service's folder)."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise ValueError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> (save_state) "
                         "or tinker://<run>/sampler_weights/<name> (save_weights_for_sampler)")
    bad = next((part for part in parts if part in ("", ".", "..") or os.path.isabs(part)), None)
    if bad is not None:
        raise ValueError(f"{path!r} is not a checkpoint path: its parts must not be empty, '.', '..' or absolute "
                         f"(got {bad!r}); give the path save_state or save_weights_for_sampler answered")
    return parts[0], parts[1], parts[2]


class StateError(Exception):
    """An error about a saved state whose message names its ``tinker://`` path in place of the host's folders;
    ``cause`` is the original error (its category is the request's)."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


@dataclass
class Checkpoint:
    run_id: str
    segment: str  # "weights" or "sampler_weights"
    name: str
    time: str
    size_bytes: int | None = None
    snapshot: str | None = None  # a sampler checkpoint's snapshot

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.checkpoint_id}"

    def view(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "checkpoint_type": KINDS[self.segment], "time": self.time,
                "tinker_path": self.tinker_path, "size_bytes": self.size_bytes}


@dataclass
class Run:
    run_id: str
    base_model: str
    lora_rank: int
    user_metadata: dict | None
    last_request_time: str = field(default_factory=now)
    checkpoints: list = field(default_factory=list)  # Checkpoint, oldest first

    def view(self) -> dict:
        last = {segment: next((c.view() for c in reversed(self.checkpoints) if c.segment == segment), None)
                for segment in KINDS}
        return {"training_run_id": self.run_id, "base_model": self.base_model, "model_owner": "llmrl",
                "is_lora": True, "lora_rank": self.lora_rank, "last_request_time": self.last_request_time,
                "last_checkpoint": last["weights"], "last_sampler_checkpoint": last["sampler_weights"],
                "user_metadata": self.user_metadata}


class Registry:
    """The runs and checkpoints of one service (thread-safe)."""

    def __init__(self, save_dir: str):
        self.save_dir = os.path.abspath(save_dir)
        self._lock = threading.Lock()
        self.runs: dict[str, Run] = {}
        self._deleted: set[tuple[str, str]] = set()  # (run, checkpoint id): a resent delete finds it done

    def state_folder(self, run_id: str, name: str) -> str:
        """The folder of state ``name`` of run ``run_id``; ValueError if it resolves (through a link) outside the
        service's folder."""
        return self._inside(os.path.join(self.save_dir, folder_name(run_id), "weights", folder_name(name)),
                            f"tinker://{run_id}/weights/{name}")

    def folder_of(self, path: str) -> str:
        """The folder of a training checkpoint's path; LookupError if none is on disk, ValueError if the path is a
        sampler checkpoint's or leads outside the service's folder. Errors name the path, never the host's folders."""
        run_id, segment, name = parse_path(path)
        if segment != "weights":
            raise ValueError(f"{path!r} holds sampler weights (save_weights_for_sampler), which have no optimizer "
                             "state to train on: load a save_state path (tinker://<run>/weights/<name>)")
        folder = self.state_folder(run_id, name)
        if not os.path.isdir(folder) and os.path.isdir(self._inside(folder + "%old", path)):  # an overwrite cut
            folder += "%old"  # between its renames: the old state, whole
        if not os.path.isdir(folder):
            raise LookupError(f"no saved state at {path!r}: save_state(name) writes one, and this service loads the "
                              "states saved under its --save-dir (by it or an earlier service)")
        return folder

    def _inside(self, folder: str, path: str) -> str:
        """``folder``, once its real path (links resolved) is checked to lie inside the service's folder."""
        root = os.path.realpath(self.save_dir)
        real = os.path.realpath(folder)
        if real == root or os.path.commonpath([root, real]) != root:
            raise ValueError(f"{path!r} leads outside this service's --save-dir (through a link): it is refused")
        return folder

    @contextlib.contextmanager
    def naming(self, path: str, folder: str):
        """Re-raise an error of the block whose message names ``folder`` (or a sibling ``%new`` / ``%old``) or the
        service's folder as a :class:`StateError` naming ``path`` instead (its category: the original's)."""
        try:
            yield
        except Exception as err:
            text = str(err)
            for base in {os.path.realpath(folder), os.path.abspath(folder)}:
                text = re.sub(re.escape(base) + "(%new|%old)?", lambda _: path, text)
            for root in {os.path.realpath(self.save_dir), self.save_dir}:
                text = text.replace(root, "<save-dir>")
            if text == str(err):
                raise
            raise StateError(f"{type(err).__name__}: {text}", err) from None

    def add_run(self, run_id: str, base_model: str, lora_rank: int, user_metadata: dict | None) -> None:
        with self._lock:
            self.runs.setdefault(run_id, Run(run_id, base_model, lora_rank, user_metadata))

    def touch(self, run_id: str) -> None:
        with self._lock:
            if run_id in self.runs:
                self.runs[run_id].last_request_time = now()

    def add(self, checkpoint: Checkpoint) -> Checkpoint | None:
        """Record ``checkpoint``; returns the one it replaces (same run and id), if any."""
        with self._lock:
            run = self.runs[checkpoint.run_id]
            old = next((c for c in run.checkpoints if c.checkpoint_id == checkpoint.checkpoint_id), None)
            if old is not None:
                run.checkpoints.remove(old)
            run.checkpoints.append(checkpoint)
            return old

    def find(self, path: str) -> Checkpoint | None:
        run_id, segment, name = parse_path(path)
        with self._lock:
            run = self.runs.get(run_id)
            return next((c for c in run.checkpoints if c.segment == segment and c.name == name), None) if run else None

    def remove(self, run_id: str, checkpoint_id: str) -> Checkpoint | None:
        """The record removed; None if it was removed already (a delete resent)."""
        with self._lock:
            run = self._run(run_id)
            found = next((c for c in run.checkpoints if c.checkpoint_id == checkpoint_id), None)
            if found is None and (run_id, checkpoint_id) in self._deleted:
                return None
            if found is None:
                raise LookupError(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}; it has "
                                  f"{[c.checkpoint_id for c in run.checkpoints] or 'none'}")
            run.checkpoints.remove(found)
            self._deleted.add((run_id, checkpoint_id))
            return found

    def training_run(self, run_id: str) -> dict:
        with self._lock:
            return self._run(run_id).view()

    def list_runs(self, limit: int, offset: int) -> dict:
        with self._lock:
            runs = list(self.runs.values())
            page = [r.view() for r in runs[offset:offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def list_checkpoints(self, run_id: str) -> dict:
        with self._lock:
            return {"checkpoints": [c.view() for c in self._run(run_id).checkpoints]}

    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"no training run {run_id!r} on this service; it holds {sorted(self.runs) or 'none'}")
        return run


def folder_size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
