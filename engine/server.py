"""The life of a server rank: connect to the client, join its LLM group, load, serve, stop.

Start-up: read the run's token and the client's address from rank 0's store, connect to the client
(heartbeats start at once, so loading is watched too), form the LLM's own torch.distributed world
through a store hosted by the group leader, and load the model while the user's script starts.
Serving: requests are served one at a time in arrival order (the same order on every rank, so the
collectives of replicas and tensor-parallel ranks line up). An error in a request is sent back to
the client and the server goes on serving.

Stopping: a graceful ``Shutdown`` ends the loop and the process exits 0. The process exits at once
and non-zero when the client's connection drops or the client aborts the run, so no rank outlives
its run, even one stuck in a collective with a dead peer.

This module does not compute anything itself; :mod:`llmrl.engine.runtime` does.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from typing import NoReturn

from llmrl.engine import protocol, rendezvous, wire
from llmrl.engine.config import Config
from llmrl.engine.topology import RankRole, device_for


def exit_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to signal this process when its parent (the launcher) dies: no orphans."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def quiet_libraries(config: Config, device_type: str) -> None:
    """Keep DeepSpeed's and transformers' chatter (progress bars, INFO lines) out of the run's output."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no "unable to detect a GPU" warning at import
    verbose = config.log_level == "debug"
    import logging

    import transformers

    if not verbose:
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.DEBUG if verbose else logging.WARNING)


def threads_for_server(config: Config, node_rank: int) -> int:
    if config.threads_per_rank:
        return config.threads_per_rank
    local_size = int(os.environ.get("LOCAL_SIZE", "1"))
    servers_here = max(1, local_size - (1 if node_rank == 0 else 0))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // servers_here)


class Server:
    def __init__(self, config: Config, role: RankRole, local_rank: int, node_rank: int):
        self.config = config
        self.role = role
        self.local_rank = local_rank
        self.node_rank = node_rank
        self.inbox: queue.Queue = queue.Queue()
        self.link: wire.Connection | None = None
        self.busy_with: int | None = None
        self.stopping = False
        self.runtime = None
        self.load_error: BaseException | None = None
        self.set_up = False

    # ------------------------------------------------------------------ start-up

    def connect(self) -> None:
        timeout = self.config.timeouts.startup
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = rendezvous.join_run_store(addr, port, timeout)
        token = self.store.get(rendezvous.TOKEN_KEY)
        client = rendezvous.split_address(self.store.get(rendezvous.CLIENT_ADDRESS_KEY).decode())
        self.link = wire.connect(client, token, self.role.global_rank, timeout)
        self.link.send(protocol.Hello(rank=self.role.global_rank, llm=self.role.llm, replica=self.role.replica,
                                      tp_rank=self.role.tp_rank, host=socket.gethostname(), pid=os.getpid()))
        threading.Thread(target=self._read_loop, name="llmrl-read", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="llmrl-heartbeat", daemon=True).start()

    def _read_loop(self) -> None:
        while True:
            try:
                message = self.link.recv()
            except (EOFError, OSError):
                if not self.stopping:
                    self._die("the client (rank 0) disconnected")
                return
            if isinstance(message, protocol.Shutdown):
                if message.abort:
                    self._die(f"the client aborted the run ({message.reason})")
                self.stopping = True
            self.inbox.put(message)

    def _heartbeat_loop(self) -> None:
        interval = self.config.timeouts.heartbeat
        while not self.stopping:
            try:
                self.link.send(protocol.Heartbeat(busy_with=self.busy_with))
            except OSError:
                return
            threading.Event().wait(interval)

    def _die(self, why: str) -> None:
        print(f"llmrl server rank {self.role.global_rank}: {why}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def join_group(self) -> None:
        """Form this LLM's own torch.distributed world (plus a gloo control group)."""
        import torch
        import torch.distributed as dist

        role, timeout = self.role, self.config.timeouts.startup
        key = rendezvous.group_key(role.llm)
        if role.is_group_leader:
            host = rendezvous.reachable_address(os.environ["MASTER_ADDR"])
            group_store = rendezvous.host_group_store(host, timeout)
            self.store.set(key, rendezvous.format_address(host, group_store.port))
        else:
            self.store.wait([key], datetime.timedelta(seconds=timeout))
            group_store = rendezvous.join_group_store(self.store.get(key).decode(), timeout)
        self.group_store = group_store
        llm = self.config.llms[role.llm]
        device = device_for(llm, role, self.local_rank, self.node_rank)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        host, port = rendezvous.split_address(self.store.get(key).decode())
        # DeepSpeed reads these; in this process they describe the LLM's world, not the launcher's.
        os.environ.update(RANK=str(role.group_rank), WORLD_SIZE=str(role.group_size), MASTER_ADDR=host,
                          MASTER_PORT=str(port), LOCAL_RANK=str(self.device.index or 0))
        quiet_libraries(self.config, self.device.type)
        dist.init_process_group(backend=backend, store=group_store, rank=role.group_rank, world_size=role.group_size,
                                timeout=datetime.timedelta(seconds=self.config.timeouts.collective))
        self.control_group = dist.new_group(backend="gloo") if role.group_size > 1 else None
        import deepspeed

        # DeepSpeed's shared-memory all-reduce ignores sub-groups (wrong tensor-parallel results) and
        # JIT-compiles for a minute on CPU; plain gloo is right and fast enough here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=self.config.timeouts.collective))

    def load(self) -> None:
        from llmrl.engine.runtime import LLMRuntime

        self.runtime = LLMRuntime(self.config, self.role, self.device, self.control_group)
        try:
            self.runtime.load()
        except Exception as err:  # reported to the client when it sets up
            self.load_error = err
            self.load_traceback = traceback.format_exc()

    # ------------------------------------------------------------------ serving

    def serve(self) -> int:
        while True:
            message = self.inbox.get()
            if isinstance(message, protocol.Shutdown):
                return 0
            self.busy_with = message.id
            reply = self._handle(message)
            self.busy_with = None
            try:
                self.link.send(reply)
            except OSError:
                self._die("cannot reach the client")

    def _handle(self, request: protocol.Request) -> protocol.Reply:
        from llmrl.engine.training import PeerAborted

        try:
            value = self._dispatch(request)
            return protocol.Reply(request.id, self.role.global_rank, value=value)
        except PeerAborted as err:
            info = protocol.ErrorInfo("PeerAborted", str(err), "", aborted_by_peer=True)
        except Exception as err:  # noqa: BLE001 - every error goes back to the client
            info = protocol.ErrorInfo(type(err).__name__, str(err), traceback.format_exc(),
                                      plugin=getattr(err, "plugin", None))
        return protocol.Reply(request.id, self.role.global_rank, error=info)

    def _dispatch(self, request: protocol.Request):
        kind, payload = request.kind, request.payload
        runtime = self.runtime
        if kind == protocol.PING:
            return {"rank": self.role.global_rank}
        if kind == protocol.SLEEP:
            return runtime.sleep(payload)
        if kind == protocol.STATS:
            return runtime.memory()
        if kind == protocol.SETUP:
            return self._setup(payload)
        if not self.set_up:
            raise RuntimeError("the server is not set up: create the Caller first")
        handler = {protocol.SCORE: runtime.score, protocol.GENERATE: runtime.generate,
                   protocol.UPDATE: runtime.update, protocol.SAVE: runtime.save,
                   protocol.STATE_DICT: runtime.state_dict}.get(kind)
        if handler is None:
            raise ValueError(f"unknown request kind {kind!r}")
        return handler(payload)

    def _setup(self, payload: dict):
        """Build this rank's engine. Each collective step is preceded by a check that every rank of the
        LLM got that far, so that one rank's failure (a missing model, a broken plugin) is reported by
        all of them instead of leaving the others waiting inside DeepSpeed."""
        from llmrl.engine.group_sync import all_ok
        from llmrl.engine.training import PeerAborted

        if self.set_up:
            raise RuntimeError("this run already has a Caller; create only one")
        if not all_ok(self.load_error is None, self.control_group):
            if self.load_error is not None:
                raise RuntimeError(f"loading LLM {self.role.llm!r} failed: {type(self.load_error).__name__}: "
                                   f"{self.load_error}") from self.load_error
            raise PeerAborted(f"another rank of LLM {self.role.llm!r} failed to load")
        plugins = payload.get("plugins", {}).get(self.role.llm, {})
        error = None
        try:
            self.runtime.prepare(plugins)
        except Exception as err:  # noqa: BLE001 - voted on, then re-raised
            error = err
        if not all_ok(error is None, self.control_group):
            if error is not None:
                raise error
            raise PeerAborted(f"another rank of LLM {self.role.llm!r} failed to set up")
        info = self.runtime.build_engine()
        self.set_up = True
        return info if self.role.is_replica_leader else None

    def close(self) -> None:
        """Hang up on the client. The process groups are left to the exit: tearing them down rank by rank
        races with the peers' own exits (a rank whose peer is already gone can abort inside gloo), and
        nothing is left to synchronise once the client has said stop."""
        self.stopping = True
        if self.link is not None:
            self.link.close()


def quiet_library_notices() -> None:
    """Hide notices about the libraries' own internals that a user cannot act on (printed once per rank):
    deprecations inside DeepSpeed's calls to torch and transformers, and bitsandbytes' note that an optional
    CPU kernel package is missing (its fallback is used). Warnings raised by user code are untouched."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def run_server(config: Config, rank: int, local_rank: int, node_rank: int, on_exit=None) -> NoReturn:
    """Entry point of every rank > 0: serve until the client says stop, then exit the process (0).
    ``on_exit(code)``, if given, is called just before a clean exit (``llmrl run`` records it)."""
    from llmrl.engine.topology import role_of

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle; it stops us cleanly
    exit_with_parent()
    quiet_library_notices()
    import torch

    torch.set_num_threads(threads_for_server(config, node_rank))
    role = role_of(config, rank)
    server = Server(config, role, local_rank, node_rank)
    server.connect()
    server.join_group()
    server.load()
    code = server.serve()
    server.close()
    if on_exit is not None:
        on_exit(code)
    # Leave without running C++ destructors (process groups, store clients, DeepSpeed's threads): they
    # may join threads that wait on peers that have already exited. The OS closes every socket.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
