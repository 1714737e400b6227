"""The life of a server rank: connect to the client, join its LLM's world, load, serve, stop.

Start-up: read the run's token and the client's address from rank 0's store, connect to the client
(heartbeats start at once, so loading is watched too), form the LLM's own torch.distributed world
(:mod:`llmrl.engine.server.group`) and load the model while the user's script starts.
Serving: requests are served one at a time in arrival order (the same order on every rank, so the
collectives of replicas and tensor-parallel ranks line up). Each request is dispatched by its kind to the
handler its module declares (:data:`llmrl.engine.requests.KINDS`); a weight write sent in flight is served inside
the ``generate`` in progress, between two decode batches, when it is the next request queued (no request is served
before one sent earlier). An error in a request is sent back to
the client and the server goes on serving. The reader thread survives whatever the client sends: a request it
cannot decode (its payload or its header) is answered with an error in its turn; a message a client never sends
(a Hello, a Reply, an unknown type) is logged and dropped.

Stopping: a graceful ``Shutdown`` (sent to every rank by ``Caller.close``, or to one LLM's ranks by
``Caller.close_llm``) ends the loop after the requests queued before it, and the process exits 0 (at once when
it comes while the rank is still loading and nothing is queued: a script that ended before its ``Caller``). The
process exits at once and non-zero when the client's connection drops or the client aborts the run, so
no rank outlives its run, even one stuck in a collective with a dead peer.

This module computes nothing itself; the request kinds and the model backend do.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
import traceback
from typing import NoReturn

from llmrl.engine.config import Config
from llmrl.engine.config.topology import RankRole, device_for
from llmrl.engine.errors import PeerAborted
from llmrl.engine.log import configure, logger
from llmrl.engine.processes import exit_with_parent, leave
from llmrl.engine.requests import KINDS
from llmrl.engine.server.host_memory import keep_freed_memory
from llmrl.engine.server.request_profile import profiled
from llmrl.engine.transport import frames, messages, rendezvous
from llmrl.engine.transport.secret import server_secret


def quiet_libraries(config: Config) -> None:
    """Keep DeepSpeed's and transformers' chatter (progress bars, INFO lines) out of the run's output, and hide
    notices about the libraries' own internals that a user cannot act on (deprecations inside DeepSpeed's calls
    to torch and transformers; bitsandbytes' note that an optional CPU kernel package is missing). Warnings
    raised by user code are untouched."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    verbose = config.log_level == "debug"
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
    def __init__(self, config: Config, role: RankRole, on_exit=None):
        self.config = config
        self.role = role
        self.on_exit = on_exit  # called with the exit code just before a clean exit
        self.inbox: queue.Queue = queue.Queue()
        self.link: frames.Connection | None = None
        self.busy_with: int | None = None
        self.stopping = False  # the client said stop: the link closing is then expected
        self.closed = False  # this rank hung up
        self.serving = False  # loaded, and taking requests from the inbox
        self.replica = None

    # ------------------------------------------------------------------ start-up

    def connect(self) -> None:
        timeout = self.config.timeouts.startup
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        secret = server_secret(timeout)
        self.store = rendezvous.join_run_store(addr, port, timeout)
        client = rendezvous.split_address(self.store.get(rendezvous.CLIENT_ADDRESS_KEY).decode())
        self.link = frames.connect(client, secret, self.role.global_rank, timeout, self.config.max_message_bytes)
        self._send(messages.Hello(rank=self.role.global_rank, llm=self.role.llm, replica=self.role.replica,
                                  tp_rank=self.role.tp_rank, host=socket.gethostname(), pid=os.getpid()))
        threading.Thread(target=self._read_loop, name="llmrl-read", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="llmrl-heartbeat", daemon=True).start()

    def _send(self, message) -> None:
        messages.send(self.link, message)

    def _read_loop(self) -> None:
        """Queue what the client sends; survive anything it reads (a bad request becomes an error reply)."""
        try:
            while True:
                try:
                    message = messages.receive(self.link)
                except frames.UndecodableBody as bad:
                    self._on_unknown(bad.header, f"{bad} (arguments must be plain Python, tensors, or classes the "
                                     "servers can import: installed modules, or top-level classes of your script)",
                                     f"a message whose body cannot be read (header {str(bad.header)[:300]})")
                    continue
                except messages.UnknownMessage as bad:
                    self._on_unknown(bad.header, str(bad))
                    continue
                if isinstance(message, messages.Shutdown):
                    if message.abort:
                        self._die(f"the client aborted the run ({message.reason})")
                    self.stopping = True
                    if self.inbox.empty() and not self.serving:  # (this order: serve() sets serving before it
                        # takes anything, and this thread alone fills the inbox)
                        self._stop_while_loading()
                elif not isinstance(message, messages.Request):
                    self._on_unknown(messages.to_frame(message)[0], f"a {type(message).__name__} message")
                    continue
                self.inbox.put(message)
        except (EOFError, OSError):
            if not self.stopping:
                self._die("the client (rank 0) disconnected")
            if not self.closed:  # told to stop, but the client hung up before this rank was done (it waited
                # timeouts.shutdown): nobody is left to answer, so this rank must not outlive the run
                self._die(f"the client hung up while this rank was still serving (request #{self.busy_with})")
        except BaseException:  # noqa: BLE001 - a stream that cannot be read any more ends this rank, loudly
            self._die(f"reading from the client failed:\n{traceback.format_exc()}")

    def _on_unknown(self, header, what: str, dropped: str | None = None) -> None:
        """A message this rank cannot take: a numbered request (its body or its header unreadable) gets an error
        reply saying ``what``, in its turn; anything else (a Hello, a Reply, an unknown type: a client never sends
        them) is logged as ``dropped`` (default ``what``) and dropped, and this rank goes on."""
        if not isinstance(header, dict):
            header = {"header": header}
        if header.get("type") == "request" and isinstance(header.get("id"), int):
            self.inbox.put(_Undecodable(header, what))
            return
        logger.warning(f"ignored {dropped or what} from the client: a client sends only requests and shutdowns")

    def _heartbeat_loop(self) -> None:
        # Beats go on until this rank hangs up, also after a stop was received: requests queued before it are
        # still served (Caller.close_llm stops one LLM while the client keeps watching it until it hangs up).
        interval = self.config.timeouts.heartbeat
        while not self.closed:
            try:
                self._send(messages.Heartbeat(busy_with=self.busy_with))
            except OSError:
                return
            threading.Event().wait(interval)

    def _stop_while_loading(self) -> NoReturn:
        """A clean stop before this rank served anything (a script that ended before making its ``Caller``, as
        ``--help`` does): nothing was asked of it, so it exits 0 now instead of finishing a load nobody needs."""
        logger.debug("told to stop while loading, with no request queued; exiting")
        self.closed = True
        if self.on_exit is not None:
            self.on_exit(0)
        leave(0)

    def _die(self, why: str) -> NoReturn:
        logger.error(f"{why}; exiting")
        leave(1)

    def start(self, local_rank: int, node_rank: int) -> None:
        """Join the LLM's world and load the model (errors while loading are reported at set-up)."""
        import torch

        from llmrl.engine.model.weight_channel import WeightChannels
        from llmrl.engine.server.group import join_group
        from llmrl.engine.server.replica import Replica

        llm = self.config.llms[self.role.llm]
        device = torch.device(device_for(llm, self.role, local_rank, node_rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no "unable to detect a GPU" warning at import
        group = join_group(self.config, self.role, self.store, device)
        quiet_libraries(self.config)
        self.replica = Replica(self.config, self.role, device, group)
        self.replica.backend.queued_write_taker = self._take_queued_write
        self.replica.backend.weight_channels = WeightChannels(self.store, self.role.llm, self.role.group_rank,
                                                              self.config.timeouts.collective)
        self.replica.load()

    # ------------------------------------------------------------------ serving

    def serve(self) -> int:
        self.serving = True
        while True:
            message = self.inbox.get()
            if isinstance(message, messages.Shutdown):
                return 0
            self.busy_with = message.id
            started = time.perf_counter()
            reply = self._handle(message)
            self.busy_with = None
            logger.debug(f"{message.kind} #{message.id} {_sizes(message.payload)} in "
                         f"{1000 * (time.perf_counter() - started):.1f} ms{' (failed)' if reply.error else ''}")
            self._reply(reply)

    def _take_queued_write(self, before) -> bool:
        """Serve the next queued request now, inside the request in progress, if it is a weight write sent in flight
        (``sync_weights(in_flight=True)``): a ``generate`` calls this between two decode batches. Only the head of
        the queue is taken, so no request is served before one that was sent earlier. ``before()`` runs first (the
        ``generate`` stamps the samples drawn so far). True if a write was served, whether it succeeded or not."""
        with self.inbox.mutex:
            head = self.inbox.queue[0] if self.inbox.queue else None
        if not (isinstance(head, messages.Request) and head.kind == "write_weights"
                and getattr(head.payload, "in_flight", False)):
            return False
        before()  # (should it raise, the write stays queued and is served in its turn)
        taken = self.inbox.get_nowait()  # still the head: only this thread takes from the inbox
        assert taken is head
        started = time.perf_counter()
        reply = self._handle(head)
        logger.debug(f"write_weights #{head.id} in flight, during #{self.busy_with}, in "
                     f"{1000 * (time.perf_counter() - started):.1f} ms{' (failed)' if reply.error else ''}")
        self._reply(reply)
        return True

    def _reply(self, reply: messages.Reply) -> None:
        """Send a reply; a value that cannot be sent (not picklable, over max_message_bytes) becomes an error."""
        try:
            frame = frames.encode(*messages.to_frame(reply))
            self.link.send_frames(frame)
            return
        except OSError:
            self._die("cannot reach the client")
        except Exception as err:  # noqa: BLE001 - the client gets the reason instead of the value
            info = messages.ErrorInfo(type(err).__name__, f"the result cannot be sent to the client: {err}",
                                      traceback.format_exc())
        try:
            self._send(messages.Reply(reply.id, reply.rank, error=info))
        except OSError:
            self._die("cannot reach the client")

    def _handle(self, request) -> messages.Reply:
        rank = self.role.global_rank
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            return messages.Reply(request.id, rank, value=self._dispatch(request))
        except PeerAborted as err:
            info = messages.ErrorInfo("PeerAborted", str(err), "", aborted_by_peer=True)
        except Exception as err:  # noqa: BLE001 - every error goes back to the client
            info = messages.ErrorInfo(type(err).__name__, str(err), traceback.format_exc(),
                                      plugin=getattr(err, "plugin", None))
        except BaseException as err:  # noqa: BLE001 - sys.exit() or KeyboardInterrupt in a plugin: not this rank's end
            info = messages.ErrorInfo(type(err).__name__, f"{err!r} was raised while serving this request (a plugin "
                                      "that calls sys.exit() or raises a BaseException); the rank goes on serving",
                                      traceback.format_exc(), plugin=getattr(err, "plugin", None))
        return messages.Reply(request.id, rank, error=info)

    def _dispatch(self, request: messages.Request):
        kind = KINDS.get(request.kind)
        if kind is None:
            raise ValueError(f"unknown request kind {request.kind!r}; this server knows {sorted(KINDS)}")
        if not isinstance(request.payload, kind.payload):
            raise TypeError(f"a {request.kind!r} request carries a {kind.payload.__name__}, "
                            f"got {type(request.payload).__name__}")
        self.replica.handled[request.kind] += 1
        if kind.needs_setup and not self.replica.ready:
            raise RuntimeError("the server is not set up: create the Caller first")
        with profiled(request.kind, self.replica.handled[request.kind], self.role.global_rank,
                      self.replica.device.type):
            return kind.handle(self.replica, request.payload)

    def close(self) -> None:
        """Hang up on the client. The process groups are left to the exit: tearing them down rank by rank
        races with the peers' own exits (a rank whose peer is already gone can abort inside gloo), and
        nothing is left to synchronise once the client has said stop."""
        self.stopping = True
        self.closed = True
        if self.link is not None:
            self.link.close()


class _Undecodable:
    """A request that arrived whole but that this rank cannot decode (its payload, or its header): answered with
    an error, in order."""

    def __init__(self, header: dict, why: str):
        self.id = header.get("id", -1)
        self.kind = header.get("kind", "?")
        self.payload = None
        self.error = ValueError(f"this server cannot decode the {self.kind!r} request: {why}")


def _sizes(payload) -> str:
    contexts = getattr(payload, "contexts", None)
    if contexts is None:
        return ""
    candidates = getattr(payload, "candidates", None)
    extra = f", {sum(len(c) for c in candidates)} candidates" if candidates else ""
    return f"({len(contexts)} contexts{extra})"


def run_server(config: Config, rank: int, local_rank: int, node_rank: int, on_exit=None) -> NoReturn:
    """Entry point of every rank > 0: serve until the client says stop, then exit the process (0).
    ``on_exit(code)``, if given, is called just before a clean exit (``llmrl run`` records it)."""
    from llmrl.engine.config.topology import role_of

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle; it stops us cleanly
    exit_with_parent()
    configure(config.log_level, rank)
    import torch

    torch.set_num_threads(threads_for_server(config, node_rank))
    logger.debug(keep_freed_memory(config.host_malloc))
    from llmrl.engine.model import cpu_matmul

    cpu_matmul.configure(config.cpu_matmul)
    server = Server(config, role_of(config, rank), on_exit)
    server.connect()
    server.start(local_rank, node_rank)
    code = server.serve()
    server.close()
    if on_exit is not None:
        on_exit(code)
    leave(code)
