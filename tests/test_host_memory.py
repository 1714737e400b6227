"""The server rank's host allocator setting (engine/server/host_memory.py): with ``reuse``, tensors of a forward
pass's size reuse freed memory instead of being page-faulted in afresh; with ``default`` glibc's settings stay.
Each case runs in a fresh interpreter (mallopt changes the process for good)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from llmrl.engine.server.host_memory import keep_freed_memory, why_left_alone

pytestmark = [pytest.mark.slow,  # fresh interpreters (4, each importing torch): the full suite, not the unit tier
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")]

# A layer's pattern: 16-24 MB activations (the size varies by round, as batches do), freed while a small tensor
# allocated after them stays alive. Minor page faults counted over the last 16 rounds (the first 4 warm up).
CHILD = """
import json, resource, sys
import torch
from llmrl.engine.server.host_memory import keep_freed_memory
said = keep_freed_memory(sys.argv[1])
def layer(n):
    xs = [torch.ones(n) for _ in range(3)]
    y = xs[0] * 2
    z = y + xs[1]
    del xs
    w = torch.ones(n // 50)
    return float(z.sum()) + float(w.sum())
for r in range(4):
    layer((4 + r % 3) << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(16):
    layer((4 + r % 3) << 20)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "said": said}))
"""


def _faults(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, setting], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reuse_keeps_a_layers_activations_out_of_page_faults():
    tuned = _faults("reuse")
    plain = _faults("default")
    pages = (16 << 20) // 4096  # the smallest activation, in 4 KB pages
    assert "32 MB" in tuned["said"] and "left as it is" in plain["said"]
    # Measured: 54,000-400,000 faults under glibc's defaults; under reuse 0, or 11,000-18,000 when the host's memory
    # reclaim took back the idle heap's pages once (a bounded, one-off cost, where the defaults pay round after round).
    # Both depend on the host, so the bounds are loose; the next test checks the mechanism exactly.
    assert plain["faults"] > 4 * pages
    assert tuned["faults"] < plain["faults"] / 2


def test_reuse_serves_a_layer_sized_tensor_from_the_heap():
    """The mechanism, without the host's page reclaim in the way: a fresh process's first 20 MB tensor lies in the
    heap under reuse, and in a mapping of its own under glibc's defaults."""
    child = """
import sys, torch
from llmrl.engine.server.host_memory import keep_freed_memory
keep_freed_memory(sys.argv[1])
x = torch.empty(5 << 20)
with open("/proc/self/maps") as f:
    heap = [line.split()[0].split("-") for line in f if line.rstrip().endswith("[heap]")]
print(any(int(a, 16) <= x.data_ptr() < int(b, 16) for a, b in heap))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    where = {setting: subprocess.run([sys.executable, "-c", child, setting], capture_output=True, text=True, env=env,
                                     check=True, timeout=120).stdout.split()[-1] for setting in ("reuse", "default")}
    assert where == {"reuse": "True", "default": "False"}


def test_the_users_choice_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert why_left_alone("reuse") == "MALLOC_TRIM_THRESHOLD_ is set in the environment"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert "preloaded" in keep_freed_memory("reuse")
    monkeypatch.delenv("LD_PRELOAD")
    assert why_left_alone("default") == "host_malloc is 'default'"
    assert why_left_alone("reuse") is None


def test_the_config_field_defaults_to_reuse_and_refuses_other_values():
    from llmrl.engine.config.loading import load_config
    from llmrl.engine.errors import ConfigError

    demo = Path(__file__).resolve().parent.parent / "configs" / "rlhf-sentiment.yaml"
    assert load_config(demo).host_malloc == "reuse"
    assert load_config(demo, ["host_malloc=default"]).host_malloc == "default"
    with pytest.raises(ConfigError, match='host_malloc: "jemalloc" is not one of "reuse", "default"'):
        load_config(demo, ["host_malloc=jemalloc"])
