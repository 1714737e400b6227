"""This rank's part of its LLM: its place in the run, its model backend and its start-up sequence.

Start-up has three phases. ``load`` reads the model while the user's script starts (errors are kept, not
raised: they are reported when the client sets up). ``setup`` (the client's first request) applies the
initializers and builds heads and updater, then builds the engine; each phase that precedes a collective is
preceded by a vote of every rank of the LLM, so that one rank's failure (a missing model, a broken plugin)
is reported by all of them instead of leaving the others waiting inside DeepSpeed.

Request kinds reach the model through :attr:`Replica.backend`; :attr:`Replica.answers` says whether this rank
sends the replica's result (tensor-parallel ranks of a replica compute the same result; its first rank answers).
:attr:`Replica.handled` counts the requests this rank received, by kind (reported by the ``stats`` request).
"""

from __future__ import annotations

import time
import traceback
from collections import Counter

import torch

from llmrl.engine.config import Config
from llmrl.engine.config.topology import RankRole
from llmrl.engine.errors import PeerAborted
from llmrl.engine.log import logger
from llmrl.engine.model.backend import create_backend
from llmrl.engine.server.group import GroupChannel


class Replica:
    def __init__(self, config: Config, role: RankRole, device: torch.device, group: GroupChannel):
        self.config = config
        self.llm = config.llms[role.llm]
        self.role = role
        self.group = group
        self.device = device
        self.backend = create_backend(config, role, device, group)
        self.load_error: BaseException | None = None
        self.load_traceback = ""
        self.ready = False
        self.handled: Counter[str] = Counter()  # requests received, by kind
        self.threads_after_setup = _serial_until_setup(self.llm)

    @property
    def answers(self) -> bool:
        return self.role.is_replica_leader

    def load(self) -> None:
        logger.debug(f"loading LLM {self.llm.name!r} ({self.llm.model})")
        started = time.perf_counter()
        try:
            self.backend.load()
        except Exception as err:  # reported to the client when it sets up
            self.load_error = err
            self.load_traceback = traceback.format_exc()
        logger.debug(f"loaded in {time.perf_counter() - started:.1f} s{' (failed)' if self.load_error else ''}")

    def setup(self, plugins: dict) -> dict | None:
        """Build this rank's engine with the script's plugins; the LLM's first rank returns its description."""
        try:
            return self._setup(plugins)
        finally:  # the configured threads from here on, whether set-up succeeded or not
            if self.threads_after_setup is not None:
                torch.set_num_threads(self.threads_after_setup)
                self.threads_after_setup = None

    def _setup(self, plugins: dict) -> dict | None:
        if self.ready:
            raise RuntimeError("this run already has a Caller; create only one")
        logger.debug(f"setting up LLM {self.llm.name!r}")
        if not self.group.all_ok(self.load_error is None):
            if self.load_error is not None:
                raise RuntimeError(f"loading LLM {self.llm.name!r} failed: {type(self.load_error).__name__}: "
                                   f"{self.load_error}") from self.load_error
            raise PeerAborted(f"another rank of LLM {self.llm.name!r} failed to load")
        error = None
        try:
            self.backend.prepare(plugins)
        except Exception as err:  # noqa: BLE001 - voted on, then re-raised
            error = err
        if not self.group.all_ok(error is None):
            if error is not None:
                raise error
            raise PeerAborted(f"another rank of LLM {self.llm.name!r} failed to set up")
        info = self.backend.build()
        self.ready = True
        return info if self.role.is_group_leader else None


def _serial_until_setup(llm) -> int | None:
    """Under ZeRO-3, run this rank's loading and set-up on one intra-op thread; returns the number to restore after
    (None: nothing changed).

    ZeRO-3's set-up runs collectives whose work runs in gloo's own threads, with torch operations that run in
    parallel. Each such thread then keeps an OpenMP team of its own for the life of the process, and GNU OpenMP,
    counting more OpenMP threads than CPUs, stops spin-waiting between parallel regions in every team, the main
    thread's included: on 2 CPUs SmolLM2-135M's generate then took 1.69 s instead of 1.23 s. A thread's team size
    is fixed at its first torch operation, so a gloo thread first used during a one-thread set-up never starts one.
    """
    if llm.training.zero_stage != 3 or torch.get_num_threads() == 1:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads
