"""Optional profiling of a server rank's requests, for developers: ``LLMRL_PROFILE=DIR`` in the server's environment.

With the variable set, each server rank runs the *second* request of every kind (the first one warms up: it compiles,
allocates caches) under ``torch.profiler``, on the host and, on a GPU, on the device, and writes tables of the
operations that took the most time, also grouped by input shapes, to ``DIR/rank{R}-{kind}.txt`` (a request served
inside another, a weight write taken by a ``generate`` in progress, is not profiled). Without the variable
nothing is imported and nothing changes. This module profiles; it changes no result, and it writes nowhere but ``DIR``.

Stopping the profiler and tabulating a large request (an update of thousands of tokens) can hold the interpreter for
tens of seconds, during which the rank sends no heartbeat: give such a run a ``timeouts.dead_after`` of minutes (the
benchmarks' ``--profile`` does), or the client declares the rank dead.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

PROFILED_CALL = 2  # the second request of each kind
_running: list[str] = []  # the kind profiled now (a weight write served inside a generate is not profiled again)


@contextlib.contextmanager
def profiled(kind: str, count: int, rank: int, device_type: str):
    """Runs the body under torch's profiler when ``LLMRL_PROFILE`` names a folder and this is the ``count``-th
    request of ``kind`` that is profiled (see the module's docstring); else runs it as is."""
    folder = os.environ.get("LLMRL_PROFILE")
    if not folder or count != PROFILED_CALL or _running:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    _running.append(kind)
    try:
        with profile(activities=activities, record_shapes=True) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()
    finally:
        _running.pop()
    seconds = time.perf_counter() - start
    events = prof.key_averages()
    sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if cuda else [])
    operators = sum(event.count for event in events if event.key.startswith("aten::"))
    launches = sum(event.count for event in events if event.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaGraphLaunch"))
    tables = [f"{kind} request {count} on rank {rank}: {seconds:.3f} s under the profiler; {operators} aten operator "
              f"calls (nested ones included)" + (f", {launches} kernel or graph launches" if cuda else "")]
    tables += [f"sorted by {key}:\n" + events.table(sort_by=key, row_limit=40, max_name_column_width=70)
               for key in sorts]
    by_shape = prof.key_averages(group_by_input_shape=True)
    tables += [f"by input shapes, sorted by {key}:\n"
               + by_shape.table(sort_by=key, row_limit=40, max_name_column_width=40, max_shapes_column_width=90)
               for key in sorts]
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{rank}-{kind}.txt").write_text("\n\n".join(tables) + "\n")
