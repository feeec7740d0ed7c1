"""Strangers on the job's sockets (issue #4).

Shared-memory segments are created 0600 and named with the per-job random id; control sockets
are ipc sockets in a private 0700 directory (``runtime.transport=shm``) or tcp on loopback
(``runtime.transport=inline``); a peer must present the job's random token before anything it
sends is acted on; nothing received is unpickled.

The test connects a stranger to every card process's inbox and to the coordinator while the
job runs (their addresses come from ``<run_dir>/job.json``, which never holds the token), sends
garbage, wrong-token and token-less msgpack, multi-frame junk and a pickle whose unpickling would
create a file. All of it must be ignored and logged, and the job must still finish with the
losses of the single-process reference.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
import stat
import time

import msgpack
import pytest
import zmq

from conftest import reference_for
from launch_util import Job

pytestmark = pytest.mark.timeout(180)

_REF = {}


class _Evil:
    """Unpickling this creates ``path``: proof that a receiver unpickled what it got."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _stranger_messages(marker: str) -> list[list[bytes]]:
    fake = "0" * 32  # right shape, wrong value
    evil = pickle.dumps(_Evil(marker))
    return [
        [b"\x00\xffgarbage\x13\x37"],
        [evil],
        [b"header", evil],
        [b"a", b"b", b"c"],
        [msgpack.packb({"tok": fake, "src": 0, "kind": "act", "step": 0, "micro": 0, "link": "act0", "slot": 0,
                        "shape": [2, 32, 64], "dtype": "float32", "nbytes": 16384, "seq": 0})],
        [msgpack.packb({"src": 1, "kind": "free:act0", "step": 0, "micro": 0, "slot": 0})],
        [msgpack.packb({"tok": fake, "rank": 0, "type": "stop"})],
        [msgpack.packb({"tok": fake, "rank": 1, "type": "error", "etype": "X", "message": "forged"})],
        [msgpack.packb({"tok": None, "rank": 0, "type": "done"})],
        [msgpack.packb(["not", "a", "map"])],
    ]


def _attack(addr: str, marker: str) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(addr)
    for frames in _stranger_messages(marker):
        s.send_multipart(frames)
    s.close()  # linger: delivered before close returns
    if addr.startswith("tcp://"):  # a raw, non-ZMTP client too
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + pickle.dumps(_Evil(marker)))


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_strangers_are_ignored(tiny_model, tmp_path, transport):
    marker = str(tmp_path / "UNPICKLED")
    # card 0 pauses 4 s in its first forward (test-only NPT_FAULT sleep): the job is up, every
    # socket is bound, and card 1 is waiting in its inbox while the strangers talk
    job = Job(tmp_path, tiny_model, "train.steps=3", f"runtime.transport={transport}",
              env={"NPT_FAULT": "rank=0,phase=forward,step=1,action=sleep:4"})
    try:
        job.job_info()
        job.wait_for(lambda: "NPT_FAULT: sleep" in job.stderr, 90, "card 0 to pause")
        # what the stranger can see while the job runs: TCP mailboxes bind ports the kernel picks, and job.json
        # names them once every card reported its own
        path = os.path.join(job.run_dir, "job.json")
        job.wait_for(lambda: ":*" not in open(path).read(), 30, "job.json to name the bound addresses")
        raw = open(path).read()
        info = json.loads(raw)
        assert "token" not in raw and not re.search(r"\b[0-9a-f]{32}\b", raw)
        if transport == "shm":
            st = os.stat(info["ipc_dir"])
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
            segs = [f for f in os.listdir("/dev/shm") if f.startswith(info["shm_prefix"])]
            assert segs and all(stat.S_IMODE(os.stat(f"/dev/shm/{f}").st_mode) == 0o600 for f in segs)
            assert all(c["inbox"].startswith(f"ipc://{info['ipc_dir']}/") for c in info["cards"])
            assert info["coord_addr"].startswith(f"ipc://{info['ipc_dir']}/")
        else:
            assert all(c["inbox"].startswith("tcp://127.0.0.1:") for c in info["cards"])
            assert info["coord_addr"].startswith("tcp://127.0.0.1:")
        for addr in [c["inbox"] for c in info["cards"]] + [info["coord_addr"]]:
            _attack(addr, marker)
        rc = job.wait(120)
    finally:
        job.kill_all()
    assert rc == 0, job.tail()
    assert not os.path.exists(marker), "something unpickled a received message"
    # ignored and logged: by each card's inbox and by the coordinator
    err = job.stderr
    for c in info["cards"]:
        assert re.search(rf"ignored message from unauthenticated peer .* on {re.escape(c['inbox'])}", err), \
            (c["inbox"], err[-3000:])
    assert re.search(r"note: ignored \d+ unauthenticated message", err)
    assert "coordinator: ignored a message from an unauthenticated peer" in job.stdout
    # and the job computed exactly what it would have computed alone
    if "ref" not in _REF:
        _REF["ref"] = reference_for(tiny_model)  # train.steps=3, same settings as launch_util.BASE
    ref_losses, _ = _REF["ref"]
    losses = job.losses()
    assert len(losses) == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
