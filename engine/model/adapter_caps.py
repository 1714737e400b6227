"""The caps on what adapters created at run time and snapshots may hold of an LLM: their count
(``llms.<name>.max_run_time_adapters``) and their weights' bytes (``llms.<name>.run_time_adapters_mb``), counted
together (config-declared adapters are not). Each one made past a cap is refused, naming it, the cap and what frees
a place; without caps each new adapter made every later one slower (PEFT walks every adapter of every layer).

This module counts and refuses; it makes and drops nothing (:mod:`llmrl.engine.model.snapshots`,
:mod:`llmrl.engine.model.training.new_adapters` do, and ask it first).
"""

from __future__ import annotations

from llmrl.engine.model.served import ServedModel

MB = 1 << 20


def held(served: ServedModel) -> tuple[list[str], int]:
    """The adapters created at run time and the snapshots ``served`` holds, and their weights' bytes."""
    names = [*served.run_time.created, *served.run_time.snapshots, *served.run_time.weight_snapshots]
    lora = set(served.run_time.created) | set(served.run_time.snapshots)
    size = sum(p.numel() * p.element_size() for name, p in served.model.named_parameters() if _owner(name) in lora)
    copies = served.run_time.weight_snapshots.values()
    size += sum(p.numel() * p.element_size() for weights in copies for p in weights.values())
    return names, size


def check_room(served: ServedModel, what: str, name: str, size: int | None = None) -> None:
    """Refuse ``what`` ``name`` (an adapter or a snapshot to make, of ``size`` bytes; None: only its count is
    checked, before its size is known) when it would pass one of the LLM's caps."""
    llm = served.llm
    names, total = held(served)
    free = "delete_adapter / drop_snapshot one no longer read"
    if size is None and len(names) >= llm.max_run_time_adapters:
        raise ValueError(f"{what} {name!r} is refused: LLM {llm.name!r} holds {len(names)} adapters created at run "
                         f"time and snapshots ({_listed(names)}), its cap (llms.{llm.name}.max_run_time_adapters: "
                         f"{llm.max_run_time_adapters}): {free}, or raise the cap in the config")
    if size is not None and total + size > llm.run_time_adapters_mb * MB:
        raise ValueError(f"{what} {name!r} ({size / MB:.1f} MB) is refused: with it, the adapters created at run "
                         f"time and snapshots of LLM {llm.name!r} would hold {(total + size) / MB:.1f} MB, over "
                         f"its cap (llms.{llm.name}.run_time_adapters_mb: {llm.run_time_adapters_mb:g}): {free} "
                         f"({_listed(names)}), or raise the cap in the config")


def _owner(parameter: str) -> str | None:
    """The adapter a LoRA parameter belongs to (PEFT names them ``...lora_A.<adapter>.weight``), else None."""
    parts = parameter.split(".")
    return next((parts[k] for k in range(1, len(parts)) if parts[k - 1].startswith("lora_")), None)


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "") or "none"
