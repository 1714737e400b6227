"""Weight sync over a process group (``sync_weights(via="group")``): the learner's group leader sends the weights
straight to every rank of the sampler, so no byte of them passes through rank 0's client.

Each (source LLM, target LLM) pair gets its own small gloo group, formed on first use through rank 0's run store:
the source's group leader is its rank 0, the target's ranks follow in group-rank order. A sync is two halves:

- **Staging** (the ``read_weights`` request, on the source): the weights :func:`read_weights` reads are packed into
  one byte buffer and queued for the leader's sender thread, which broadcasts it while the source goes on serving
  (a learner's next training step does not wait for the sampler). The request answers with the buffer's layout
  (:class:`Staged`: tensor names, types, shapes, offsets), its digest (SHA-256 over its chunks' SHA-256) and its
  sequence number, not the weights.
- **Receiving** (the ``write_weights`` request, on every target rank): the rank first receives the broadcast,
  whatever else is wrong with the request (so the group's sends and receives stay paired), then checks the
  sequence number and the digest that came through the client's authenticated link, then writes through
  :func:`write_weights`, which checks every tensor before it writes any. Weights that do not match what the
  learner read (a stray sender, a broken pairing) are refused, and the sampler keeps its own.

A group whose send or receive fails (a rank died, a timeout) is dropped on both sides; the next sync forms a new
one (its ``generation`` is part of the rendezvous keys). The client sends a pair's syncs one at a time, in order.

This module moves and checks bytes; what is synced and how it is written is :mod:`weight_sync`'s.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staged:
    """What the client relays from the source's staging to the target's receiving: every field but the bytes."""

    source: str
    generation: int  # which group of the pair (a new one after a failure)
    sequence: int  # this sync's number on that group, from 1
    layout: tuple  # (name, dtype name, shape, offset, nbytes) per tensor, in buffer order
    nbytes: int
    digest: str  # SHA-256 of the buffer, hex


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


def group_prefix(source: str, target: str, generation: int) -> str:
    return f"llmrl/weights/{source}/{target}/{generation}"


def form_group(store, source: str, target: str, generation: int, rank: int, size: int, timeout: float):
    """The pair's gloo group (blocks until its ``size`` members have joined, at most ``timeout`` seconds). It meets
    through a connection of its own to ``store``'s server: one store client used from several threads at once
    (a sender forming its group while another waits) mixes up their replies."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout)
    own = dist.TCPStore(store.host, store.port, is_master=False, timeout=wait)
    return dist.ProcessGroupGloo(dist.PrefixStore(group_prefix(source, target, generation), own), rank, size, wait)


def broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


class WeightChannels:
    """This rank's groups for weight sync: as a source leader, one sender thread per target LLM; as a target
    rank, one group per source LLM. ``store``: rank 0's run store; ``timeout``: the collective timeout (s)."""

    def __init__(self, store, llm: str, group_rank: int, group_size: int, timeout: float):
        self.store, self.llm, self.timeout = store, llm, timeout
        self.group_rank, self.group_size = group_rank, group_size
        self._senders: dict[str, _Sender] = {}
        self._received: dict[str, tuple[int, object]] = {}  # source LLM -> (generation, group)

    # ------------------------------------------------------------------ source side

    def stage(self, target: str, target_size: int, weights: dict[str, torch.Tensor]) -> Staged:
        """Queue ``weights`` for the target LLM's ``target_size`` ranks; returns what the client relays."""
        sender = self._senders.get(target)
        if sender is None or sender.failed is not None:
            generation = 1 if sender is None else sender.generation + 1
            if sender is not None:
                logger.warning(f"weight sync to LLM {target!r}: the group failed ({sender.failed}); forming a "
                               f"new one (generation {generation})")
            sender = self._senders[target] = _Sender(self, target, target_size, generation)
        if sender.size != 1 + target_size:
            raise ValueError(f"weight sync to LLM {target!r}: {target_size} target ranks, the group has "
                             f"{sender.size - 1}")
        buffer, layout = pack(weights)
        sender.sequence += 1
        staged = Staged(self.llm, sender.generation, sender.sequence, layout, buffer.numel(), digest(buffer))
        sender.outbox.put((sender.sequence, buffer))
        return staged

    # ------------------------------------------------------------------ target side

    def receive(self, staged: Staged) -> dict[str, torch.Tensor]:
        """This rank's copy of the weights ``staged`` describes, checked against its sequence and digest."""
        source = staged.source
        generation, group = self._received.get(source, (0, None))
        if group is None or generation != staged.generation:
            generation = staged.generation
            group = form_group(self.store, source, self.llm, generation, 1 + self.group_rank, 1 + self.group_size,
                               self.timeout)
            self._received[source] = (generation, group)
        try:
            header = torch.zeros(2, dtype=torch.int64)
            broadcast(group, header)
            buffer = torch.empty(int(header[1]), dtype=torch.uint8)
            with ThreadPoolExecutor(max_workers=1) as hasher:  # each chunk hashed while the next one arrives
                hashed = []
                for chunk in chunks(buffer):
                    broadcast(group, chunk)
                    hashed.append(hasher.submit(chunk_digest, chunk))
                chunk_digests = [h.result() for h in hashed]
        except Exception:
            self._received.pop(source, None)
            raise
        sequence = int(header[0])
        if sequence != staged.sequence or buffer.numel() != staged.nbytes:
            raise ValueError(f"weight sync from LLM {source!r}: received send #{sequence} of {buffer.numel()} "
                             f"bytes where #{staged.sequence} of {staged.nbytes} was announced (the group's "
                             f"sends are out of step); nothing was synced")
        if digest(buffer, chunk_digests) != staged.digest:
            raise ValueError(f"weight sync from LLM {source!r}: the bytes received over the group do not match "
                             f"the digest LLM {source!r} sent through the client; nothing was synced")
        return unpack(buffer, staged.layout)

    def close(self) -> None:
        """End the sender threads once their queued sends are done, and drop the groups (a server leaves them to
        its exit; a test closes them)."""
        for sender in self._senders.values():
            sender.outbox.put(None)
        for sender in self._senders.values():
            sender.thread.join(self.timeout)
        self._senders.clear()
        self._received.clear()


class _Sender:
    """The source leader's thread that broadcasts a target's staged buffers, in order."""

    def __init__(self, channels: WeightChannels, target: str, target_size: int, generation: int):
        self.channels, self.target, self.generation = channels, target, generation
        self.size = 1 + target_size
        self.sequence = 0
        self.failed: str | None = None
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"llmrl-weights-to-{target}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            group = form_group(self.channels.store, self.channels.llm, self.target, self.generation, 0, self.size,
                               self.channels.timeout)
            while (item := self.outbox.get()) is not None:
                sequence, buffer = item
                broadcast(group, torch.tensor([sequence, buffer.numel()], dtype=torch.int64))
                for chunk in chunks(buffer):
                    broadcast(group, chunk)
        except Exception as err:  # a target rank died or timed out: this group is over, the next sync forms one
            self.failed = f"{type(err).__name__}: {err}"
            logger.error(f"weight sync to LLM {self.target!r} failed: {self.failed}")
