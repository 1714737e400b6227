"""The model cache on disk (``$LLMRL_CACHE/models``, default ``~/.cache/llmrl``): where entries live, how a folder is
judged (``ok``, ``broken``, ``partial``, ``foreign``) without loading a model, and what ``llmrl cache`` lists
and clears.

A folder is ours when it holds the :data:`MARKER` file (which records every file's size), or, for entries
written by older llmrl versions, when it sits at ``models/NAME`` and holds nothing but the files Hugging Face
writes; everything else is foreign and never touched. Broken entries of ours are moved aside
(``NAME.broken-TIME-XXXX``), never deleted, except by ``llmrl cache clear``.

This module knows no model: the builtin names are given to it (:mod:`llmrl.engine.model.store.builtin_models` owns
them and prepares the entries).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = ".llmrl-cache-entry.json"


# Everything Hugging Face's save_pretrained writes for a causal LM and its tokenizer: a folder at
# models/NAME holding only these (and no marker) was written by an older llmrl, so it is ours.
_HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model"}


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


_STAGING = re.compile(r"\.(?P<name>.+)\.staging-(?P<pid>\d+)@(?P<host>.+)-[^-]+")


_OLD_STAGING = re.compile(r"\.(?P<name>.+)-[a-z0-9_]{8}")  # staging folders of older llmrl versions


_BROKEN = re.compile(r"(?P<name>.+)\.broken-[0-9]{8}-[0-9]{6}-[0-9a-f]+")


class CacheError(RuntimeError):
    """A builtin model that could not be prepared, or a cache folder llmrl will not touch."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRL_CACHE") or Path.home() / ".cache" / "llmrl").expanduser()


def models_dir() -> Path:
    return cache_dir() / "models"


def inspect_folder(path: Path, name: str) -> tuple[str, str]:
    """``(state, reason)`` of the cache folder of builtin ``name``, cheaply (no model is loaded).

    state is ``missing``, ``ok``, ``broken`` (ours, but not a loadable model: reason says why) or
    ``foreign`` (not made by llmrl: never touched). Reads file sizes and safetensors headers only.
    """
    try:
        return _inspect(path)
    except FileNotFoundError:  # moved aside or replaced while being read (another process repairs the entry)
        return "missing", ""


def _inspect(path: Path) -> tuple[str, str]:
    if not path.exists() and not path.is_symlink():
        return "missing", ""
    if path.is_symlink() or not path.is_dir():
        return "foreign", "not a folder"
    marker = path / MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return "broken", f"unreadable {MARKER}"
        problem = folder_problem(path, recorded)
        return ("broken", problem) if problem else ("ok", "")
    names = sorted(os.listdir(path))
    unexpected = [n for n in names if not (path / n).is_file() or not (n in _HF_FILES or _SHARD.fullmatch(n))]
    if unexpected:
        return "foreign", f"holds {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}, no {MARKER}"
    problem = folder_problem(path)
    return ("broken", problem) if problem else ("ok", "written by an older llmrl")


def folder_problem(path: Path, recorded: dict[str, int] | None = None) -> str | None:
    """What keeps ``path`` from being a complete model folder, or None: config, weights, tokenizer, sizes."""
    config = path / "config.json"
    if not config.is_file():
        return "no config.json"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError):
        return "config.json is not valid JSON"
    weights = _weight_files(path)
    if isinstance(weights, str):
        return weights
    for file in weights:
        problem = _safetensors_problem(file)
        if problem:
            return problem
    if not (path / "tokenizer_config.json").is_file() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return "no tokenizer files (tokenizer_config.json and tokenizer.json)"
    for rel, size in (recorded or {}).items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, {size} when it was installed"
    return None


def _weight_files(path: Path) -> list[Path] | str:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return "no weights (no model.safetensors)"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return "model.safetensors.index.json is unreadable"
    missing = [s for s in shards if not (path / s).is_file()]
    if missing or not shards:
        return f"weight shard {missing[0] if missing else '(none listed)'} is missing"
    return [path / s for s in shards]


def _safetensors_problem(file: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then exactly the tensors' bytes."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return f"{file.name} is truncated"
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError):
        return f"{file.name} is not a readable safetensors file"
    if not end:
        return f"{file.name} holds no tensors"
    if 8 + length + end != size:
        return f"{file.name} has {size} bytes, its header describes {8 + length + end}"
    return None


def move_aside(target: Path, name: str, reason: str) -> None:
    aside = target.with_name(f"{name}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return  # another process moved it first
    if inspect_folder(aside, name)[0] == "ok":
        # Between our check and the rename another process installed a good entry: put it back.
        try:
            os.rename(aside, target)
            return
        except OSError:
            pass
    print(f"llmrl: the cached builtin:{name} was unusable ({reason}); moved it to {aside} and rebuilding it",
          file=sys.stderr, flush=True)


def remove_dead_staging(parent: Path) -> None:
    """Remove staging folders left on this host by processes that no longer exist (a crashed conversion)."""
    host = socket.gethostname()
    for path in parent.glob(".*.staging-*"):
        match = _STAGING.fullmatch(path.name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class CacheItem:
    """One folder in the cache: its builtin name (or ''), what it is, its size, its state and why."""

    path: Path
    name: str
    kind: str  # "entry", "moved aside", "staging", "other"
    state: str  # "ok", "broken", "partial", "foreign"
    reason: str
    size: int

    @property
    def ours(self) -> bool:
        return self.state != "foreign"


def list_cache(known) -> list[CacheItem]:
    """Every folder under ``models/`` of the cache, classified against the ``known`` builtin names (nothing is
    loaded or changed)."""
    root = models_dir()
    if not root.is_dir():
        return []
    items = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        if path.is_file() and path.suffix == ".lock":
            continue  # lock files of older llmrl versions: removed by clear_cache
        items.append(_classify(path, known))
    return items


def _classify(path: Path, known) -> CacheItem:
    size = _size(path)
    if path.name in known:
        state, reason = inspect_folder(path, path.name)
        return CacheItem(path, path.name, "entry", state, reason, size)
    staging, broken = _STAGING.fullmatch(path.name), _BROKEN.fullmatch(path.name)
    if staging and staging["name"] in known and path.is_dir() and not path.is_symlink():
        return CacheItem(path, staging["name"], "staging", "partial", "an unfinished preparation (running, or crashed)",
                         size)
    old = _OLD_STAGING.fullmatch(path.name)
    if old and old["name"] in known and inspect_folder(path, old["name"])[0] != "foreign":
        return CacheItem(path, old["name"], "staging", "partial", "left by an older llmrl's unfinished conversion",
                         size)
    if broken and broken["name"] in known:
        state, reason = inspect_folder(path, broken["name"])
        if state != "foreign":
            return CacheItem(path, broken["name"], "moved aside", "broken", f"moved aside: {reason or 'was unusable'}",
                             size)
    return CacheItem(path, "", "other", "foreign", "not made by llmrl; never touched", size)


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for file in files:
            try:
                total += os.lstat(os.path.join(root, file)).st_size
            except OSError:
                pass
    return total


def clear_cache(known, name: str | None = None) -> tuple[list[CacheItem], list[CacheItem]]:
    """Remove llmrl's own cache folders (all, or those of builtin ``name`` / the folder named ``name``).

    Returns ``(removed, kept)``: foreign folders are never removed. Raises KeyError for a ``name`` that
    matches nothing. Do not clear while a run is preparing or loading from the cache.
    """
    items = list_cache(known)
    if name is not None:
        items = [i for i in items if name in (i.name, i.path.name)]
        if not items:
            raise KeyError(f"nothing named {name!r} in {models_dir()}; `llmrl cache` lists what is there")
    removed, kept = [], []
    for item in items:
        if not item.ours:
            kept.append(item)
            continue
        shutil.rmtree(item.path)
        removed.append(item)
    root = models_dir()
    for builtin in ([name] if name in known else [] if name else list(known)):
        lock = root / f".{builtin}.lock"
        if lock.is_file() and lock.stat().st_size == 0:
            lock.unlink()
    return removed, kept
