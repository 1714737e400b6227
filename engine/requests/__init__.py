"""The request kinds, one module each: what a rank receives, how the client splits and assembles it, how a
server rank handles it. :data:`KINDS` is the server's dispatch table.

Adding a kind: a module here (payload dataclass, ``send``, ``handle``, ``KIND``), a line in :data:`KINDS`, and a
Caller method that calls its ``send``. The kinds do not move bytes (:mod:`llmrl.engine.client.links` and
:mod:`llmrl.engine.transport` do) and do not compute (the backend does).
"""

from __future__ import annotations

from llmrl.engine.requests import (
    adapters,
    admin,
    forward_backward,
    generate,
    optim_step,
    save,
    score,
    state_dict,
    tokenize,
    update,
)
from llmrl.engine.requests.base import Kind

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    *admin.KINDS,
    score.KIND,
    generate.KIND,
    update.KIND,
    forward_backward.KIND,
    optim_step.KIND,
    adapters.KIND,
    save.KIND,
    state_dict.KIND,
    tokenize.KIND,
)}
