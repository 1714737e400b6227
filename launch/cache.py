"""``llmrl cache``: list the model cache (size and state of each folder); ``llmrl cache clear [NAME]`` empties it.

States: ``ok`` (a verified model), ``broken`` (ours but unusable, or moved aside by a repair), ``partial``
(a preparation in progress, or one that crashed), ``foreign`` (not made by llmrl). ``clear`` removes
only llmrl's own folders, never foreign ones. This verb loads no model and starts nothing; the cache
logic is in :mod:`llmrl.engine.model.store.folders`.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("list", "clear"), default="list",
                        help="list (default) or clear (remove llmrl's own folders; foreign ones stay)")
    parser.add_argument("name", nargs="?",
                        help="with clear: only this builtin model (its entry and moved-aside copies) or this folder")


def human_size(size: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def main(args: argparse.Namespace) -> int:
    from llmrl.engine.model.store import folders
    from llmrl.engine.model.store.builtin_models import BUILTIN_MODELS

    root = folders.models_dir()
    if args.action == "list":
        if args.name:
            print("llmrl cache: NAME is for `llmrl cache clear NAME`", file=sys.stderr)
            return 2
        items = folders.list_cache(BUILTIN_MODELS)
        print(f"model cache: {root} (set LLMRL_CACHE to move it)")
        if not items:
            print("  (empty)")
            return 0
        width = max(len(i.path.name) for i in items)
        for item in items:
            detail = f" ({item.reason})" if item.reason else ""
            print(f"  {item.path.name:<{width}}  {human_size(item.size):>9}  {item.state}{detail}")
        files = sum(1 for i in items if not i.path.is_dir())
        counted = f"{len(items) - files} folder(s)" + (f" and {files} file(s)" if files else "")
        print(f"total {human_size(sum(i.size for i in items))} in {counted}")
        return 0
    try:
        removed, kept = folders.clear_cache(BUILTIN_MODELS, args.name)
    except KeyError as err:
        print(f"llmrl cache clear: {err.args[0]}", file=sys.stderr)
        return 2
    for item in removed:
        print(f"removed {item.path} ({human_size(item.size)}, {item.state})")
    for item in kept:
        print(f"kept {item.path}: not made by llmrl, so never removed (delete it yourself if you want it gone)")
    if not removed and not kept:
        print(f"nothing to clear in {root}")
    return 0
