"""No port is picked free first and bound later: another process (a second sweep job on the same host) that
takes such a port in between made a job die at the gloo rendezvous with EADDRINUSE.

The race is made certain here: ``Endpoint.free_tcp_port`` (a port that was free a moment ago) hands out a
port this test holds bound and listening, as a concurrent job that took it would. The job must still train,
and every TCP address it names in ``job.json`` must be bound by the job itself (``runtime/jobstore.py``).
"""
from __future__ import annotations

import json
import os
import socket

import pytest

from conftest import run_pipeline

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def taken_port(monkeypatch):
    """A port held bound and listening by this test, and ``free_tcp_port`` handing out exactly that one."""
    from npu_train.transport.channel import Endpoint

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(Endpoint, "free_tcp_port", staticmethod(lambda host="127.0.0.1": port))
        yield port


def test_inline_job_trains_while_the_free_port_is_taken(tmp_path, tiny_model, taken_port):
    run_dir = str(tmp_path / "run")
    losses, _ = run_pipeline(tiny_model, run_dir, "backend=[cpu,cpu]", "runtime.transport=inline",
                             "train.steps=2", "checkpoint.save=false")
    assert len(losses) == 2
    with open(os.path.join(run_dir, "job.json")) as f:
        info = json.load(f)
    addrs = [info["coord_addr"]] + [c["inbox"] for c in info["cards"]]
    ports = [int(a.rsplit(":", 1)[1]) for a in addrs]  # no "*" left: the bound ports, reported back
    assert all(a.startswith("tcp://127.0.0.1:") for a in addrs) and taken_port not in ports, addrs
    assert len(set(ports)) == len(ports), addrs


class _Captured(Exception):
    pass


def test_given_runtime_port_hosts_the_store_the_cards_join(monkeypatch, tmp_path, tiny_model):
    """``runtime.port=N``: the launcher hosts the job's store on N while the job starts; the cards' ``dist_init``
    names it and a client reaches it (no card process is started: the coordinator is a stub)."""
    import npu_train.runtime.job as job
    from conftest import make_cfg
    from npu_train.runtime.jobstore import join_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = {}

    class StubCoordinator:
        def __init__(self, specs, **kw):
            seen["dist_init"] = {sp.dist_init for sp in specs}
            client = join_store(specs[0].dist_init, 10)  # the store is up now, before any card process
            client.set("probe", "ok")
            seen["probe"] = client.get("probe")
            raise _Captured()

    monkeypatch.setattr(job, "Coordinator", StubCoordinator)
    with pytest.raises(_Captured):
        job.run_job(make_cfg(tiny_model, f"runtime.port={port}"), str(tmp_path))
    assert seen == {"dist_init": {f"tcp://127.0.0.1:{port}"}, "probe": b"ok"}
    job.check_port("127.0.0.1", port)  # the store ended with the launch: the port is free again
