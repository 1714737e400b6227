"""Rank 0's side of a run: host the run's store and listener, run the user's script, stop the servers.

Before the script starts, :class:`ClientRun` hosts the run's store (where the servers find the run's token
and the client's address) and the listener the servers connect to while they load their models; the
script's ``Caller()`` then finds this run through :func:`current_run` (and shows the servers connecting with
:func:`startup_bar`). :func:`run_client` is rank 0's entry point: it runs the script and ends the run with the
script's exit code.

This module neither splits requests nor assembles results; the request kinds do.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from llmrl.engine.client.call_future import on_reader_thread
from llmrl.engine.client.links import ServerLinks
from llmrl.engine.config import Config
from llmrl.engine.config.topology import replica_ranks, server_roles
from llmrl.engine.errors import InvalidArgument, LLMClosedError
from llmrl.engine.log import configure, logger
from llmrl.engine.processes import exit_with_parent
from llmrl.engine.requests.base import Part
from llmrl.engine.transport import rendezvous
from llmrl.engine.transport.secret import client_secret

_current_run: ClientRun | None = None


class ClientRun:
    """The store, the listener, the links to every server rank, and the layout of the run."""

    def __init__(self, config: Config):
        self.config = config
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(os.environ.get("MASTER_PORT", "29500"))
        timeout = config.timeouts.startup
        secret, self.secret_file = client_secret()
        self.store = rendezvous.host_run_store(master_addr, master_port, timeout)
        self.listener = rendezvous.listen(master_addr)
        host, port = self.listener.getsockname()[:2]
        self.store.set(rendezvous.CLIENT_ADDRESS_KEY, rendezvous.format_address(host, port))
        self.roles = {r.global_rank: r for r in server_roles(config)}
        self._replicas = {name: replica_ranks(config, name) for name in config.llms}
        self.links = ServerLinks(self.listener, secret, sorted(self.roles), config.timeouts.heartbeat,
                                 config.timeouts.dead_after, self.describe_rank, config.max_message_bytes)
        self.caller = None
        self.closed_llms: set[str] = set()

    def replicas(self, llm: str) -> list[list[int]]:
        return self._replicas[llm]

    def submit(self, kind: str, parts: list[Part], assemble: Callable[[dict[int, Any]], Any]) -> Future:
        if on_reader_thread():  # refused before sending: a blocking call would wait for this very thread
            raise RuntimeError(f"a Caller call ({kind!r}) in a future's done-callback: callbacks run on the thread "
                               "that reads the servers' replies, which the call would wait for; hand the work to "
                               "another thread (a queue, an executor). Nothing was sent")
        return self.links.submit(kind, parts, assemble)

    def describe_rank(self, rank: int) -> str:
        role = self.roles.get(rank)
        if role is None:
            return f"rank {rank}"
        hello = self.links.hellos.get(rank)
        where = f" on {hello.host}, pid {hello.pid}" if hello else ""
        return f"rank {rank} (LLM {role.llm!r}, replica {role.replica}, tensor-parallel rank {role.tp_rank}{where})"

    def ping_target(self, rank: int | None) -> int:
        """The server rank ``Caller.ping`` reaches: ``rank``, checked, or the first rank of an LLM still serving."""
        if rank is None:
            serving = [r for r, role in self.roles.items() if role.llm not in self.closed_llms]
            if not serving:
                raise LLMClosedError("every LLM of this run was closed with close_llm(); no server is left to ping")
            return min(serving)
        if rank not in self.roles:
            raise InvalidArgument(f"no server rank {rank}; the server ranks are {sorted(self.roles)}")
        if self.roles[rank].llm in self.closed_llms:
            raise LLMClosedError(f"rank {rank} served LLM {self.roles[rank].llm!r}, closed with close_llm()")
        return rank

    def close_llm(self, llm: str, timeout: float | None) -> None:
        """Stop ``llm``'s server ranks cleanly (they exit 0 once they have answered what was sent to them) while
        the other LLMs go on serving."""
        self.closed_llms.add(llm)
        ranks = [r for replica in self._replicas[llm] for r in replica]
        self.links.retire(ranks, f"Caller.close_llm({llm!r})", timeout)

    def shutdown(self, abort: bool, reason: str) -> None:
        self.links.shutdown(abort=abort, reason=reason, wait=self.config.timeouts.shutdown)
        if self.secret_file is not None:
            self.secret_file.unlink(missing_ok=True)


def current_run() -> ClientRun | None:
    return _current_run


def run_client(config: Config, run_script: Callable[[], int],
               on_unreached: Callable[[list[int]], None] | None = None) -> int:
    """Entry point of rank 0: host the run, run the script, stop the servers. Returns the exit code.
    ``on_unreached(ranks)`` is called when the script ended before server ``ranks`` had connected."""
    global _current_run

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    exit_with_parent(signal.SIGTERM)
    configure(config.log_level)
    run = None
    try:
        run = ClientRun(config)
        _current_run = run
        code = run_script()
    except KeyboardInterrupt:  # Ctrl-C before the script ran (while the run was being hosted)
        logger.error("interrupted (Ctrl-C); stopping the servers")
        code = 130
    except SystemExit as stop:  # SIGTERM before the script ran
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        _current_run = None
    if run is None:
        return code
    failed = code != 0 or bool(run.links.dead)
    reason = "the script finished" if not failed else f"the script exited with code {code}"
    run.shutdown(abort=failed, reason=reason)
    unreached = run.links.never_connected()
    if unreached and on_unreached is not None:
        try:
            on_unreached(unreached)
        except OSError as err:  # the script's exit code still goes out: `llmrl run` then waits for those ranks
            logger.warning(f"could not note the server ranks that never connected ({err})")
    if (run.links.dead or run.links.stuck) and code == 0:
        code = 1
    return code


def startup_bar(progress: bool, total: int):
    """A progress bar of servers connecting (None when progress is off or tqdm is missing)."""
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, desc="llmrl: servers connected", unit="rank", leave=False, file=sys.stderr,
               disable=None)  # None: shown on a terminal, silent in logs

    def update_to(done: int, _total: int) -> None:
        if done != bar.n:
            bar.n = done
            bar.refresh()

    bar.update_to = update_to
    return bar
