"""A server rank's host allocator: glibc's malloc told to keep freed memory for the next tensor of the same size.

A forward pass on a CPU allocates and frees tensors of tens of MB at every layer (an MLP's activations for 3,600
tokens are 22 MB each). glibc's defaults serve such blocks with ``mmap`` and give them back to the system when
they are freed (its dynamic threshold adapts, but the heap's top is trimmed again whenever 64 MB of it are free),
so the next layer's tensor is page-faulted in afresh: every page zeroed by the kernel, on one core. Measured on
the benchmark's "6 candidates" scoring call, ``benchmarks/run.py --score-only --host-malloc default`` then
``reuse`` in one sitting: 3.00 s against 2.83 s served (a quick in-process script had shown 3.70 s against 3.18 s);
in that script's profile an element-wise op (SiLU over 16 x 227 x 1536) took 5.5 ms instead of 1.9 ms.

:func:`keep_freed_memory` sets, with ``mallopt``: blocks up to 32 MB (glibc's largest ``mmap`` threshold) come
from the heap, and the heap's top is given back only when more than 1 GB of it is free. A rank's resident memory
then stays near its peak between calls, which is what jemalloc and tcmalloc (the allocators PyTorch's CPU tuning
guide recommends) do too. Larger blocks (a vocabulary's logits) are still mapped and unmapped.

It changes nothing where the allocator is not glibc's, where the user chose already (``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` set, or jemalloc / tcmalloc preloaded), or where the config says
``host_malloc: default``. It runs on server ranks only: the client's process is the user's. This module does not
measure memory (``server_memory`` does).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses a larger one on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_done: list[str] = []  # what keep_freed_memory did in this process (mallopt's settings are process-wide too)


def why_left_alone(setting: str) -> str | None:
    """None when :func:`keep_freed_memory` may tune this process's allocator; else the reason it leaves it."""
    if setting == "default":
        return "host_malloc is 'default'"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    chosen = [name for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if name in os.environ]
    if chosen:
        return f"{chosen[0]} is set in the environment"
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload:
        return "another allocator is preloaded (LD_PRELOAD)"
    return None


def keep_freed_memory(setting: str = "reuse") -> str:
    """Tune glibc's malloc as the module's docstring says; returns what was done (also kept for :func:`report`)."""
    reason = why_left_alone(setting)
    if reason is None:
        libc = ctypes.CDLL(None)
        if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
            said = f"host allocator: blocks up to {MMAP_THRESHOLD >> 20} MB reuse freed memory (host_malloc: reuse)"
        else:
            said = "host allocator: glibc refused the settings"
    else:
        said = f"host allocator left as it is: {reason}"
    _done[:] = [said]
    return said


def report() -> str | None:
    """What :func:`keep_freed_memory` did in this process (``server_memory`` reports it), or None."""
    return _done[0] if _done else None
