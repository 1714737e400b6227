"""The policy versions one server rank keeps (see :mod:`llmrl.engine.policy_versions`): per LoRA adapter, the
optimizer steps it took; per snapshot, its source's count when it was taken; for a model without adapters (the key
None), the model's own steps.

The counts live in :attr:`RunTimeAdapters.versions` (``served.run_time.versions``). A kept optimizer step (one
that was applied and left every value finite: :func:`llmrl.engine.model.training.finite_steps.keep_finite`) counts
one for each adapter it trained, whether ``update`` or ``optim_step`` took it; every rank of the LLM takes the same
steps, so every rank holds the same counts. Taking a snapshot copies its source's count; dropping one, or deleting or
creating an adapter, forgets the name's. The counts start at 0 when the servers start; a run resumed from a
checkpoint takes the counts saved with it (:mod:`llmrl.engine.model.checkpoint`) and goes on from there, while an
adapter loaded from a file (``load_adapter``) counts again from 0.

This module counts and stamps; it takes no step and decides nothing about staleness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmrl.engine.policy_versions import check_policy_versions, staleness, staleness_stats

if TYPE_CHECKING:
    from llmrl.engine.model.served import ServedModel


def count_step(served: ServedModel, trained) -> None:
    """One kept optimizer step of the adapters ``trained`` (none, or None only: the model without adapters)."""
    for name in set(trained or ()) or {None}:
        served.run_time.versions[name] = served.run_time.versions.get(name, 0) + 1


def policy_of(served: ServedModel, adapter: str | None) -> str | None:
    """The weights a request naming ``adapter`` reads: that adapter or snapshot, else the active adapter (None for a
    model without adapters, or a model whose weights a weight snapshot freezes)."""
    return adapter if adapter is not None else served.active_adapter()


def version_of(served: ServedModel, adapter: str | None) -> int:
    """The policy version of the weights a request naming ``adapter`` reads."""
    return served.run_time.versions.get(policy_of(served, adapter), 0)


def copy_version(served: ServedModel, name: str, source: str | None) -> None:
    """A snapshot ``name`` of ``source`` (None: the trained weights of a model without LoRA) was taken."""
    served.run_time.versions[name] = served.run_time.versions.get(source, 0)


def forget_version(served: ServedModel, name: str) -> None:
    """The adapter or snapshot ``name`` is gone, or new: its count starts again."""
    served.run_time.versions.pop(name, None)


def stamped(samples: list[list[dict]], served: ServedModel, adapter: str | list[str] | None) -> list[list[dict]]:
    """``generate``'s samples, each with the ``policy_version`` and ``policy`` of the weights it was drawn from: the
    weights now, for each sample not stamped yet (one drawn before weights were written during the call was stamped
    then). ``adapter``: the call's, or a list of each prompt's."""
    for index, per_context in enumerate(samples):
        name = adapter[index] if isinstance(adapter, list) else adapter
        policy, version = policy_of(served, name), version_of(served, name)
        for sample in per_context:
            if "policy_version" not in sample:
                sample["policy_version"], sample["policy"] = version, policy
    return samples


def share_staleness(served: ServedModel, adapter: str | list[str] | None, versions) -> list[int]:
    """The staleness of each version of a training call's share against the trained weights' version now.
    ``adapter``: the call's, or a list of each sequence's."""
    if versions is None:
        return []
    if isinstance(adapter, list):
        return [s for name, v in zip(adapter, versions) for s in staleness(version_of(served, name), v)]
    return staleness(version_of(served, adapter), versions)


def update_staleness(served: ServedModel, kwargs: dict) -> dict:
    """The statistics an ``update`` adds when given ``policy_versions``: the version of the active adapter (the
    one updaters train unless they name another) before the update, and the staleness of this replica's share."""
    versions = kwargs.get("policy_versions")
    if versions is None:
        return {}
    versions = check_policy_versions(versions, len(versions), "policy_versions")
    return {"policy_version": float(version_of(served, None)),
            **staleness_stats(share_staleness(served, None, versions))}
