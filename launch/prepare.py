"""Before any process group exists: the config's ``builtin:`` models, converted, verified and installed in the cache.

``llmrl run`` prepares every one of them before it starts the launcher. A plain ``deepspeed ... --module
llmrl.launch`` launch has no such step: there local rank 0 of each node prepares them while the node's other
ranks wait for the entries to appear (at most ``timeouts.startup``). If local rank 0 fails it exits non-zero
and the DeepSpeed launcher stops the waiting ranks; the deadline covers launchers that do not.

This module decides when and where models are prepared; :mod:`llmrl.engine.model.store.builtin_models` prepares them.
"""

from __future__ import annotations


def prepare_builtin_models(config, rank: int | None = None, local_rank: int = 0) -> str | None:
    """Make the config's builtin models ready on this node; an error message, or None. ``rank`` is None for
    ``llmrl run`` itself (which prepares them all), else this rank's global rank."""
    from llmrl.engine.model.store import builtin_models
    from llmrl.engine.model.store.folders import CacheError

    names = builtin_models.builtin_names(config)
    if not names:
        return None
    try:
        if local_rank == 0:
            for name in names:
                builtin_models.prepare_builtin(name)
        else:
            builtin_models.wait_until_ready(names, config.timeouts.startup)
    except Exception as err:  # noqa: BLE001 - reported in one line; nothing was launched, or the launcher stops the run
        detail = str(err) if isinstance(err, (CacheError, TimeoutError)) else f"{type(err).__name__}: {err}"
        who = "" if rank is None else f"rank {rank}: "
        return f"{who}preparing builtin:{' builtin:'.join(names)} failed: {detail}"
    return None
