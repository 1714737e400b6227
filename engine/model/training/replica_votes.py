"""The votes an LLM's ranks take during an update, so that their DeepSpeed collectives line up: the trainer's part
that counts the updater's calls and asks the other ranks before each collective operation.

A vote (:meth:`~llmrl.engine.server.group.GroupChannel.agree`) carries whether this rank is ok, an integer (the
largest wins) and the rank's position: what it is about to do and the trainer calls its updater has made so far.
Ranks whose updaters parted raise :class:`ReplicasOutOfStep` at the first vote where their positions differ, naming
each replica's counts. A rank that failed casts one last vote saying so (:attr:`ReplicaVotes.failed_vote_cast`
records that it has: it votes no more), and every other rank stops at that vote with
:class:`~llmrl.engine.errors.PeerAborted`.

This module decides nothing about training: the trainer (:mod:`llmrl.engine.model.training.trainer`) chooses what to
vote on and when, and counts its calls in :attr:`ReplicaVotes.calls`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmrl.engine.errors import PeerAborted
from llmrl.engine.server.group import OutOfStep

if TYPE_CHECKING:
    from llmrl.engine.config import LLMConfig
    from llmrl.engine.server.group import GroupChannel

# What a trainer's vote says it is about to do (the first entry of its position, see GroupChannel.agree).
FORWARD, BACKWARD, STEP, SUM, END = 1, 2, 3, 4, 5
_DOING = {FORWARD: "about to call trainer.forward", BACKWARD: "about to call trainer.backward",
          STEP: "about to take an optimizer step", SUM: "about to call trainer.sum_across_replicas",
          END: "at the end of the update"}


class ReplicasOutOfStep(RuntimeError):
    """The replicas' updaters did not make the same trainer calls."""


class ReplicaVotes:
    """One rank's votes with the other ranks of its LLM, for one trainer.

    Args:
        group: the LLM's control channel (the ranks that vote).
        llm: the LLM's config (its name and tensor-parallel size, for the messages).

    State: :attr:`calls` (the trainer calls of each kind this rank's updater has made: the trainer counts them) and
    :attr:`failed_vote_cast` (this rank has told the others that it failed, or every rank raises at the same vote:
    no further vote).
    """

    def __init__(self, group: GroupChannel, llm: LLMConfig):
        self.group = group
        self.llm = llm
        self.calls = {FORWARD: 0, BACKWARD: 0, STEP: 0, SUM: 0}  # what this rank's updater has called so far
        self.failed_vote_cast = False

    def position(self, doing: int) -> tuple[int, ...]:
        """Where this rank votes from: what it is about to do, then its calls so far."""
        return (doing, self.calls[FORWARD], self.calls[BACKWARD], self.calls[STEP], self.calls[SUM])

    def vote(self, ok: bool, doing: int, value: int = 0) -> tuple[bool, int]:
        """A vote of the LLM's ranks from this position: whether every rank is ok, and the largest ``value``; raises
        :class:`ReplicasOutOfStep` when the replicas' updaters have not made the same calls."""
        try:
            return self.group.agree(ok, value, self.position(doing))
        except OutOfStep as err:
            raise self.out_of_step(err) from None

    def out_of_step(self, err: OutOfStep) -> ReplicasOutOfStep:
        """The error every rank raises when ``err`` found the replicas out of step (no further vote)."""
        self.failed_vote_cast = True
        return ReplicasOutOfStep(out_of_step_message(self.llm, err.positions))

    def check_peers(self, ok: bool, doing: int) -> None:
        """Vote ``ok``; raises :class:`PeerAborted` when this rank is ok and another is not (a rank that is not ok
        returns, its vote cast)."""
        if not self.vote(ok, doing)[0]:
            if not ok:
                self.failed_vote_cast = True
                return
            raise PeerAborted(f"another rank of LLM {self.llm.name!r} failed; stopped "
                              f"{_DOING.get(doing, 'at its next step')}")

    def agree(self, doing: int, value: int) -> int:
        """The largest ``value`` of the LLM's ranks; raises :class:`PeerAborted` when another rank failed (it has
        left the update: going on would wait for it in a collective)."""
        everyone_ok, most = self.vote(True, doing, value)
        self.stop_unless(everyone_ok, None)
        return most

    def stop_unless(self, everyone_ok: bool, error: Exception | None) -> None:
        """After a vote: raise this rank's ``error`` (its vote said so), or :class:`PeerAborted` when another rank
        was not ok."""
        if error is not None:
            self.failed_vote_cast = True
            raise error
        if not everyone_ok:
            raise PeerAborted(f"another rank of LLM {self.llm.name!r} failed; stopped where the replicas met")


def out_of_step_message(llm: LLMConfig, positions: list[tuple[int, ...]]) -> str:
    """Which calls each replica's updater had made when they parted, and what to do."""
    tp = llm.tensor_parallel
    lines = []
    for replica, position in enumerate(positions[::tp]):
        doing, forward, backward, step, sums = position[:5]
        lines.append(f"replica {replica} was {_DOING.get(doing, '?')} after {forward} forward, {backward} "
                     f"backward and {step} step call(s)")
    return (f"the replicas of LLM {llm.name!r} ran their updater out of step: " + "; ".join(lines)
            + ". Every replica must call trainer.forward / backward / step the same number of times: loop over "
            "batch.minibatches(size) (every replica gets the same number of minibatches, some possibly empty) "
            "and call trainer.backward and trainer.step once per minibatch, never once per local sample. No "
            "replica took a step the others did not.")
