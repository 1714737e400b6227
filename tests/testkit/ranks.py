"""A minimal stand-in for DeepSpeed's launcher, for tests about what runs *inside* the ranks.

``python -m testkit.ranks WORLD_SIZE MASTER_PORT -- [-m module | script] args...`` starts ``WORLD_SIZE`` ranks
on this machine with the environment DeepSpeed's per-node launcher gives them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and a first
argument ``--local_rank=N``), waits for them, ends them all as soon as one fails (as DeepSpeed's launcher does),
and exits with the first failing rank's code (0 when all succeed).

Why: DeepSpeed's runner and its per-node launcher each import DeepSpeed (and torch) before the first rank
starts, several seconds per run on our CPUs, twice. Tests of scoring, training and plugins start dozens of
runs and do not test the launcher; the launcher itself is tested through ``llmrl run`` and raw ``deepspeed``
(``test_launch_live``, ``test_interruptions_live``, ``test_two_hosts_live``, and the reliability tests that
kill ranks). This module imports nothing but the standard library. It is test code, never shipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    world_size, master_port, separator, *command = argv
    assert separator == "--", "usage: python -m testkit.ranks WORLD_SIZE MASTER_PORT -- [-m module | script] args"
    head = command[:2] if command[0] == "-m" else command[:1]
    rest = command[len(head):]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": world_size,
           "LOCAL_SIZE": world_size, "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    ranks = []
    for rank in range(int(world_size)):
        env_rank = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(subprocess.Popen([sys.executable, "-u", *head, f"--local_rank={rank}", *rest], env=env_rank))

    def stop(signum, _frame):
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    failed = 0
    while any(p.poll() is None for p in ranks):
        codes = [p.poll() for p in ranks]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and not failed:
            failed = bad[0]
            culprit = codes.index(failed)
            print(f"testkit.ranks: rank {culprit} exited with code {failed}; stopping the others", file=sys.stderr,
                  flush=True)
            for process in ranks:
                if process.poll() is None:
                    process.terminate()
            deadline = time.monotonic() + 30
            while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
                time.sleep(0.05)
            for process in ranks:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.05)
    codes = [p.wait() for p in ranks]
    for rank, rank_code in enumerate(codes):
        if rank_code != 0 and not failed:
            print(f"testkit.ranks: rank {rank} exited with code {rank_code}", file=sys.stderr, flush=True)
    code = failed or next((c for c in codes if c != 0), 0)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
