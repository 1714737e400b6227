"""Griffe extension (mkdocs.yml's mkdocstrings ``extensions``): a Caller method written as a thin delegation to one
of its parts (``@delegated(Part.method)``, :mod:`llmrl.engine.client.call_context`) shows the part's docstring.

Griffe reads the source without running it, so the docstring that ``delegated`` gives the Caller method when the
class is defined is not in what it read: this extension copies the part method's docstring (which griffe did read)
onto the Caller method. It changes nothing else, and nothing in the package.
"""

from __future__ import annotations

from typing import Any

import griffe

CALLER = "llmrl.engine.client.caller.Caller"


class DelegatedDocstrings(griffe.Extension):
    """Copies each ``@delegated(Part.method)`` target's docstring onto the Caller method without one."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.path != CALLER.split(".")[0]:
            return
        caller = loader.modules_collection[CALLER]
        for member in caller.members.values():
            if member.is_alias or not member.is_function or member.docstring is not None:
                continue
            for decorator in member.decorators:
                value = decorator.value
                if isinstance(value, griffe.ExprCall) and str(value.function) == "delegated" and value.arguments:
                    target = loader.modules_collection[value.arguments[0].canonical_path]
                    if target.docstring is not None:
                        member.docstring = griffe.Docstring(
                            target.docstring.value, lineno=target.docstring.lineno,
                            endlineno=target.docstring.endlineno, parent=member, parser=target.docstring.parser,
                            parser_options=target.docstring.parser_options)
