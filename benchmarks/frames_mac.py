"""The cost of authenticating every frame: send and receive frames over loopback with the per-frame MAC (as every
link of a run does) and without it (the same sockets, no keys), in one run, and print the ratio.

    python -m benchmarks.frames_mac            # small requests, a 1 MB result, a 64 MB state dict
"""

from __future__ import annotations

import socket
import statistics
import sys
import threading
import time

import torch

from llmrl.engine.transport import frames

SIZES = {"1 KB request": 256, "1 MB result": 256 * 1024, "64 MB state dict": 16 * 1024 * 1024}  # float32 counts


def pair(keys: bool) -> tuple[frames.Connection, frames.Connection]:
    a, b = socket.socketpair()
    if not keys:
        return frames.Connection(a), frames.Connection(b)
    k1, k2 = b"\1" * 32, b"\2" * 32
    return frames.Connection(a, keys=(k1, k2)), frames.Connection(b, keys=(k2, k1))


def round_trips(keys: bool, tensor: torch.Tensor, repeats: int) -> float:
    """Median seconds to send ``tensor`` one way and receive it on the other side."""
    left, right = pair(keys)
    times = []
    for _ in range(repeats):
        box = []
        reader = threading.Thread(target=lambda out=box: out.append(right.recv()))
        reader.start()
        start = time.perf_counter()
        left.send({"type": "reply", "id": 1}, tensor)
        reader.join()
        times.append(time.perf_counter() - start)
        assert torch.equal(box[0][1], tensor)
    left.close()
    right.close()
    return statistics.median(times)


def main() -> int:
    print(f"{'frame':>18} | {'no MAC ms':>10} | {'MAC ms':>8} | MAC / no MAC")
    for name, numel in SIZES.items():
        tensor = torch.randn(numel)
        repeats = 5 if numel > 1 << 20 else 50
        plain, signed = [], []
        for _ in range(3):  # interleaved, so a busy moment hits both
            plain.append(round_trips(False, tensor, repeats))
            signed.append(round_trips(True, tensor, repeats))
        p, s = min(plain), min(signed)
        print(f"{name:>18} | {p * 1e3:10.3f} | {s * 1e3:8.3f} | {s / p:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
