"""Two hosts for real: two network namespaces joined by a veth pair stand for two machines, each with an
address that exists only inside it, and each node is started as a user would on its own machine:
``llmrl run --config C --hostfile H --no_ssh --node_rank R --master_addr NODE0 --master_port P script``.

Covered: an LLM group living entirely on node 1 (rank 0 alone on node 0), and an LLM whose 2 replicas
are split across the nodes and train with ZeRO-2 (one update equals a plain PyTorch step; its weights then sync,
over a group across the nodes, into a sampler LLM on node 1). In both,
scores equal plain Hugging Face, every listening socket of every process of the run is bound to its
node's own address, and killing node 1's launcher (the ``llmrl run`` command, or DeepSpeed's per-node
launcher) makes the client raise ServerDiedError naming a rank of node 1, both nodes exit non-zero
and nothing is left running in either namespace.

The test creates and removes the namespaces itself (unique names per run) and never sends traffic to
any address but loopback and the namespaces' own. Without the privilege to create namespaces it skips,
saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import pytest
import torch
import yaml
from test_training_live import BATCH, CANDIDATES, CONTEXTS, LR, assert_params, llm, plain_sgd_step

from testkit import reference_scores

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "scripts", "two_node_client.py")
ADDRESSES = ("10.231.77.1", "10.231.77.2")  # an unusual private subnet, present only inside the namespaces


# ----------------------------------------------------------------------------- the two hosts


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def checked_ip(*args: str) -> None:
    result = ip(*args)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def processes_in(namespace: str) -> list[int]:
    result = ip("netns", "pids", namespace)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


@dataclass
class Hosts:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair; removed afterwards, with anything left in them."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        pytest.skip("needs Linux and the `ip` command (iproute2) to create network namespaces")
    tag = secrets.token_hex(3)
    namespaces = (f"llmrl-{tag}-0", f"llmrl-{tag}-1")
    veths = (f"llmrl{tag}a", f"llmrl{tag}b")  # interface names have at most 15 characters
    created = []
    try:
        for name in namespaces:
            result = ip("netns", "add", name)
            if result.returncode != 0:
                if not created:
                    pytest.skip(f"cannot create network namespaces here (`ip netns add` said: "
                                f"{result.stderr.strip()}); the two-host test needs root or CAP_SYS_ADMIN")
                raise RuntimeError(f"`ip netns add {name}` failed: {result.stderr.strip()}")
            created.append(name)
        checked_ip("link", "add", veths[0], "netns", namespaces[0], "type", "veth", "peer", "name", veths[1],
                   "netns", namespaces[1])
        for name, veth, address in zip(namespaces, veths, ADDRESSES):
            checked_ip("-n", name, "link", "set", "lo", "up")
            checked_ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            checked_ip("-n", name, "link", "set", veth, "up")
        yield Hosts(namespaces, ADDRESSES)
    finally:
        for name in created:
            for pid in processes_in(name):  # only processes this test started live there
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", name)  # removes the veth pair with it


# ----------------------------------------------------------------------------- a run across them


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, read from its own network namespace
    (/proc/PID/net/tcp{,6}; psutil reads the caller's namespace and would see nothing)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host, port = local.split(":")
            raw = bytes.fromhex(host)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def wait_for(predicate, what: str, nodes, timeout: float = 240.0):
    """Wait for ``predicate()`` to be truthy; fail early with the logs if a node exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if any(node.process.poll() is not None for node in nodes):
            break
        time.sleep(0.2)
    logs = "\n".join(f"--- node {n.rank} (exit {n.process.poll()}):\n{n.log()[-4000:]}" for n in nodes)
    pytest.fail(f"{what} did not happen\n{logs}")


@dataclass
class Node:
    rank: int
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]


class TwoNodeRun:
    """One run across the two hosts: node R runs ``llmrl run ... --no_ssh --node_rank R`` in namespace R."""

    def __init__(self, hosts: Hosts, tmp_path, config: dict, slots: tuple[int, int], port: int):
        self.hosts, self.port = hosts, port
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(f"node0 slots={slots[0]}\nnode1 slots={slots[1]}\n")
        request = tmp_path / "request.json"
        request.write_text(json.dumps({"contexts": CONTEXTS, "candidates": CANDIDATES, "batch": BATCH}))
        self.out = str(tmp_path / "report.json")
        self.nodes = []
        # Nodes started one by one share the run's secret through the environment, as a user would pass it.
        env = {**os.environ, "LLMRL_RUN_SECRET": secrets.token_hex(32)}
        for rank, namespace in enumerate(hosts.namespaces):
            log_path = str(tmp_path / f"node{rank}.log")
            cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "llmrl.launch.cli", "run",
                   "--config", str(config_path), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
                   "--master_addr", hosts.addresses[0], "--master_port", str(port), CLIENT, self.out, str(request)]
            with open(log_path, "w") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True, env=env)
            self.nodes.append(Node(rank, process, log_path))

    def report(self) -> dict:
        wait_for(lambda: os.path.exists(self.out), "the client's report", self.nodes)
        with open(self.out) as f:
            return json.load(f)

    def node_of(self, pid: int) -> int:
        for node in self.nodes:
            if pid in {p.pid for p in node.tree()}:
                return node.rank
        raise AssertionError(f"pid {pid} belongs to neither node")

    def died(self) -> dict:
        path = self.out + ".died.json"
        wait_for(lambda: os.path.exists(path), "the client's ServerDiedError", self.nodes[:1], timeout=120)
        with open(path) as f:
            return json.load(f)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(30)


@pytest.fixture
def two_node_run(hosts, tmp_path):
    runs = []

    def start(config: dict, slots: tuple[int, int], port: int) -> TwoNodeRun:
        runs.append(TwoNodeRun(hosts, tmp_path, config, slots, port))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


# ----------------------------------------------------------------------------- checks


def check_scores(report: dict, reference_models) -> None:
    model, tok = reference_models["llama"]
    expected = reference_scores(model, tok, CONTEXTS, CANDIDATES)
    assert report["scores"], "the client scored nothing"
    for llm_name, scores in report["scores"].items():
        assert len(scores) == len(expected)
        for got, want in zip(scores, expected):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0,
                                       msg=lambda m, n=llm_name: f"{n}: {m}")


def check_sockets(run: TwoNodeRun, report: dict) -> None:
    """Every listening socket of every process of the run is bound to its node's address, and the ones the
    design says exist do: rank 0's store (the master port) and request listener, and one or more per server
    rank (its group's store on the group leader; gloo's listener on every rank)."""
    listeners = {}
    for node in run.nodes:
        for process in node.tree():
            for address, port in listening_sockets(process.pid):
                assert address == run.hosts.addresses[node.rank], (
                    f"{' '.join(process.cmdline())[:200]} (node {node.rank}) listens on {address}:{port}, "
                    f"not on its node's address {run.hosts.addresses[node.rank]}")
                listeners.setdefault(process.pid, []).append((address, port))
    client = listeners.get(report["client_pid"], [])
    assert (run.hosts.addresses[0], run.port) in client and len(client) >= 2, client
    for rank, server in report["servers"].items():
        assert listeners.get(server["pid"]), f"server rank {rank} listens nowhere: {listeners}"


def check_killing_node_1(run: TwoNodeRun, victim: psutil.Process, node1_ranks: set[int]) -> None:
    """Kill ``victim`` (a launcher process of node 1): the client raises ServerDiedError naming a rank of node 1,
    both nodes exit non-zero, and nothing is left in either namespace."""
    everything = [p for node in run.nodes for p in node.tree()]
    own_folders = set()  # a killed `llmrl run` cannot remove its temporary folder: the test does
    if "llmrl.launch.cli" in victim.cmdline():
        for process in victim.children(recursive=True):
            with contextlib.suppress(psutil.Error, KeyError):
                own_folders.add(os.path.dirname(process.environ()["LLMRL_EXIT_CODE_FILE"]))
    victim.kill()
    died = run.died()
    assert died["type"] == "ServerDiedError" and died["rank"] in node1_ranks, died
    assert f"rank {died['rank']}" in died["message"]
    for node in run.nodes:
        try:
            code = node.process.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node.rank} still runs a minute after node 1's launcher was killed:\n"
                        f"{node.log()[-3000:]}")
        assert code != 0, f"node {node.rank} exited 0:\n{node.log()[-3000:]}"

    def gone() -> bool:
        alive = [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        return not alive and not any(processes_in(ns) for ns in run.hosts.namespaces)

    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(), [(p.pid, p.cmdline()) for p in everything if p.is_running()]
    for folder in own_folders:
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- the tests


def test_an_llm_group_entirely_on_node_1(two_node_run, tiny, reference_models):
    """Rank 0 alone on node 0; both replicas of the LLM (its whole group: store, process group) on node 1.
    Killing node 1's `llmrl run` command (SIGKILL) must take its ranks down too."""
    run = two_node_run({"llms": {"far": {"model": tiny["llama"], "replicas": 2}}, "threads_per_rank": 1,
                        "timeouts": {"startup": 120}}, slots=(1, 2), port=29500)
    report = run.report()
    assert {int(r): run.node_of(s["pid"]) for r, s in report["servers"].items()} == {1: 1, 2: 1}
    assert run.node_of(report["client_pid"]) == 0
    check_scores(report, reference_models)
    check_sockets(run, report)
    node1 = run.nodes[1].tree()[0]
    assert "llmrl.launch.cli" in node1.cmdline()  # `ip netns exec` replaced itself with `llmrl run`
    check_killing_node_1(run, node1, node1_ranks={1, 2})


def test_replicas_split_across_nodes_train_with_zero2(two_node_run, tiny, reference_models):
    """Replica 0 on node 0 (beside the client), replica 1 on node 1: one process group across the two hosts.
    One update equals a plain single-process PyTorch step on the whole batch, and ``sync_weights`` sends the
    trained weights from replica 0's rank (node 0) to a sampler LLM on node 1 over their group, bit for bit.
    Killing node 1's DeepSpeed launcher (SIGKILL) must fail node 1's `llmrl run` too (DeepSpeed alone would
    report success)."""
    sampler = {"model": tiny["llama"], "heads": {"value": {"plugin": "value", "args": {"hidden": 16}}}}
    run = two_node_run({"llms": {"split": llm(tiny, zero=2, replicas=2, micro=2), "sampler": sampler},
                        "threads_per_rank": 1, "timeouts": {"startup": 120}}, slots=(2, 2), port=29501)
    report = run.report()
    assert {int(r): run.node_of(s["pid"]) for r, s in report["servers"].items()} == {1: 0, 2: 1, 3: 1}
    check_scores(report, reference_models)
    weights = torch.load(run.out + ".pt")["split"]
    assert [s["replica"] for s in report["stats"]["split"]] == [0, 1]
    assert all(s["optimizer_steps"] == 1 for s in report["stats"]["split"])
    assert_params(weights["after"], plain_sgd_step(tiny, weights["before"], LR), weights["before"])
    first, second = weights["replicas"]
    assert all(torch.equal(first[k], second[k]) for k in first), "the replicas must hold the same weights"
    assert report["synced"] == {"tensors": len(weights["after"]), "policy_version": 1, "equal": True}, report
    check_sockets(run, report)
    launcher = [p for p in run.nodes[1].tree() if "deepspeed.launcher.launch" in " ".join(p.cmdline())]
    assert len(launcher) == 1, [p.cmdline() for p in run.nodes[1].tree()]
    check_killing_node_1(run, launcher[0], node1_ranks={2, 3})
    assert "rank(s) 2, 3 of this node ended without a clean stop" in run.nodes[1].log()
