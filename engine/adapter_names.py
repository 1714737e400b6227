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


def one_adapter_or_rows(adapters):
    """A ``generate`` request's ``peft_adapter``: None or one name as given; a list of names, one per prompt, as that
    name when every prompt names the same one (the single-adapter path, merged weights and all); an empty list
    (no prompts) as None."""
    if isinstance(adapters, list) and all(name == adapters[0] for name in adapters):
        return adapters[0] if adapters else None
    return adapters
