"""``Caller.save``: write a checkpoint of every LLM atomically.

The servers write into a staging folder next to the target (the ``save`` request kind); only when every
rank has finished does the client write the manifest and swap the staging folder into place with renames.
An interrupted save never leaves a half checkpoint where a good one was: until the new one is complete,
the target (or, for the instant between the two renames, its backup) holds the previous one. On
multi-node runs the target must be on a filesystem every node sees.

This module handles folders; what goes in them is :mod:`llmrl.engine.model.checkpoint`'s.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from llmrl.engine.checkpoint_layout import MANIFEST, fsync_dir, write_json
from llmrl.engine.requests import save


def save_run(run, wait, path: str) -> str:
    """Write a checkpoint of every LLM of ``run`` to ``path`` atomically; ``wait(future)`` waits for the servers.
    Returns the absolute path."""
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that was interrupted
    staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        wait(save.send(run, str(staging)))
        config = run.config
        manifest = {"llms": list(config.llms), "time": time.time(), "format": 1,
                    "layout": {name: {"replicas": llm.replicas, "tensor_parallel": llm.tensor_parallel,
                                      "zero_stage": llm.training.zero_stage}
                               for name, llm in config.llms.items()}}
        write_json(staging / MANIFEST, manifest)
        fsync_dir(staging)
        backup = None
        if target.exists():
            backup = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, backup)
        os.rename(staging, target)
        fsync_dir(target.parent)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(target)
