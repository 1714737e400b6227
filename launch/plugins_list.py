"""``llmrl plugins``: the installed plugins (name, group, providing package), without importing them."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    from llmrl.plugins.registry import installed_plugins

    rows = installed_plugins()
    if not rows:
        print("no llmrl plugins are installed")
        return 0
    header = ("name", "group", "package", "target")
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in header]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(row[h].ljust(w) for h, w in zip(header, widths)))
    return 0
