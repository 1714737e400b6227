"""Where and when a measurement was made: :func:`run_provenance` returns the date, the commit of the llmrl source
tree, the hardware (CPU model and cores; the GPUs when torch already sees CUDA) and the library versions, for an
example's ``summary.json`` or a benchmark's results, so that a number published from that file carries them.

It reads ``/proc/cpuinfo``, asks git for the commit when the source tree is a git checkout, and reads versions from
the installed packages' metadata. It imports no torch (it only asks a torch that is already imported about CUDA)
and measures nothing.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import subprocess
import sys

SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONED = ("llmrl", "torch", "transformers", "peft", "deepspeed")


def run_provenance() -> dict:
    """``{"date", "commit", "hardware", "versions"}``; ``commit`` is None outside a git checkout, and ends in
    ``+changes`` when the tree differs from it."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": source_commit(), "hardware": hardware(), "versions": versions()}


def source_commit(tree: str = SOURCE_TREE) -> str | None:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return commit


def hardware() -> str:
    """``"AMD EPYC 7B13, 2 cores"`` (the cores this process may use), with ``"; 4 x NVIDIA H100 80GB HBM3"`` when an
    imported torch sees CUDA devices."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{model}, {cores} cores"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        text += "; " + ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    return text


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
