"""The model-backend seam: what a server rank needs from a model library, and how the config picks one.

A backend owns one rank's model: it loads it (before the client's Caller exists), applies initializers and
builds heads and updater (``prepare``), builds what runs it (``build``, collective over the LLM's ranks), and
then serves the requests a kind's handler asks for: scoring forward passes, tokenisation plans,
generation, updates, checkpoints, state dicts and memory reports. ``weights_changed`` is the notification
every implementation calls itself after it changes weights (an update, a checkpoint load): a backend that
keeps derived state (a key/value cache that lives across calls, a separate generation engine whose weights
must follow) overrides it. ``llms.<name>.backend`` names the implementation in :data:`BACKENDS`; adding one is
a new module plus a line here and a value in the config schema's enum.

Every request method takes plain arguments (and :class:`ScoreOptions`, a scoring pass's options): a request
kind's handler unpacks its payload, and this layer never sees one. This module defines the interface only;
:mod:`llmrl.engine.model.hf_backend` implements it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmrl.engine.config import Config
from llmrl.engine.config.topology import RankRole

if TYPE_CHECKING:
    from llmrl.engine.model.scoring.tokenization import TokenPlan
    from llmrl.engine.server.group import GroupChannel
    from llmrl.plugins.contracts import ForwardOutputs, UpdateBatch

BACKENDS = {"hf": "llmrl.engine.model.hf_backend:HFBackend"}


@dataclass(frozen=True)
class ScoreOptions:
    """The options of a scoring pass beyond its inputs, heads, adapter and minibatch size."""

    per_token: bool = False  # fill the outputs' per-token log-probs
    entropy: bool = False  # and per-token entropies
    add_eos: bool = False  # end every candidate with the EOS token
    head_kwargs: dict | None = None  # keyword arguments for the heads' forward


class ModelBackend(ABC):
    """One rank's model. Every method runs on every rank of the LLM's share of a request (tensor-parallel ranks
    of a replica receive the same share); methods marked collective must be called by every rank of the LLM."""

    def __init__(self, config: Config, role: RankRole, device: torch.device, group: GroupChannel):
        self.config = config
        self.llm = config.llms[role.llm]
        self.role = role
        self.device = device
        self.group = group

    # ------------------------------------------------------------------ start-up

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights (local, no collective; runs while the user's script starts)."""

    @abstractmethod
    def prepare(self, script_plugins: dict) -> None:
        """Apply initializers, build heads and updater (local, no collective). ``script_plugins`` holds the
        ``heads`` / ``initializers`` / ``updater`` the script handed to its Caller."""

    @abstractmethod
    def build(self) -> dict:
        """Build what runs the model (collective) and return its description for ``Caller.info``."""

    # ------------------------------------------------------------------ requests

    @abstractmethod
    def score(self, contexts: list, candidates: list | None, heads: tuple[str, ...], adapter: str | None,
              minibatch_size: int | None, options: ScoreOptions) -> ForwardOutputs:
        """Score candidates and run heads without gradients (collective under lockstep). Contexts and candidates
        are strings or token id lists; ``options`` says what else the pass keeps or adds."""

    @abstractmethod
    def tokenize(self, contexts: list, candidates: list | None) -> TokenPlan:
        """The token plan ``score`` would run for these inputs."""

    @abstractmethod
    def generate(self, contexts: list, kwargs: dict, adapter: str | None, seed: int | None,
                 minibatch_size: int | None) -> list[list[dict]]:
        """Per context (a string or token ids), ``num_return_sequences`` samples: ``text``, ``tokens``, raw-model
        ``logprobs``."""

    @abstractmethod
    def update(self, batch: UpdateBatch) -> dict:
        """Run the updater on this replica's share (collective); returns its stats."""

    @abstractmethod
    def forward_backward(self, tokens: list[list[int]], inputs: list[dict[str, list[float]]], loss_fn: str | None,
                         loss_fn_config: dict, backward: bool, adapter: str | None) -> dict:
        """Log-probs, the built-in loss ``loss_fn`` (None: none) and (``backward``) its gradients, accumulated until
        ``optim_step``, for this replica's share of token-level sequences: each one's ``tokens`` and per-token loss
        ``inputs`` (collective)."""

    @abstractmethod
    def optim_step(self, settings: dict, adapter: str | None) -> dict:
        """One optimizer step over the accumulated gradients, with this step's hyperparameters (collective)."""

    @abstractmethod
    def manage_adapters(self, operation: str, name: str, args: dict) -> dict:
        """Take or drop a snapshot, create or delete a LoRA adapter, save or load one adapter's state (collective);
        an operation that is not one of these is refused and changes nothing."""

    @abstractmethod
    def save(self, folder: str) -> None:
        """Write this rank's part of a checkpoint into ``folder`` (collective)."""

    @abstractmethod
    def state_dict(self, prefix: str, own_replica: bool) -> dict[str, torch.Tensor] | None:
        """The full weights (gathered; collective) on the group leader, or this replica's own copy."""

    @abstractmethod
    def memory(self) -> dict[str, Any]:
        """Memory use of this rank (resident set size, peak, CUDA allocations, parameter bytes)."""

    def weights_changed(self, unchanged_below: int = 0) -> None:  # noqa: B027 - a notification: no-op default
        """Called by the backend itself after every change of weights (update, checkpoint load); the layers below
        ``unchanged_below`` (0: none) are known to have kept their weights."""


def create_backend(config: Config, role: RankRole, device: torch.device, group: GroupChannel) -> ModelBackend:
    """The backend the LLM's config names (``llms.<name>.backend``)."""
    name = config.llms[role.llm].backend
    module_name, _, class_name = BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config, role, device, group)
