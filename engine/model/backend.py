"""The model-backend seam: what a server rank needs from a model library, and how the config picks one.

A backend owns one rank's model: it loads it (before the client's Caller exists), applies initializers and
builds heads and updater (``prepare``), builds what runs it (``build``, collective over the LLM's ranks), and
then serves the requests a kind's handler asks for: scoring forward passes, tokenisation plans,
generation, updates, checkpoints, state dicts and memory reports. ``weights_changed`` is the notification
every implementation calls itself after it changes weights (an update, a checkpoint load): a backend that
keeps derived state (a key/value cache that lives across calls, a separate generation engine whose weights
must follow) overrides it. ``llms.<name>.backend`` names the implementation in :data:`BACKENDS`; adding one is
a new module plus a line here and a value in the config schema's enum.

Every request method serves one request kind and takes that kind's payload, the typed request a rank received,
as its one argument (``request``): the kind's handler hands it on as it came, and the payload types are named here
for type checking only (the model layer imports no request kind at run time). This module defines the interface
only; :mod:`llmrl.engine.model.hf_backend` implements it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from llmrl.engine.config import Config
from llmrl.engine.config.topology import RankRole

if TYPE_CHECKING:
    from llmrl.engine.model.scoring.tokenization import TokenPlan
    from llmrl.engine.requests.adapters.create_adapter import CreateAdapterRequest
    from llmrl.engine.requests.adapters.delete_adapter import DeleteAdapterRequest
    from llmrl.engine.requests.adapters.drop_snapshot import DropSnapshotRequest
    from llmrl.engine.requests.adapters.load_adapter import LoadAdapterRequest
    from llmrl.engine.requests.adapters.save_adapter import SaveAdapterRequest
    from llmrl.engine.requests.adapters.snapshot import SnapshotRequest
    from llmrl.engine.requests.admin import StatsRequest
    from llmrl.engine.requests.forward_backward import ForwardBackwardRequest
    from llmrl.engine.requests.generate import GenerateRequest
    from llmrl.engine.requests.optim_step import OptimStepRequest
    from llmrl.engine.requests.read_weights import ReadWeightsRequest
    from llmrl.engine.requests.save import SaveRequest
    from llmrl.engine.requests.score import ScoreRequest
    from llmrl.engine.requests.state_dict import StateDictRequest
    from llmrl.engine.requests.tokenize import TokenizeRequest
    from llmrl.engine.requests.update import UpdateRequest
    from llmrl.engine.requests.write_weights import WriteWeightsRequest
    from llmrl.engine.server.group import GroupChannel
    from llmrl.plugins.contracts import ForwardOutputs

BACKENDS = {"hf": "llmrl.engine.model.hf_backend:HFBackend"}


class ModelBackend(ABC):
    """One rank's model. Every method runs on every rank of the LLM's share of a request (tensor-parallel ranks
    of a replica receive the same share); methods marked collective must be called by every rank of the LLM."""

    def __init__(self, config: Config, role: RankRole, device: torch.device, group: GroupChannel):
        self.config = config
        self.llm = config.llms[role.llm]
        self.role = role
        self.device = device
        self.group = group
        # Set by the server: ``take(before)`` runs the next queued request now if it is a weight write sent in flight
        # (``sync_weights(in_flight=True)``), calling ``before()`` first; True if it ran one. ``generate`` calls it
        # between decode batches. None: nothing is taken during a request.
        self.queued_write_taker: Callable[[Callable[[], None]], bool] | None = None
        # Set by the server: this rank's groups for ``sync_weights(via="group")``
        # (:class:`llmrl.engine.model.weight_channel.WeightChannels`).
        self.weight_channels = None

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
    # One method per request kind (``backend_method`` of its Kind), taking the kind's payload as its one argument.

    @abstractmethod
    def score(self, request: ScoreRequest) -> ForwardOutputs:
        """Score candidates and run heads without gradients (collective under lockstep). Contexts and candidates
        are strings or token id lists; the request's options say what else the pass keeps or adds."""

    @abstractmethod
    def tokenize(self, request: TokenizeRequest) -> TokenPlan:
        """The token plan ``score`` would run for these inputs."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> list[list[dict]]:
        """Per context (a string or token ids), ``num_return_sequences`` samples: ``text``, ``tokens``, raw-model
        ``logprobs``, and the ``policy_version`` of the weights each was drawn from (a weight write taken between
        decode batches, see :attr:`queued_write_taker`, gives the samples after it the new version)."""

    @abstractmethod
    def update(self, request: UpdateRequest) -> dict:
        """Run the updater on this replica's share (collective; ``request.batch`` makes its
        :class:`~llmrl.plugins.contracts.UpdateBatch`); returns its stats."""

    @abstractmethod
    def forward_backward(self, request: ForwardBackwardRequest) -> dict:
        """Log-probs, the built-in loss ``loss_fn`` (None: none) and (``backward``) its gradients, accumulated until
        ``optim_step``, for this replica's share of token-level sequences: each one's ``tokens`` and per-token loss
        ``inputs`` (collective)."""

    @abstractmethod
    def optim_step(self, request: OptimStepRequest) -> dict:
        """One optimizer step over the accumulated gradients, with this step's hyperparameters (collective)."""

    @abstractmethod
    def snapshot(self, request: SnapshotRequest) -> dict:
        """Freeze a copy of an adapter's weights under a new name (collective)."""

    @abstractmethod
    def drop_snapshot(self, request: DropSnapshotRequest) -> dict:
        """Delete a snapshot and free its memory (collective)."""

    @abstractmethod
    def create_adapter(self, request: CreateAdapterRequest) -> dict:
        """Add a LoRA adapter with an optimizer state of its own (collective)."""

    @abstractmethod
    def delete_adapter(self, request: DeleteAdapterRequest) -> dict:
        """Delete an adapter made by ``create_adapter`` (collective)."""

    @abstractmethod
    def save_adapter(self, request: SaveAdapterRequest) -> dict:
        """Write one adapter's state in a new folder (collective; the group leader writes)."""

    @abstractmethod
    def load_adapter(self, request: LoadAdapterRequest) -> dict:
        """Load a saved adapter state into an adapter, created when it does not exist (collective)."""

    @abstractmethod
    def save(self, request: SaveRequest) -> None:
        """Write this rank's part of a checkpoint into ``request.folder`` (collective)."""

    @abstractmethod
    def state_dict(self, request: StateDictRequest) -> dict[str, torch.Tensor] | None:
        """The full weights (gathered; collective) on the group leader, or this replica's own copy."""

    @abstractmethod
    def read_weights(self, request: ReadWeightsRequest) -> dict | None:
        """One adapter's weights, or the whole model's, gathered, with their policy version, on the group leader
        (collective; for ``sync_weights``)."""

    @abstractmethod
    def write_weights(self, request: WriteWeightsRequest) -> dict:
        """Write synced weights in place into this rank's model and take their policy version."""

    @abstractmethod
    def memory(self, request: StatsRequest) -> dict[str, Any]:
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
