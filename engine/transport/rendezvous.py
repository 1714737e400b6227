"""Start-up discovery: how every rank finds the client and the other ranks of its LLM group.

Rank 0 hosts a key-value store (torch's TCPStore) at the launcher's MASTER_ADDR:MASTER_PORT. Through
it, rank 0 publishes the address of its listener, and the leader of each LLM group publishes the address of
its group's own store. Nothing secret goes through a store: anyone who can reach the port can read and write
it, so the servers and the client authenticate each other with the run's secret
(:mod:`llmrl.engine.transport.secret`) before they trust what they found there. The group's store listens on a port the
operating system picked, on the leader's own node, so groups never collide and need not live on
rank 0's node.

This module does not create process groups or move requests; it only exchanges addresses.
"""

from __future__ import annotations

import datetime
import socket

CLIENT_ADDRESS_KEY = "llmrl/client"


def group_key(llm: str) -> str:
    return f"llmrl/group/{llm}"


def host_run_store(master_addr: str, master_port: int, timeout: float):
    """The run's store, hosted by rank 0 (it listens on the launcher's master port)."""
    from torch.distributed import TCPStore

    fd, port = _bound_listener(master_addr, master_port)
    return TCPStore(master_addr, port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout), master_listen_fd=fd)


def join_run_store(master_addr: str, master_port: int, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def host_group_store(host: str, timeout: float):
    """A store for one LLM group, on a port the OS picks (no collisions between groups)."""
    from torch.distributed import TCPStore

    fd, port = _bound_listener(host, 0)
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout),
                    master_listen_fd=fd)


def join_group_store(address: str, timeout: float):
    from torch.distributed import TCPStore

    host, port = split_address(address)
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def reachable_address(master_addr: str) -> str:
    """This node's address as seen on the route to the master (loopback stays loopback)."""
    try:
        target = socket.gethostbyname(master_addr)
    except OSError:
        return master_addr
    if target.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((target, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def interface_of(address: str) -> str | None:
    """The name of this node's network interface that holds the IPv4 ``address`` (``lo`` for loopback), or
    None when no interface holds it (a NAT'd or mistyped address). Reads this process's own network
    namespace (getifaddrs), not /proc/net."""
    import psutil

    if address.startswith("127."):
        address = "127.0.0.1"
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def _bound_listener(host: str, port: int) -> tuple[int, int]:
    """A listening socket for a store, bound to ``host``'s address only (torch's own store server would
    listen on every interface). Returns (file descriptor, port); the store takes the descriptor over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((socket.gethostbyname(host), port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port} ({err.strerror}); is {host} an address of "
                                 "this node and the port free?") from err
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port


def listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and an OS-picked port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((socket.gethostbyname(host), 0))
    sock.listen(1024)
    return sock


def format_address(host: str, port: int) -> str:
    return f"{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests and for the launcher's master port)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
