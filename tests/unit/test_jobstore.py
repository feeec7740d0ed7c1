"""The job's store and addresses bound on ports the kernel picks (runtime/jobstore.py, agent.NodeLink)."""
from __future__ import annotations

import socket
import time

import pytest

from npu_train.errors import ConfigError
from npu_train.runtime.jobstore import host_store, join_store, peer_address, picks_port, publish_address


def test_store_on_a_kernel_picked_port_is_joined_through_dist_init():
    server = host_store("127.0.0.1", 0, 10)
    assert 0 < server.port < 65536
    client = join_store(f"tcp://127.0.0.1:{server.port}", 10)
    publish_address(client, 3, "tcp://127.0.0.1:40001")
    assert peer_address(server, 3, "tcp://127.0.0.1:*") == "tcp://127.0.0.1:40001"
    # a fixed address is used as given (ipc sockets, addresses with a port)
    assert peer_address(server, 4, "ipc:///tmp/x/r4.sock") == "ipc:///tmp/x/r4.sock"
    assert peer_address(server, 4, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"


def test_picks_port_only_for_tcp_star():
    assert picks_port("tcp://10.0.0.2:*") and picks_port("tcp://[::1]:*")
    assert not picks_port("tcp://10.0.0.2:5555") and not picks_port("ipc:///tmp/*")


def test_a_taken_runtime_port_is_one_config_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"runtime.port={port} on 127.0.0.1 is in use .*runtime.port=0"):
            host_store("127.0.0.1", port, 5)


def test_join_store_refuses_an_address_without_a_port():
    with pytest.raises(ValueError, match="tcp://host:port"):
        join_store("tcp://127.0.0.1", 1)


def test_node0_link_binds_a_kernel_picked_port_that_node1_reaches():
    from npu_train.runtime.agent import NodeLink

    kw = dict(interval_s=0.05, timeout_s=5.0, startup_timeout_s=5.0)
    n0 = NodeLink(0, 2, "tcp://127.0.0.1:*", "tok", **kw)
    n1 = NodeLink(1, 2, n0.addr, "tok", **kw)
    try:
        assert n0.addr.startswith("tcp://127.0.0.1:") and not n0.addr.endswith(":*")
        for _ in range(400):  # both sides hear each other's heartbeats
            for link in (n0, n1):
                link.pump(time.monotonic(), lambda step: None)
            if n0.contacted == {1} and n1.contacted == {0}:
                break
            time.sleep(0.01)
        assert n0.contacted == {1} and n1.contacted == {0}
    finally:
        n1.close()
        n0.close()
