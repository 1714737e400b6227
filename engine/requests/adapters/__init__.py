"""The adapter request kinds, one module each (named in :data:`llmrl.engine.requests.KINDS` like every kind):
``snapshot`` and ``drop_snapshot`` (frozen copies of an adapter's weights), ``create_adapter`` and
``delete_adapter`` (adapters made while the run goes on), ``save_adapter`` and ``load_adapter`` (one adapter's
state in a folder); :mod:`~llmrl.engine.requests.adapters.checks` holds the checks they share.

Each goes to every rank of the LLM and calls one backend method of its own name. This package re-exports the
checks; it declares no kind itself.
"""

from llmrl.engine.requests.adapters.checks import check_create_args, check_name, check_new_name

__all__ = ["check_create_args", "check_name", "check_new_name"]
