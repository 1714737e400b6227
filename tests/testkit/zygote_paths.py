"""The ``sys.path`` of a process the fork server (:mod:`testkit.zygote`) forks for a request whose ``PYTHONPATH``
differs from the server's, and whether it may fork it at all.

A fresh ``python -m`` puts its working folder first on ``sys.path``, then the folders it derives from
``PYTHONPATH`` (each made absolute against the working folder, an empty entry meaning the working folder itself,
normalised, duplicates dropped: :func:`entries`), then the interpreter's own (the standard library, site-packages).
A forked process gets that same path: the server's ``PYTHONPATH`` folders replaced by the request's
(:meth:`ServerPath.for_request`).

That is only what a fresh process would have if every module the server already imported would come from the same
place in it: :meth:`ServerPath.why_not` refuses a request where a top-level module the server imported (a name of
``sys.modules``) is held (as ``NAME.py``, ``NAME/``, bytecode or an extension module) by a different list of
``PYTHONPATH`` folders than the server's (a new folder that could shadow it, one that is gone, or another order),
or whose ``PYTHONPATH`` names a folder that is on the interpreter's own path anyway (where a fresh interpreter would
have dropped the later copy). Such a request is started afresh.

Test code, never shipped.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_SUFFIXES = tuple(sorted({*importlib.machinery.SOURCE_SUFFIXES, *importlib.machinery.BYTECODE_SUFFIXES,
                          *importlib.machinery.EXTENSION_SUFFIXES}, key=len, reverse=True))


def entries(pythonpath: str | None, cwd: str) -> list[str]:
    """The ``sys.path`` folders a fresh interpreter started in ``cwd`` derives from ``pythonpath``, in order."""
    out: list[str] = []
    for entry in pythonpath.split(os.pathsep) if pythonpath else []:  # an empty PYTHONPATH is none at all
        folder = os.path.normpath(os.path.join(cwd, entry))  # "" is the working folder itself
        if folder not in out:
            out.append(folder)
    return out


def held(folder: str) -> set[str]:
    """The top-level module names an import from ``folder`` could find there."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    out = set()
    for name in names:
        if os.path.isdir(os.path.join(folder, name)):
            out.add(name)  # a package, or a portion of a namespace package
            continue
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            out.add(name[:-len(suffix)])
    return {name for name in out if name.isidentifier()}


class ServerPath:
    """The fork server's ``sys.path`` as its interpreter started (before it imported anything), made of its working
    folder (unless ``-P``), its ``PYTHONPATH`` folders and the interpreter's own."""

    def __init__(self, pythonpath: str | None, cwd: str):
        self.head = 0 if sys.flags.safe_path else 1
        self.entries = entries(pythonpath, cwd)
        self._start = list(sys.path)

    def _rest(self) -> list[str] | None:
        """The path after the ``PYTHONPATH`` folders now (with what importing the preloaded modules appended), or
        None if it no longer starts as it started."""
        end = self.head + len(self.entries)
        if sys.path[:end] != self._start[:end] or self._start[self.head:end] != self.entries:
            return None
        return sys.path[end:]

    def why_not(self, pythonpath: str | None, cwd: str) -> str | None:
        """Why a process with ``PYTHONPATH=pythonpath`` started in ``cwd`` cannot be forked from the server, or
        None."""
        theirs = entries(pythonpath, cwd)
        if theirs == self.entries:
            return None
        rest = self._rest()
        if rest is None:
            return "PYTHONPATH: the server's sys.path is not the one its PYTHONPATH gives"
        if own := [folder for folder in theirs if folder in rest]:
            return f"PYTHONPATH: {own[0]} is on the interpreter's own path"
        holding = {folder: held(folder) for folder in {*self.entries, *theirs}}
        imported = sorted({name.partition(".")[0] for name in list(sys.modules)} - {"__main__"})
        for name in imported:
            before = [folder for folder in self.entries if name in holding[folder]]
            after = [folder for folder in theirs if name in holding[folder]]
            if before == after:
                continue
            if new := [folder for folder in after if folder not in before]:
                return f"PYTHONPATH: {new[0]} holds {name}, which the server imported already"
            if gone := [folder for folder in before if folder not in after]:
                return f"PYTHONPATH: {gone[0]} held {name}, which the server imported from its PYTHONPATH"
            return f"PYTHONPATH: {', '.join(after)} hold {name} (imported by the server) in another order"
        return None

    def for_request(self, pythonpath: str | None, cwd: str) -> list[str]:
        """The ``sys.path`` of a process forked for ``PYTHONPATH=pythonpath`` in ``cwd`` (one :meth:`why_not`
        accepts): what a fresh ``python -m`` started there has, with what the preloaded imports appended."""
        head = [cwd] if self.head else []
        rest = self._rest()
        if rest is None:  # the server's own PYTHONPATH folders (why_not refuses any other): where they are now
            return [*head, *sys.path[self.head:]]
        return [*head, *entries(pythonpath, cwd), *rest]
