"""llmrl's rule for the name of a LoRA adapter or snapshot, checked by the client before a request is sent and by
the servers before PEFT sees the name.

A name must be an identifier (letters, digits and ``_``, not starting with a digit) that PEFT takes as an
ordinary key:

- not a part of PEFT's prefix ``lora_`` (``a``, ``r``, ``lo``, ``ora_``, ...): PEFT warns that such an adapter's
  weights "may be reinitialised" when loaded; nor starting with ``lora_``, the prefix of PEFT's own containers
  (``lora_A``, ``lora_B``), which an adapter's weights are found by;
- not an attribute of the torch containers PEFT keeps each layer's adapters in (``torch.nn.ModuleDict`` and
  ``ParameterDict``: ``update``, ``keys``, ``to``, ``train``, ...), which refuse such a key with a raw KeyError.

Also the rule for a request that names one adapter per prompt (:func:`one_adapter_or_rows`), shared by the client
and the servers.

This module states the rules; it looks up no adapter and imports torch only to read those containers' attributes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

PEFT_PREFIX = "lora_"


def name_problem(name) -> str | None:
    """Why ``name`` cannot name an adapter or snapshot (the rule it breaks, with a hint), or None."""
    if not isinstance(name, str) or not name.isidentifier():
        return "must be an identifier (letters, digits and _, not starting with a digit)"
    if name in PEFT_PREFIX or name.startswith(PEFT_PREFIX):
        return (f"must not be a part of PEFT's prefix {PEFT_PREFIX!r} nor start with it (PEFT would take such an "
                f"adapter's weights for its own on loading): pick another, such as {_instead(name)!r}")
    if name in container_attributes():
        return (f"must not be an attribute of the torch containers PEFT keeps adapters in (torch.nn.ModuleDict, "
                f"ParameterDict: {name!r} is one of them): pick another, such as {_instead(name)!r}")
    return None


def _instead(name: str) -> str:
    return f"my_{name.removeprefix(PEFT_PREFIX) or 'adapter'}"


@functools.cache
def container_attributes() -> frozenset[str]:
    """The names a ``torch.nn.ModuleDict`` or ``ParameterDict`` refuses as keys (its attributes)."""
    import torch

    return frozenset(dir(torch.nn.ModuleDict())) | frozenset(dir(torch.nn.ParameterDict()))


@dataclass(frozen=True)
class ContextAdapters:
    """A training or scoring pass whose sequences name their own adapters: ``names``, one per sequence of one
    replica's share (None: a throw-away sequence, run on the base weights), and ``call``, every adapter of the whole
    call in one order, the same on every replica (:mod:`llmrl.engine.model.token_adapters` runs them)."""

    names: list
    call: tuple[str, ...]


def one_adapter_or_rows(adapters):
    """A ``generate`` request's ``peft_adapter``: None or one name as given; a list of names, one per prompt, as that
    name when every prompt names the same one (the single-adapter path, merged weights and all); an empty list
    (no prompts) as None."""
    if isinstance(adapters, list) and all(name == adapters[0] for name in adapters):
        return adapters[0] if adapters else None
    return adapters


def check_adapters(adapters, contexts: int, what: str = "context"):
    """``peft_adapter`` as given (None, or one adapter's name for every context), or checked as a list of one name per
    context (a request's prompts or sequences then run in batches that mix adapters: multi-LoRA batching). ``what``
    the request calls a context in its messages (``datum`` for token-level data)."""
    from llmrl.engine.errors import InvalidArgument, InvalidArgumentType

    if adapters is None or isinstance(adapters, str):
        return adapters
    if not isinstance(adapters, (list, tuple)):
        raise InvalidArgumentType(f"peft_adapter must be an adapter's name, a list of one name per {what}, or "
                                  f"None; got {type(adapters).__name__}")
    if len(adapters) != contexts:
        raise InvalidArgument(f"peft_adapter lists {len(adapters)} adapter name(s) for {contexts} {what}(s): give "
                              f"one name per {what}, in the order of the {what}s")
    bad = next((i for i, name in enumerate(adapters) if not isinstance(name, str)), None)
    if bad is not None:
        raise InvalidArgumentType(f"peft_adapter[{bad}] must be an adapter's name (a string), got "
                                  f"{type(adapters[bad]).__name__}")
    return list(adapters)
