"""Start-up stores listen on the run's own address only, not on every interface (torch's default)."""

import psutil
import pytest

from llmrl.engine.transport import rendezvous


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_stores_listen_on_the_given_address_only():
    port = rendezvous.free_port()
    run_store = rendezvous.host_run_store("127.0.0.1", port, timeout=10)
    group_store = rendezvous.host_group_store("127.0.0.1", timeout=10)
    assert listening_ips(port) == {"127.0.0.1"}
    assert listening_ips(group_store.port) == {"127.0.0.1"}
    # And they work: a second process's view, through a client connection.
    client = rendezvous.join_group_store(rendezvous.format_address("127.0.0.1", group_store.port), timeout=10)
    group_store.set("key", b"value")
    assert client.get("key") == b"value"
    run_client = rendezvous.join_run_store("127.0.0.1", port, timeout=10)
    run_store.set("token", b"abc")
    assert run_client.get("token") == b"abc"


def test_a_busy_port_is_reported_with_the_address():
    port = rendezvous.free_port()
    first = rendezvous.host_run_store("127.0.0.1", port, timeout=10)
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
        rendezvous.host_run_store("127.0.0.1", port, timeout=10)
    del first
