"""The narrow, typed handle on one rank's served model that training and checkpoints use.

:class:`ServedModel` is built by the Hugging Face backend once the DeepSpeed engine exists. It says what
the rank serves (the LLM's config, its place in the run, the engine around the model and heads, the
tokenizer, the adapters, heads and updater) and offers the few rules every user of it shares: which
LoRA adapter is active, which heads exist, what the requested heads need from a forward pass. What changes between
requests lives in two objects it owns (:mod:`llmrl.engine.model.served_state`): ``pending``, the gradients
``forward_backward`` left for ``optim_step``, and ``run_time``, the adapters and snapshots made while serving.

This module holds no request logic and runs no model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from llmrl.engine.config import LLMConfig, PluginSpec
from llmrl.engine.config.topology import RankRole
from llmrl.engine.model.scoring.planning import Needs
from llmrl.engine.model.served_state import PendingGradients, RunTimeAdapters

if TYPE_CHECKING:
    from llmrl.engine.server.group import GroupChannel
    from llmrl.plugins.contracts import LLMInfo, Updater


def needs_of(heads: list) -> Needs:
    """The union of the head classes' declarations (see :class:`~llmrl.plugins.contracts.Head`)."""
    context = any(h.needs_context_hidden or getattr(h, "needs_context_logits", False) for h in heads)
    candidate = any(h.needs_candidate_hidden for h in heads)
    token_hidden = any(h.needs_token_hidden for h in heads)
    logits = any(h.needs_logits for h in heads)
    readers = [h for h in heads if h.needs_context_hidden or h.needs_candidate_hidden or h.needs_token_hidden]
    layers = tuple(sorted({-1, *(i for h in readers for i in h.hidden_layers)}))
    per_token = token_hidden or logits or any(h.level == "token" for h in heads)
    return Needs(context_hidden=context, candidate_hidden=candidate, per_token=per_token, token_hidden=token_hidden,
                 token_logits=logits, layers=layers)


@dataclass
class ServedModel:
    """One rank's served model: set when the engine is built (``adapter_steps`` too, when it trains), then read;
    only ``pending`` and ``run_time`` change while it serves."""

    llm: LLMConfig
    role: RankRole
    device: torch.device
    group: GroupChannel
    info: LLMInfo
    tokenizer: Any
    engine: Any  # the DeepSpeed engine around a ModelWithHeads
    max_length: int | None
    adapters: list[str] = field(default_factory=list)
    head_specs: dict[str, PluginSpec] = field(default_factory=dict)
    updater: Updater | None = None
    updater_name: str | None = None
    adapter_steps: Any = None  # an AdapterSteps around the optimizer (engine/model/training/optimizer.py) when training
    pending: PendingGradients = field(default_factory=PendingGradients)  # forward_backward's, for optim_step
    run_time: RunTimeAdapters = field(default_factory=RunTimeAdapters)  # adapters and snapshots made while serving

    @property
    def module(self):
        """The :class:`~llmrl.engine.model.module.ModelWithHeads` inside the engine."""
        return self.engine.module

    @property
    def model(self):
        """The Hugging Face model (a PeftModel when adapters were added)."""
        return self.engine.module.model

    def check_heads(self, keys) -> tuple[str, ...]:
        keys = tuple(keys or ())
        unknown = [k for k in keys if k not in self.module.heads]
        if unknown:
            available = ", ".join(sorted(self.module.heads)) or "none configured"
            raise ValueError(f"unknown head(s) {unknown} for LLM {self.llm.name!r}; available: {available} "
                             f"(llms.{self.llm.name}.heads)")
        return keys

    def needs_for(self, keys) -> Needs:
        """What the heads ``keys`` read (nothing beyond summed scores when they read nothing): the union of their
        declarations. Per-token outputs are kept when a head is token-level or reads per-token values."""
        return needs_of([type(self.module.heads[k]) for k in keys])

    def active_adapter(self) -> str | None:
        """The LoRA adapter a request that names none runs with (None without adapters)."""
        active = getattr(self.model, "active_adapter", None) if self.adapters else None
        return active if isinstance(active, str) or active is None else str(active)

    def check_adapter(self, name: str | None) -> None:
        known = [*self.run_time.snapshots, *self.run_time.weight_snapshots]
        if name is not None and name not in self.adapters and name not in known:
            snapshots = f"; snapshots: {', '.join(sorted(known))}" if known else ""
            raise ValueError(f"unknown peft_adapter {name!r} for LLM {self.llm.name!r}; adapters: "
                             f"{', '.join(self.adapters) or 'none (configure the lora initializer)'}{snapshots}")

    @contextlib.contextmanager
    def adapter(self, name: str | None):
        """Run with the named LoRA adapter active (requires_grad flags are left as they were), or with the weights
        of the named weight snapshot in place of the trained ones (their tensors swapped in, then back). Under
        ZeRO-3 a weight snapshot must be put in place before the weights are gathered for a call (a read gathers
        from the partitions in place when it starts): callers that gather enter this first, and the read inside,
        naming the same snapshot, keeps it."""
        if name is None:
            yield
            return
        self.check_adapter(name)
        if name in self.run_time.weight_snapshots:
            from llmrl.engine.model.partitioned_snapshots import swapped_in
            from llmrl.engine.model.zero3_state import release_all

            if self.run_time.swapped_in == name:  # an outer read put them in place (under ZeRO-3: before the gather)
                yield
                return
            frozen = self.run_time.weight_snapshots[name]
            with swapped_in({n: p for n, p in self.module.named_parameters() if n in frozen}, frozen,
                            lambda: release_all(self.engine)):
                self.run_time.swapped_in = name
                try:
                    yield
                finally:
                    self.run_time.swapped_in = None
            return
        peft_model = self.model
        previous = peft_model.active_adapter
        flags = [(p, p.requires_grad) for p in peft_model.parameters()]
        peft_model.set_adapter(name)
        for p, flag in flags:
            p.requires_grad_(flag)
        try:
            yield
        finally:
            peft_model.set_adapter(previous)
            for p, flag in flags:
                p.requires_grad_(flag)
