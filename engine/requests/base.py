"""What every request kind shares: its declaration, how a call is cut into per-rank parts, and what the
client side of a kind may use of the run.

A request kind is declared once, in its own module of this package: a payload dataclass (what one rank
receives), a client half (``send``: check, split across replicas, assemble the replies into what the
Caller returns) and a server half (``handle``: run it on a rank's :class:`~llmrl.engine.server.replica.Replica`,
unpacking the payload into plain arguments for one backend method). :class:`Kind` is that declaration: the
name, the payload type, both halves, the :class:`~llmrl.engine.model.backend.ModelBackend` method the handler
calls and the Caller methods that send the kind; ``tests/test_request_kinds.py`` checks each against the code.

Splitting comes in two grains. Whole inputs: :func:`split_evenly` / :func:`split_by_cost` give each replica a
contiguous range of inputs (:func:`replica_parts`). Pieces of inputs: one input (a context) may be cut into
contiguous :class:`Piece` s of its items (candidates, return sequences) spread over replicas
(:func:`group_pieces`, :func:`piece_parts`), and :func:`gather_pieces` brings each input's pieces back together
in order, for the kind to merge.

This module holds the shared shapes and splitting rules; it sends nothing and computes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from llmrl.engine.config import Config

Part = tuple[list[int], Any]  # the ranks that receive one payload, and that payload


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A request kind, declared in its own module and named in :data:`llmrl.engine.requests.KINDS`."""

    name: str
    payload: type  # the dataclass every rank of the kind receives
    send: Callable[..., Future]  # client half: send(run, ...) -> future of what the Caller returns
    handle: Callable[[Any, Any], Any]  # server half: handle(replica, payload) -> value (None on non-answering ranks)
    backend_method: str | None  # the ModelBackend method ``handle`` calls (None: it calls none)
    caller_methods: tuple[str, ...]  # the Caller methods that send this kind (and only they do)
    needs_setup: bool = True  # refused until the client's Caller has set the servers up


class Run(Protocol):
    """What a kind's client half uses of the run (rank 0's :class:`~llmrl.engine.client.hosting.ClientRun`)."""

    config: Config
    closed_llms: set[str]  # LLMs stopped by Caller.close_llm

    def replicas(self, llm: str) -> list[list[int]]:
        """Global ranks of each replica of ``llm``; the first rank of each is its leader."""

    def submit(self, kind: str, parts: list[Part], assemble: Callable[[dict[int, Any]], Any]) -> Future:
        """Send the parts; a future of ``assemble({rank: value})``."""


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges over ``n`` items whose sizes differ by at most one (larger ones first)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def split_by_cost(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges with roughly equal total cost (each item stays whole)."""
    total = sum(costs)
    bounds, start, acc = [], 0, 0
    for r in range(parts - 1):
        target = total * (r + 1) / parts
        stop = start
        while stop < len(costs) and acc + costs[stop] / 2 <= target:
            acc += costs[stop]
            stop += 1
        bounds.append((start, stop))
        start = stop
    bounds.append((start, len(costs)))
    return bounds


def replica_parts(run: Run, llm: str, bounds: list[tuple[int, int]], make_payload: Callable[[int, int], Any],
                  keep_empty: bool) -> tuple[list[Part], list[int]]:
    """One part per replica (every rank of a replica gets the same payload) for the items in its bounds.
    Replicas with nothing to do are left out unless ``keep_empty`` (lockstep: every replica takes part).
    Returns the parts and the leader rank of each, in item order."""
    parts, leaders = [], []
    for ranks, (start, stop) in zip(run.replicas(llm), bounds):
        if stop > start or keep_empty:
            parts.append((ranks, make_payload(start, stop)))
            leaders.append(ranks[0])
    return parts, leaders


@dataclass(frozen=True)
class Piece:
    """Items ``[start, stop)`` (candidates, return sequences) of input ``input`` (a context) of a call."""

    input: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def group_pieces(atoms: list[Piece], bounds: list[tuple[int, int]]) -> list[list[Piece]]:
    """Each replica's pieces: the atoms in its bounds (in order), adjacent atoms of the same input merged into one
    piece (so a replica receives each context once)."""
    shares = []
    for start, stop in bounds:
        share: list[Piece] = []
        for atom in atoms[start:stop]:
            last = share[-1] if share else None
            if last is not None and last.input == atom.input and last.stop == atom.start:
                share[-1] = Piece(atom.input, last.start, atom.stop)
            else:
                share.append(atom)
        shares.append(share)
    return shares


def piece_parts(run: Run, llm: str, shares: list[list[Piece]], make_payload: Callable[[list[Piece]], Any],
                keep_empty: bool) -> tuple[list[Part], list[tuple[int, list[Piece]]]]:
    """One part per replica for its pieces (every rank of a replica gets the same payload); replicas without a
    piece are left out unless ``keep_empty`` (lockstep). Returns the parts and, per part, its leader rank and
    its pieces."""
    parts, answering = [], []
    for ranks, pieces in zip(run.replicas(llm), shares):
        if pieces or keep_empty:
            parts.append((ranks, make_payload(pieces)))
            answering.append((ranks[0], pieces))
    return parts, answering


def gather_pieces(values: dict[int, list], answering: list[tuple[int, list[Piece]]], n: int) -> list[list]:
    """Per input, its pieces' values in item order: ``values[leader]`` holds one value per piece of that leader."""
    per_input: list[list] = [[] for _ in range(n)]
    for leader, pieces in answering:
        got = values[leader]
        if len(got) != len(pieces):
            raise RuntimeError(f"rank {leader} answered {len(got)} values for {len(pieces)} pieces")
        for piece, value in zip(pieces, got):
            per_input[piece.input].append(value)
    return per_input


def every_rank(run: Run, llms=None) -> list[int]:
    """Every server rank of the given LLMs (default: all that still serve), in rank order."""
    names = [name for name in run.config.llms if name not in run.closed_llms] if llms is None else llms
    return [r for name in names for replica in run.replicas(name) for r in replica]


def to_every_replica(run: Run, kind: str, llm: str, payload) -> Future:
    """The same payload to every rank of ``llm`` (for changes every replica must make alike); a future of the first
    replica's answer."""
    replicas = run.replicas(llm)
    return run.submit(kind, [(ranks, payload) for ranks in replicas], lambda values: values[replicas[0][0]])
