"""Ctrl-C or SIGTERM at any phase of a run (servers loading, setting up, a call in flight, idle) ends the whole
run within seconds with 130 (143 for SIGTERM) and no process left; so does killing `llmrl run` itself or
DeepSpeed's per-node launcher (which `llmrl run` starts directly on one machine), even with SIGKILL. Every
test waits for an observable event (a line in the run's output, a file the script writes) before it strikes, never
for a fixed time."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "phases.py")
EVENTS = {  # what shows that the run is in the phase
    "loading": ("log", "loading LLM 'main'"),
    "set-up": ("log", "setting up LLM 'main'"),
    "mid-call": ("mark", "calling"),
    "idle": ("mark", "idle"),
}


class Run:
    def __init__(self, tmp_path: Path, tiny, phase: str, spare: bool = False):
        """A run of LLM ``main`` (rank 1), and with ``spare`` a second one, ``spare`` (rank 2)."""
        self.config = tmp_path / "config.yaml"
        llms = {"main": {"model": tiny["llama"], "heads": {
            "slow": {"plugin": "llmrl_test_plugins:SlowHead", "args": {"seconds": 120}}}}}
        if spare:
            llms["spare"] = {"model": tiny["llama"]}
        self.config.write_text(yaml.safe_dump({
            "llms": llms, "threads_per_rank": 1, "log_level": "debug", "timeouts": {"shutdown": 3}}))
        self.marks = str(tmp_path / "mark")
        self.log_path = tmp_path / "run.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "llmrl.launch.cli", "run", "--config", str(self.config), SCRIPT, self.marks,
                 phase], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, event: tuple[str, str], timeout: float = 180.0) -> None:
        kind, what = event
        deadline = time.monotonic() + timeout
        while not (what in self.log if kind == "log" else os.path.exists(f"{self.marks}.{what}")):
            assert self.process.poll() is None, f"the run ended early ({self.process.returncode}):\n{self.log}"
            assert time.monotonic() < deadline, f"no {what!r} within {timeout} s:\n{self.log}"
            time.sleep(0.05)

    def client_pid(self) -> int:
        self.wait_for(("mark", "started"))
        return int(Path(f"{self.marks}.started").read_text())

    def processes(self) -> list[psutil.Process]:
        """Every live process of the run (they all carry the config's path on their command line)."""
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            try:
                if str(self.config) in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def finish(self, timeout: float = 60.0) -> int:
        """The run's exit code; asserts it ended within ``timeout`` and left nothing behind."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout} s:\n{self.log}") from None
        deadline = time.monotonic() + 20
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.processes()
        self.kill()
        assert not left, f"processes left behind: {[p.cmdline()[:4] for p in left]}\n{self.log}"
        return code

    def kill(self) -> None:
        for proc in [*self.processes(), psutil.Process(self.process.pid)] if self.process.poll() is None \
                else self.processes():
            try:
                proc.kill()
            except psutil.Error:
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def run(tmp_path, tiny):
    runs = []

    def start(phase, spare=False):
        runs.append(Run(tmp_path, tiny, phase, spare))
        return runs[-1]

    yield start
    for r in runs:
        r.kill()


# A terminal's Ctrl-C at every phase; the client's own SIGINT where it once hung (servers still loading) and
# mid-call. (Each case is a whole run: the matrix is kept to the cases that exercise different code paths.)
@pytest.mark.parametrize("target, phase", [("terminal", p) for p in EVENTS] + [("client", "loading"),
                                                                              ("client", "mid-call")])
def test_ctrl_c_at_any_phase_ends_the_run_with_130(run, phase, target):
    live = run(phase)
    client = live.client_pid()
    live.wait_for(EVENTS[phase])
    if target == "terminal":  # a terminal's Ctrl-C reaches the foreground process group: `llmrl run`
        os.killpg(live.process.pid, signal.SIGINT)
    else:  # only the client script's process
        os.kill(client, signal.SIGINT)
    assert live.finish() == 130, live.log


@pytest.mark.parametrize("phase", ["set-up"])
def test_sigterm_ends_the_run_with_143(run, phase):
    live = run(phase)
    live.wait_for(EVENTS[phase])
    live.process.terminate()
    assert live.finish() == 143, live.log


def _launcher_chain(live: Run):
    """(`llmrl run`, DeepSpeed's per-node launcher) of a run: on one machine `llmrl run` starts the launcher itself,
    where DeepSpeed's runner would only have started it (the runner's own chain is tested in test_processes)."""
    command = psutil.Process(live.process.pid)
    (launcher,) = command.children()
    assert "deepspeed.launcher.launch" in " ".join(launcher.cmdline())
    return command, launcher


@pytest.mark.parametrize("victim", ["llmrl run", "per-node launcher"])
def test_killing_any_launcher_process_ends_every_rank(run, victim):
    live = run("idle")
    live.wait_for(EVENTS["idle"])
    command, launcher = _launcher_chain(live)
    ranks = launcher.children()
    assert len(ranks) == 2
    own_folder = os.path.dirname(ranks[0].environ()["LLMRL_EXIT_CODE_FILE"])  # `llmrl run`'s temporary folder
    {"llmrl run": command, "per-node launcher": launcher}[victim].kill()  # SIGKILL
    code = live.finish()
    if victim != "llmrl run":  # `llmrl run` itself survives to report the failure
        assert code != 0, live.log
    else:  # killed, it could not remove its folder
        shutil.rmtree(own_folder, ignore_errors=True)
    assert _all_ended(ranks), [r.pid for r in ranks]


def _all_ended(processes: list[psutil.Process], timeout: float = 20.0) -> bool:
    """Whether every process has exited (gone, or a zombie nobody reaped yet) within ``timeout``, waiting on each
    one's pidfd, which Linux makes readable when the process exits. A process being killed shows an empty command
    line before it ends, so `Run.processes` (which matches command lines) no longer sees it: wait here."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            fd = os.pidfd_open(process.pid)
        except ProcessLookupError:  # gone, and reaped
            continue
        try:
            if process.is_running():  # (False: the pid names another process now; ours ended)
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    return False
        finally:
            os.close(fd)
    return True


def test_a_server_killed_while_the_script_is_idle_ends_the_run_with_137_naming_it(run):
    """DeepSpeed's launcher then stops the script with SIGTERM: the run used to end with the script's 143."""
    live = run("idle")
    live.wait_for(EVENTS["idle"])
    _, launcher = _launcher_chain(live)
    (server,) = [r for r in launcher.children() if r.environ().get("RANK") == "1"]
    server.kill()
    assert live.finish() == 137, live.log
    assert "rank(s) 1 of this node died by SIGKILL without a report" in live.log, live.log


def test_a_script_that_ends_with_a_server_busy_and_one_frozen_ends_the_run(run):
    """At the script's end LLM ``main``'s server is busy in a two-minute call, and ``spare``'s is frozen (SIGSTOP;
    stuck in a request alike). The client waits timeouts.shutdown (3 s here), reports both and hangs up. The busy
    server leaves mid-call by itself, while the frozen one is still there (it used to finish the call, and `llmrl
    run` waited for it); `llmrl run` kills the frozen one (the DeepSpeed launcher used to wait for it forever)."""
    live = run("in-flight", spare=True)
    live.wait_for(("mark", "calling"))
    _, launcher = _launcher_chain(live)
    assert "rank 1: loading LLM 'main'" in live.log and "rank 2: loading LLM 'spare'" in live.log, live.log
    ranks = {p.environ().get("RANK"): p for p in launcher.children()}
    busy, frozen = ranks["1"], ranks["2"]
    frozen.suspend()
    Path(f"{live.marks}.go").write_text("")
    deadline = time.monotonic() + 60
    while busy.is_running() and busy.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the busy server did not leave:\n{live.log}"
        time.sleep(0.05)
    # it left by itself: before `llmrl run` said it would kill what was left (the line comes before the kill)
    assert "after the script ended" not in live.log, live.log
    assert frozen.is_running(), live.log
    assert live.finish() == 1, live.log
    assert "did not stop within 3 s of the stop" in live.log
    assert "the client hung up while this rank was still serving" in live.log
    assert "after the script ended and the servers were told to stop" in live.log
