"""The request kinds, one module each: what a rank receives, how the client splits and assembles it, how a
server rank handles it. :data:`KINDS` is the one place a kind is named, and the server's dispatch table.

Adding a kind takes one new module and one line:

1. ``engine/requests/<name>.py`` declares the kind whole: its payload dataclass (what one rank receives), ``send``
   (the client half: check, split across replicas, assemble the replies into what the Caller returns),
   ``handle`` (the server half: ``replica.backend.<method>(request)``, the payload handed on as it came) and
   ``KIND = Kind(name=..., payload=..., send=..., handle=..., backend_method=..., caller_methods=...)``
   (:class:`~llmrl.engine.requests.base.Kind`). Copy a small one: :mod:`~llmrl.engine.requests.save`, or
   :mod:`~llmrl.engine.requests.adapters.drop_snapshot`.
2. Its ``KIND`` goes in :data:`KINDS` below.

The Caller methods it names and its backend method are written where they live: the method on
:class:`~llmrl.engine.model.backend.ModelBackend` takes the payload as its one argument, ``request``, annotated
with the payload's type, and :class:`~llmrl.engine.model.hf_backend.HFBackend` implements it. Then name the new
module in the layout of ``docs/explanation/architecture.md``. ``tests/test_request_kinds.py`` checks every
declaration against the code (the Caller methods reach ``send``; ``handle`` calls the one backend method, with the
payload; the backend method takes that payload type). The kinds do not move bytes
(:mod:`llmrl.engine.client.links` and :mod:`llmrl.engine.transport` do) and do not compute (the backend does).
"""

from __future__ import annotations

from llmrl.engine.requests import (
    admin,
    forward_backward,
    generate,
    optim_step,
    read_weights,
    save,
    score,
    state_dict,
    tokenize,
    update,
    write_weights,
)
from llmrl.engine.requests.adapters import (
    create_adapter,
    delete_adapter,
    drop_snapshot,
    load_adapter,
    save_adapter,
    snapshot,
)
from llmrl.engine.requests.base import Kind

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    *admin.KINDS,
    score.KIND,
    generate.KIND,
    update.KIND,
    forward_backward.KIND,
    optim_step.KIND,
    snapshot.KIND,
    drop_snapshot.KIND,
    create_adapter.KIND,
    delete_adapter.KIND,
    save_adapter.KIND,
    load_adapter.KIND,
    save.KIND,
    state_dict.KIND,
    read_weights.KIND,
    write_weights.KIND,
    tokenize.KIND,
)}
