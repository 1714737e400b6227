"""The request kinds, one module each: what a rank receives, how the client splits and assembles it, how a
server rank handles it. :data:`KINDS` is the one place a kind is named, and the server's dispatch table.

Adding a kind: one module here declaring it whole in its ``KIND`` (:class:`~llmrl.engine.requests.base.Kind`: the
payload dataclass, ``send``, ``handle``, the backend method ``handle`` calls with plain arguments, the Caller
methods that call ``send``), and its name in :data:`KINDS`. The Caller methods it names (and a backend method, if
it needs a new one) are written where they live; ``tests/test_request_kinds.py`` checks the declaration against
them. The kinds do not move bytes (:mod:`llmrl.engine.client.links` and :mod:`llmrl.engine.transport` do) and do
not compute (the backend does).
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
