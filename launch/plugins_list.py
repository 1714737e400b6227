"""``llmrl plugins``: the installed plugins (name, group, providing package), without importing them; ``llmrl plugins
--args NAME``: the arguments one plugin takes, from its ``args_schema`` and its constructor (which it imports).

It reads what plugins declare; it checks no config (``llmrl validate`` does)."""

from __future__ import annotations

import argparse
import inspect
import sys

KINDS = {"llmrl.heads": "head", "llmrl.initializers": "initializer", "llmrl.updaters": "updater"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--args", metavar="NAME", default=None,
                        help="print the arguments plugin NAME takes: type, allowed values and default")


def main(args: argparse.Namespace) -> int:
    from llmrl.plugins.registry import installed_plugins

    rows = installed_plugins()
    if args.args is not None:
        return print_arguments(args.args, rows)
    if not rows:
        print("no llmrl plugins are installed")
        return 0
    _print_table(("name", "group", "package", "target"), [[r[h] for h in ("name", "group", "package", "target")]
                                                          for r in rows])
    return 0


def print_arguments(name: str, rows: list[dict]) -> int:
    """The argument table of every installed plugin called ``name`` (a head and an updater may share a name)."""
    from llmrl.plugins.registry import resolve

    found = [r for r in rows if r["name"] == name and r["group"] in KINDS]
    if not found:
        names = sorted({r["name"] for r in rows})
        print(f"llmrl plugins: no installed plugin is named {name!r}; installed: {', '.join(names)}", file=sys.stderr)
        return 2
    for k, row in enumerate(found):
        kind = KINDS[row["group"]]
        cls = resolve(kind, name)
        print(("\n" if k else "") + f"{kind} {name!r} ({row['target']}), its args:")
        table = argument_rows(cls, kind)
        if table:
            _print_table(("argument", "type", "allowed", "default"), table)
        else:
            print("  (none)")
    return 0


def argument_rows(cls, kind: str) -> list[list[str]]:
    """``[argument, type, allowed values, default]`` per argument: the constructor's parameters (a head's ``llm``, given
    by the engine, left out) with what its ``args_schema`` declares for each; "required" where there is no default."""
    schema = (getattr(cls, "args_schema", None) or {}).get("properties", {})
    try:
        params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not (kind == "head" and p.name == "llm")]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params] + [n for n in schema if n not in {p.name for p in params}]
    defaults = {p.name: ("required" if p.default is p.empty else repr(p.default)) for p in params}
    for base in cls.__mro__[1:]:  # arguments passed on through **kwargs: their default is the base class's
        if "__init__" in vars(base):
            for p in list(inspect.signature(base.__init__).parameters.values())[1:]:
                if p.name in schema and p.name not in defaults and p.default is not p.empty:
                    defaults[p.name] = repr(p.default)
    return [[n, _type_of(schema.get(n, {})), _allowed(schema.get(n, {})), defaults.get(n, "")] for n in names]


def _type_of(spec: dict) -> str:
    if "enum" in spec:
        return "one of"
    kinds = spec.get("type", "")
    return " or ".join(kinds) if isinstance(kinds, list) else kinds or ("any of" if "anyOf" in spec else "")


def _allowed(spec: dict) -> str:
    if "enum" in spec:
        return ", ".join(map(repr, spec["enum"]))
    bounds = [(">=", "minimum"), (">", "exclusiveMinimum"), ("<=", "maximum"), ("<", "exclusiveMaximum")]
    return ", ".join(f"{sign} {spec[key]}" for sign, key in bounds if key in spec)


def _print_table(header, rows) -> None:
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
