"""``llmrl env``: the versions and accelerator that matter in a bug report. It reports only; it changes nothing."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def report() -> dict[str, str]:
    out = {"llmrl": _version("llmrl"), "python": platform.python_version(), "platform": platform.platform()}
    for package in ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "tokenizers", "jsonschema"):
        out[package] = _version(package)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    out["cpu cores"] = str(cores)
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            out["accelerator"] = f"CUDA {torch.version.cuda}: {', '.join(names)}"
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        else:
            out["accelerator"] = "none (CPU; collectives use gloo)"
    except ImportError:
        out["accelerator"] = "unknown (torch missing)"
    return out


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(args: argparse.Namespace) -> int:
    for key, value in report().items():
        print(f"{key:>14}: {value}")
    return 0
