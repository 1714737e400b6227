"""Weight sync over process groups (``sync_weights(via="group")``): the learner's group leader sends the weights
straight to each rank of the sampler, so no byte of them passes through rank 0's client.

The source's group leader and each rank of the target LLM form a gloo group of two (rank 0 sends, rank 1
receives), on first use, through rank 0's run store, under keys that name the pair, the target rank, the group's
``generation`` and a random token that only the client's authenticated links carry. Each target rank has its own
group and its own sender thread on the source, so the sampler's replicas take a sync each in its own time, as
they take their other requests. A sync is two halves:

- **Staging** (the ``read_weights`` request, on the source): the weights :func:`read_weights` reads are packed into
  one byte buffer and queued for the sender threads, which send it in :data:`CHUNK` pieces while the source goes on
  serving (a learner's next training step does not wait for the sampler). The request answers with the buffer's
  layout (:class:`Staged`: tensor names, types, shapes, offsets), its digest (SHA-256 over its chunks' SHA-256) and
  its sequence number, not the weights. At most :data:`PENDING` sends wait per target rank; a learner that gets
  further ahead waits for the sampler.
- **Receiving** (the ``write_weights`` request, on every target rank): each send starts with a header (sequence
  number, size). The rank discards sends older than the one the client announced (their write never came: the
  client gave up on it), refuses a header that does not match the announcement before it allocates anything, then
  receives the bytes, hashing each chunk while the next arrives, and checks the digest that came through the
  client. Only then does :func:`write_weights` check every tensor and write. Bytes that do not match what the
  learner read are refused, and the sampler keeps its weights.

A sender forms its group and sends only once the target rank is in the write (the rank sets a ``ready`` key), so
no collective waits on the sampler's other requests, however long they take; the two ends then meet within
:data:`FORM_SECONDS`. A group whose send or receive fails (a rank died, a timeout) is dropped on both sides (the
target rank says so under the pair's keys), and its generation is not formed again: the next sync forms a new one.
A rank that dies closes its connections, so its peer's send or receive fails at once; a source that dies before
the group formed fails the target's write within :data:`FORM_SECONDS`. The client sends a pair's syncs one at a
time, in order, and ``close_llm`` of a source waits for the syncs its ranks still send.

This module moves and checks bytes; what is synced and how it is written is :mod:`weight_sync`'s.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import queue
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PENDING = 4  # sends queued per target rank before staging waits for the sampler
FORM_SECONDS = 120.0  # both ends form a group only once the target is in the write: they meet within this


@dataclass(frozen=True)
class Staged:
    """What the client relays from the source's staging to the target's receiving: every field but the bytes."""

    source: str
    generation: int  # which groups of the pair (new ones after a failure)
    token: str  # random, per generation: part of the groups' rendezvous keys
    sequence: int  # this sync's number in that generation, from 1
    layout: tuple  # (name, dtype name, shape, offset, nbytes) per tensor, in buffer order
    nbytes: int
    digest: str  # SHA-256 over the buffer's chunks' SHA-256 digests, hex


ALIGN = 16  # every tensor starts at a multiple of this many bytes of the buffer (so it can be viewed in place)


def pack(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """The tensors as one contiguous uint8 CPU buffer (each at an offset aligned to :data:`ALIGN`), and their
    layout."""
    layout, parts, offset = [], [], 0
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        raw = tensor.reshape(-1).view(torch.uint8)
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, raw.numel()))
        padding = -raw.numel() % ALIGN
        parts += [raw, torch.zeros(padding, dtype=torch.uint8)] if padding else [raw]
        offset += raw.numel() + padding
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return buffer, tuple(layout)


def unpack(buffer: torch.Tensor, layout: tuple) -> dict[str, torch.Tensor]:
    """The tensors of a buffer that :func:`pack` made (views of it)."""
    out = {}
    for name, dtype, shape, offset, nbytes in layout:
        out[name] = buffer[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
    return out


CHUNK = 64 * 2**20  # bytes a broadcast carries and a digest covers: a target hashes one while it receives the next


def chunks(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[start:start + CHUNK] for start in range(0, buffer.numel(), CHUNK)]


def chunk_digest(chunk: torch.Tensor) -> bytes:
    return hashlib.sha256(chunk.numpy().data).digest()  # (hashlib lets go of the GIL over large buffers)


def digest(buffer: torch.Tensor, chunk_digests: list[bytes] | None = None) -> str:
    """The buffer's SHA-256 digest: that of its :data:`CHUNK` chunks' SHA-256 digests in order (computed here on
    up to 4 threads, unless given)."""
    if chunk_digests is None:
        with ThreadPoolExecutor(max_workers=4) as pool:
            chunk_digests = list(pool.map(chunk_digest, chunks(buffer)))
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def pair_prefix(source: str, target: str, generation: int, token: str) -> str:
    """The keys of one generation of a pair's groups; each target rank's group meets under ``<prefix>/<rank>``, and
    a target rank whose group failed sets ``<prefix>/closed``."""
    return f"llmrl/weights/{source}/{target}/{generation}/{token}"


CLOSED_KEY = "closed"


def meeting_place(store, prefix: str, timeout: float):
    """The keys under ``prefix`` of ``store``'s server, through a connection of their own: one store client used
    from several threads at once (a sender forming its group while another waits) mixes up their replies."""
    import torch.distributed as dist

    own = dist.TCPStore(store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(prefix, own)


def form_group(meeting, rank: int, timeout: float):
    """A gloo group of two meeting at ``meeting`` (blocks until both joined, at most ``timeout`` seconds)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(meeting, rank, 2, datetime.timedelta(seconds=timeout))


def ready_key(sequence: int) -> str:
    """Set by the target rank when it is in the write of send ``sequence`` (or of a later one): the sender starts
    the send only then, so no send waits in a collective for a sampler still busy with other requests."""
    return f"ready/{sequence}"


def close_group(group) -> None:
    """Close a group's connections now (its peer's pending send or receive then fails at once), not when the
    object is collected: a traceback that holds it would keep it open."""
    try:
        group.abort()
    except Exception as err:  # (already closed, or broken past closing: either way it carries nothing more)
        logger.debug(f"closing a weight-sync group: {err}")


def broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


class WeightChannels:
    """This rank's groups for weight sync: as a source leader, a sender thread per target rank; as a target rank,
    a group per source LLM. ``store``: rank 0's run store; ``timeout``: the collective timeout (s)."""

    def __init__(self, store, llm: str, group_rank: int, timeout: float):
        self.store, self.llm, self.group_rank, self.timeout = store, llm, group_rank, timeout
        self._targets: dict[str, _Target] = {}
        self._received: dict[str, _Receiving] = {}  # source LLM -> its group with this rank
        self._dropped: dict[str, int] = {}  # source LLM -> the newest generation whose group failed here

    # ------------------------------------------------------------------ source side

    def stage(self, target: str, target_size: int, weights: dict[str, torch.Tensor]) -> Staged:
        """Queue ``weights`` for each of the target LLM's ``target_size`` ranks; returns what the client relays."""
        sending = self._targets.get(target)
        if sending is None or sending.failed() or len(sending.senders) != target_size:
            generation = 1 if sending is None else sending.generation + 1
            if sending is not None:
                logger.warning(f"weight sync to LLM {target!r}: {sending.failed() or 'another rank count'}; "
                               f"forming new groups (generation {generation})")
                sending.stop()
            sending = self._targets[target] = _Target(self, target, target_size, generation)
        buffer, layout = pack(weights)
        sending.sequence += 1
        staged = Staged(self.llm, sending.generation, sending.token, sending.sequence, layout, buffer.numel(),
                        digest(buffer))
        for sender in sending.senders:
            if not sender.room.acquire(timeout=self.timeout):
                raise TimeoutError(f"weight sync to LLM {target!r}: {PENDING} syncs still wait for its rank "
                                   f"{sender.target_rank} after {self.timeout:.0f} s (timeouts.collective); wait "
                                   "for the answers of the syncs sent before")
            sender.outbox.put((sending.sequence, buffer))
        return staged

    # ------------------------------------------------------------------ target side

    def receive(self, staged: Staged) -> dict[str, torch.Tensor]:
        """This rank's copy of the weights ``staged`` describes, checked against its sequence and digest."""
        source = staged.source
        if staged.generation <= self._dropped.get(source, 0):
            raise RuntimeError(f"weight sync from LLM {source!r}: its group (generation {staged.generation}) "
                               "failed on this rank; nothing was synced, and the next sync forms a new one")
        generation = staged.generation
        error = None
        try:
            receiving = self._received.get(source)
            if receiving is None or receiving.generation != generation:
                pair = meeting_place(self.store, pair_prefix(source, self.llm, generation, staged.token), self.timeout)
                meeting = type(pair)(str(self.group_rank), pair)  # (a PrefixStore under the pair's)
                receiving = self._received[source] = _Receiving(generation, pair, meeting)
            for sequence in range(receiving.ready + 1, staged.sequence + 1):  # this send, and any skipped before
                receiving.meeting.set(ready_key(sequence), b"1")
            receiving.ready = max(receiving.ready, staged.sequence)
            if receiving.group is None:
                receiving.group = form_group(receiving.meeting, 1, min(self.timeout, FORM_SECONDS))
            buffer, chunk_digests = _receive_announced(receiving.group, staged)
        except Exception as err:  # re-raised below, without the traceback that would hold the group open
            error = err if isinstance(err, ValueError) else RuntimeError(f"{type(err).__name__}: {err}")
            error = type(error)(str(error))
        if error is not None:
            dropped = self._received.pop(source, None)
            self._dropped[source] = generation
            if dropped is not None:
                _say_closed(dropped.pair)
                if dropped.group is not None:
                    close_group(dropped.group)
            del dropped, receiving
            raise error
        if digest(buffer, chunk_digests) != staged.digest:
            raise ValueError(f"weight sync from LLM {source!r}: the bytes received over the group do not match "
                             f"the digest LLM {source!r} sent through the client; nothing was synced")
        return unpack(buffer, staged.layout)

    def close(self) -> None:
        """End the sender threads once their queued sends are done, and drop the groups (a server leaves them to
        its exit; a test closes them)."""
        for sending in self._targets.values():
            sending.stop(join=True)
        self._targets.clear()
        for receiving in self._received.values():
            if receiving.group is not None:
                close_group(receiving.group)
        self._received.clear()


def _receive_announced(group, staged: Staged) -> tuple[torch.Tensor, list[bytes]]:
    """The buffer of send ``staged.sequence``, and its chunks' digests: older sends are received into a scratch
    chunk and discarded; a newer one, or one of another size, ends the group (raises)."""
    while True:
        header = torch.zeros(2, dtype=torch.int64)
        broadcast(group, header)
        sequence, nbytes = int(header[0]), int(header[1])
        if sequence >= staged.sequence:
            break
        scratch = torch.empty(min(nbytes, CHUNK), dtype=torch.uint8)
        for start in range(0, nbytes, CHUNK):
            broadcast(group, scratch[:min(CHUNK, nbytes - start)])
        logger.warning(f"weight sync from LLM {staged.source!r}: send #{sequence} was never written here (its "
                       "write did not come); discarded")
    if sequence != staged.sequence or nbytes != staged.nbytes:
        raise ValueError(f"weight sync from LLM {staged.source!r}: received send #{sequence} of {nbytes} bytes "
                         f"where #{staged.sequence} of {staged.nbytes} was announced; nothing was synced")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=1) as hasher:  # each chunk hashed while the next one arrives
        hashed = []
        for chunk in chunks(buffer):
            broadcast(group, chunk)
            hashed.append(hasher.submit(chunk_digest, chunk))
        return buffer, [h.result() for h in hashed]


def _say_closed(pair) -> None:
    try:
        pair.set(CLOSED_KEY, b"1")  # the source forms new groups at its next staging
    except Exception as err:  # (the store is gone with rank 0: the run is over)
        logger.debug(f"weight sync: could not say the group closed: {err}")


@dataclass
class _Receiving:
    """A target rank's group with one source LLM: the pair's keys, where this rank's group meets, the group once
    formed, and the sends this rank said it is ready for."""

    generation: int
    pair: object
    meeting: object
    group: object = None
    ready: int = 0


class _Target:
    """The source leader's senders to one target LLM, one per target rank, of one generation."""

    def __init__(self, channels: WeightChannels, target: str, target_size: int, generation: int):
        self.generation, self.token, self.sequence = generation, secrets.token_hex(16), 0
        prefix = pair_prefix(channels.llm, target, generation, self.token)
        self.pair = meeting_place(channels.store, prefix, channels.timeout)  # (read by the serving thread only)
        self.senders = [_Sender(channels, f"{prefix}/{rank}", target, rank) for rank in range(target_size)]

    def failed(self) -> str | None:
        """Why these groups are over (a sender failed, or a target rank closed its group), or None."""
        failed = next((s.failed for s in self.senders if s.failed is not None), None)
        if failed is None and self.pair.check([CLOSED_KEY]):
            failed = "a target rank closed its group"
        return failed

    def stop(self, join: bool = False) -> None:
        for sender in self.senders:
            sender.stop(join)


class _Sender:
    """The source leader's thread that sends one target rank the staged buffers, in order. It ends on its first
    failure, which it logs and keeps in ``failed`` (the next staging forms new groups), its group closed with it."""

    def __init__(self, channels: WeightChannels, prefix: str, target: str, target_rank: int):
        self.channels, self.prefix, self.target, self.target_rank = channels, prefix, target, target_rank
        self.failed: str | None = None
        self.outbox: queue.Queue = queue.Queue()  # (sequence, buffer), or None: stop
        self.room = threading.BoundedSemaphore(PENDING)  # taken by each staged send, given back once it is sent
        self.stopping = threading.Event()
        self.waited = threading.Event()  # set once a wait for the target rank outlasted its timeout
        self.thread = threading.Thread(target=self._run, name=f"llmrl-weights-to-{target}-{target_rank}",
                                       daemon=True)
        self.thread.start()

    def stop(self, join: bool = False) -> None:
        self.stopping.set()
        self.outbox.put(None)
        if join:
            self.thread.join(self.channels.timeout)

    def _ready(self, meeting, sequence: int) -> bool:
        """Wait until the target rank is in the write of send ``sequence``, however long its other requests take
        (it wakes every minute, or every timeout if shorter, to see whether it was stopped); False if it was."""
        import torch.distributed as dist

        while not self.stopping.is_set():
            try:
                meeting.wait([ready_key(sequence)], datetime.timedelta(seconds=min(self.channels.timeout, 60)))
                return True
            except dist.DistStoreError:  # (the wait's timeout; a store that is gone raises another error)
                self.waited.set()
        return False

    def _run(self) -> None:
        group = None
        try:
            meeting = meeting_place(self.channels.store, self.prefix, self.channels.timeout)
            while (item := self.outbox.get()) is not None:
                sequence, buffer = item
                if not self._ready(meeting, sequence):
                    break
                if group is None:
                    group = form_group(meeting, 0, min(self.channels.timeout, FORM_SECONDS))
                broadcast(group, torch.tensor([sequence, buffer.numel()], dtype=torch.int64))
                for chunk in chunks(buffer):
                    broadcast(group, chunk)
                self.room.release()
        except Exception as err:  # a target rank died or timed out: these groups are over, the next sync forms new
            self.failed = f"{type(err).__name__}: {err}"
            logger.error(f"weight sync to LLM {self.target!r} rank {self.target_rank} failed: {self.failed}")
        finally:
            if group is not None:
                close_group(group)
