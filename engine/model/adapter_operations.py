"""The server half of the ``adapters`` request kind: which function applies each adapter operation
(``snapshot``, ``drop_snapshot``, ``create_adapter``, ``delete_adapter``, ``save_adapter``, ``load_adapter``).

:data:`HANDLERS` maps every known operation to its handler, and :func:`apply` looks the operation up there: an
operation that is not in the table is refused with :class:`~llmrl.engine.errors.InvalidArgument` naming the field
and the known operations, before anything changes (no operation is ever a fallback for another). This module does
not check the operation's arguments (the client does: :mod:`llmrl.engine.requests.adapters`) and does not do the
work itself (:mod:`llmrl.engine.model.snapshots`, :mod:`llmrl.engine.model.training.new_adapters`,
:mod:`llmrl.engine.model.training.adapter_state` do).
"""

from __future__ import annotations

from llmrl.engine.errors import InvalidArgument


def _snapshot(served, prefix_cache, name, args):
    from llmrl.engine.model import snapshots

    return snapshots.take_snapshot(served, name, args.get("source"), prefix_cache)


def _drop_snapshot(served, prefix_cache, name, args):
    from llmrl.engine.model import snapshots

    return snapshots.drop_snapshot(served, name, prefix_cache)


def _create_adapter(served, prefix_cache, name, args):
    from llmrl.engine.model.training import new_adapters

    return new_adapters.create_adapter(served, name, prefix_cache=prefix_cache, **args)


def _delete_adapter(served, prefix_cache, name, args):
    from llmrl.engine.model.training import new_adapters

    return new_adapters.delete_adapter(served, name, prefix_cache)


def _save_adapter(served, prefix_cache, name, args):
    from llmrl.engine.model.training import adapter_state

    return adapter_state.save_adapter(served, name, args["path"])


def _load_adapter(served, prefix_cache, name, args):
    from llmrl.engine.model.training import adapter_state

    return adapter_state.load_adapter(served, name, args["path"], args["optimizer"], prefix_cache)


HANDLERS = {
    "snapshot": _snapshot,
    "drop_snapshot": _drop_snapshot,
    "create_adapter": _create_adapter,
    "delete_adapter": _delete_adapter,
    "save_adapter": _save_adapter,
    "load_adapter": _load_adapter,
}


def unknown_operation(operation) -> InvalidArgument:
    """The error for an operation that is not in :data:`HANDLERS`."""
    return InvalidArgument(f"operation must be one of {', '.join(HANDLERS)}, got {operation!r}")


def apply(served, prefix_cache, operation: str, name: str | None, args: dict) -> dict:
    """Apply ``operation`` to the adapter or snapshot ``name`` of ``served``; an unknown operation is refused and
    changes nothing."""
    handler = HANDLERS.get(operation) if isinstance(operation, str) else None
    if handler is None:
        raise unknown_operation(operation)
    return handler(served, prefix_cache, name, args)
