"""The script's own state in a checkpoint: ``caller.save(path, client_state=...)`` writes it beside the LLMs' state,
in the same atomic save, and :meth:`~llmrl.Caller.resumed_client_state` reads it back in the run that resumes from
that checkpoint. A script keeps there what the servers do not hold: its data cursor, an
:class:`~llmrl.AsyncRollouts` buffer (:meth:`~llmrl.AsyncRollouts.state_dict`), its own counters.

The state is plain data: dicts, lists, tuples, strings, numbers, booleans, None and torch tensors, nested freely
(what ``torch.load(weights_only=True)`` reads back, so loading a checkpoint runs no code from it). The types are
checked exactly: a subclass (a namedtuple, a defaultdict, an enum, a numpy float) would be saved but not read back,
so it is refused before the save starts, as anything else is, naming where it sits (``client_state['buffer'][3]``).
The file is synced to disk before the checkpoint's manifest vouches for it.

What is not here: the folder, the staging and the manifest (:mod:`llmrl.engine.client.saving`).
"""

from __future__ import annotations

from pathlib import Path

from llmrl.engine.errors import InvalidArgument

FILE = "client_state.pt"
SCALARS = (str, int, float, bool, type(None))


def check_client_state(value, where: str = "client_state") -> None:
    """Raise InvalidArgument naming the first part of ``value`` that is not plain data (see the module)."""
    import torch

    if type(value) in SCALARS or isinstance(value, torch.Tensor):
        return
    if type(value) is dict:
        for key, item in value.items():
            if type(key) not in SCALARS:
                raise InvalidArgument(f"{where}: a key of type {type(key).__name__}; client_state keys are strings "
                                      "or numbers")
            check_client_state(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_client_state(item, f"{where}[{i}]")
        return
    raise InvalidArgument(f"{where} is a {type(value).__name__}; client_state holds plain data only (dicts, lists, "
                          "tuples, strings, ints, floats, booleans, None, torch tensors; not their subclasses): turn "
                          "it into those first, e.g. dataclasses.asdict(...), float(x), dict(d)")


def write_client_state(folder: Path, value) -> None:
    """Write ``value`` (checked already) into the checkpoint being staged in ``folder``."""
    import torch

    from llmrl.engine.files import fsync_file

    torch.save(value, folder / FILE)
    fsync_file(folder / FILE)


def read_client_state(folder: Path):
    """The client state saved in checkpoint ``folder``, or None when it holds none."""
    path = folder / FILE
    if not path.exists():
        return None
    import torch

    return torch.load(path, weights_only=True)
