"""``llmrl run``'s supervisor ends a run whose script has ended but one of whose ranks has not (a frozen or stuck
server: DeepSpeed's launcher would wait for it forever), and only once rank 0's own process has ended: its atexit
handlers (a tracker's finish) may take longer than the grace period. Launchers here are stand-ins: a shell that
starts a "rank 0" writing its exit files as ``launch.rank.report_exit`` does, and a "server" that never ends."""

from __future__ import annotations

import os
import shlex
import sys
import textwrap

from llmrl.launch.run import client_ended
from llmrl.launch.supervisor import supervise


def rank_zero(base: str, atexit_seconds: float) -> list[str]:
    """A rank 0 that reports exit code 0 (pid file, then code file), then runs a slow atexit handler."""
    script = f"{base}.rank0.py"
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
            import atexit, os, time
            atexit.register(lambda: (time.sleep({atexit_seconds}), open({base + '.flushed'!r}, "w").close()))
            open({base + '.pid'!r}, "w").write(str(os.getpid()))
            open({base!r}, "w").write("0")
        """))
    return [sys.executable, script]


def launcher(*commands: list[str]) -> list[str]:
    """A launcher stand-in: runs the commands side by side and waits for them all."""
    return ["bash", "-c", " & ".join(shlex.join(c) for c in commands) + " & wait"]


def test_a_rank_left_running_after_the_script_ended_is_killed(tmp_path, capsys):
    base = str(tmp_path / "exit-code")
    code, stopped = supervise(launcher(rank_zero(base, 0), ["sleep", "300"]),
                              dict(os.environ), script_ended=lambda: client_ended(base), linger=1.0)
    assert code != 0 and stopped is None  # killed: the "server" would have ended with 0
    assert "after the script ended and the servers were told to stop" in capsys.readouterr().err


def test_rank_zeros_atexit_handlers_are_not_cut_short(tmp_path):
    base = str(tmp_path / "exit-code")
    code, _ = supervise(launcher(rank_zero(base, 3)), dict(os.environ),
                        script_ended=lambda: client_ended(base), linger=0.5)
    assert code == 0 and os.path.exists(base + ".flushed")


def test_ranks_the_script_ended_before_they_connected_are_ended_without_the_stuck_line(tmp_path, capsys):
    base = str(tmp_path / "exit-code")
    code, stopped = supervise(launcher(rank_zero(base, 0), ["sleep", "300"]), dict(os.environ),
                              script_ended=lambda: client_ended(base), linger=300.0,
                              servers_unreached=lambda: True)
    assert code != 0 and stopped is None  # killed (within the test's own timeout: not after the 300 s linger)
    assert "after the script ended" not in capsys.readouterr().err
