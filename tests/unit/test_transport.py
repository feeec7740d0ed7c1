"""Unit tests for npu_train.transport (shared-memory slots + ZeroMQ mailboxes).

Multi-process tests use the ``spawn`` start method (as the real launcher does);
worker functions live at module level so spawned children can import them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
import uuid
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

try:  # allow running without `pip install -e .`; spawned children inherit sys.path
    import npu_train  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from npu_train.transport import (  # noqa: E402
    Endpoint,
    Mailbox,
    Outbox,
    ShmSegment,
    ShmTooSmallError,
    SlotRing,
    TensorLink,
    TransportError,
    TransportTimeout,
    new_token,
    segment_name,
    segment_names_for_job,
    unlink_job_segments,
)

SLOT_BYTES = 8192
N_MSGS = 50
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


# ----------------------------------------------------------------------------- helpers
def make_tensor(tag: str, i: int) -> torch.Tensor:
    """Deterministic test tensor #i for stream ``tag``; varying shape/dtype, with NaN/inf."""
    g = torch.Generator().manual_seed(i * 2 + (0 if tag == "act" else 1))
    dtype = _DTYPES[i % len(_DTYPES)]
    shape = (1 + i % 3, 7 + i % 5, 16)  # at most 3*11*16*8 = 4224 bytes < SLOT_BYTES
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    flat = t.view(-1)
    flat[0], flat[1], flat[2] = float("nan"), float("inf"), -0.0
    return t


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def new_job_id() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def job_id():
    jid = new_job_id()
    yield jid
    unlink_job_segments(jid)


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _addrs(mode: str, run_dir: str):
    """(bind address for rank 0, bind address for rank 1) per transport mode."""
    if mode == "shm":
        return Endpoint.ipc(run_dir, 0), Endpoint.ipc(run_dir, 1)
    return Endpoint.tcp("127.0.0.1", "*"), Endpoint.tcp("127.0.0.1", "*")


_CHILD_BOOT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_npt_transport_test_child", PATH)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
getattr(mod, NAME)(*ARGS)
"""


def _spawn(target, *args):
    """A spawn-context Process running ``target(*args)``.

    The child loads this file by path (``builtins.exec`` is the picklable
    target), so it works whatever pytest import mode made this module's name.
    """
    ctx = mp.get_context("spawn")
    return ctx.Process(target=exec, args=(_CHILD_BOOT, {"PATH": __file__, "NAME": target.__name__, "ARGS": args}))


def _get(q, p, timeout=30.0):
    """Next message from child ``p`` via ``q``; fails fast if the child died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.2)
        except Exception:
            if not p.is_alive():
                try:
                    return q.get(timeout=0.5)
                except Exception:
                    pytest.fail(f"child exited with code {p.exitcode} before reporting")
    pytest.fail("child did not report in time")


def _join(p, q, timeout=40.0):
    """Wait for child ``p``; return its messages from ``q``; fail with its traceback on error."""
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5)
        pytest.fail("child process hung")
    msgs = []
    while True:
        try:
            msgs.append(q.get(timeout=0.5))
        except Exception:
            break
    errs = [m for m in msgs if m[0] == "error"]
    assert not errs, errs[0][1]
    assert p.exitcode == 0, msgs
    return msgs


# --------------------------------------------------------------- child process bodies
def _stage1_main(mode, job_id, bind_addr, peer_addr, token, n, q):
    """Stage 1: receive n activations, answer each with a gradient."""
    ctx = zmq.Context()
    try:
        with Mailbox(ctx, bind_addr, token) as inbox, Outbox(ctx, peer_addr, token, src_rank=1) as to0:
            q.put(("addr", inbox.addr))
            acts = TensorLink(mode, job_id, "s0to1.act", SLOT_BYTES, 2)
            grads = TensorLink(mode, job_id, "s1to0.grad", SLOT_BYTES, 2).open_sender()
            bad = []
            for i in range(n):
                a = acts.recv("act", 0, i, inbox, to0, timeout_s=20)
                if not bit_equal(a, make_tensor("act", i)):
                    bad.append(i)
                grads.send(make_tensor("grad", i), "grad", 0, i, to0, inbox, timeout_s=20)
            grads.wait_released(inbox, timeout_s=20)
            acts.close()
            grads.close()
            q.put(("done", bad))
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
    finally:
        ctx.destroy(linger=2000)


def _blocking_sender_main(mode, job_id, bind_addr, peer_addr, token, q, sent2, sent3):
    """Send micros 0,1,2 on a K=2 link; record when each send returned."""
    ctx = zmq.Context()
    try:
        with Mailbox(ctx, bind_addr, token) as inbox, Outbox(ctx, peer_addr, token, src_rank=0) as out:
            q.put(("addr", inbox.addr))
            link = TensorLink(mode, job_id, "blk", SLOT_BYTES, n_slots=2).open_sender()
            for i in range(3):
                link.send(make_tensor("act", i), "act", 0, i, out, inbox, timeout_s=20)
                q.put(("sent", i, time.monotonic()))
                if i == 1:
                    sent2.set()
            sent3.set()
            link.wait_released(inbox, timeout_s=20)
            link.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
    finally:
        ctx.destroy(linger=2000)


# ------------------------------------------------------------------------ two processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_two_processes_bidirectional(mode, job_id, zctx, tmp_path):
    """50 tensors each way, K=2, bit-identical; shm over ipc://, inline over tcp://127.0.0.1."""
    token = new_token()
    bind0, bind1 = _addrs(mode, str(tmp_path))
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    with Mailbox(zctx, bind0, token) as inbox:
        acts = TensorLink(mode, job_id, "s0to1.act", SLOT_BYTES, 2).open_sender()
        grads = TensorLink(mode, job_id, "s1to0.grad", SLOT_BYTES, 2)
        p = _spawn(_stage1_main, mode, job_id, bind1, inbox.addr, token, N_MSGS, q)
        p.start()
        try:
            kind, addr1 = _get(q, p)
            assert kind == "addr", addr1
            with Outbox(zctx, addr1, token, src_rank=0) as to1:
                # 1F1B-like interleaving: act i out, then grad i-1 back.
                got = {}
                for i in range(N_MSGS):
                    acts.send(make_tensor("act", i), "act", 0, i, to1, inbox, timeout_s=20)
                    assert acts.in_flight <= 2
                    if i >= 1:
                        got[i - 1] = grads.recv("grad", 0, i - 1, inbox, to1, timeout_s=20)
                got[N_MSGS - 1] = grads.recv("grad", 0, N_MSGS - 1, inbox, to1, timeout_s=20)
                acts.wait_released(inbox, timeout_s=20)
                msgs = _join(p, q)
        finally:
            if p.is_alive():
                p.kill()
        assert [m for m in msgs if m[0] == "done"] == [("done", [])]
        for i in range(N_MSGS):
            assert bit_equal(got[i], make_tensor("grad", i)), f"grad {i} differs"
        acts.close()
        grads.close()
        assert inbox.rejected == 0
    assert segment_names_for_job(job_id) == []  # senders unlinked their rings


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_sender_blocks_until_receiver_releases(mode, job_id, zctx, tmp_path):
    """K=2: the 3rd send cannot complete before the receiver's first recv released a slot."""
    token = new_token()
    bind_recv, bind_send = _addrs(mode, str(tmp_path))
    spawn = mp.get_context("spawn")
    q, sent2, sent3 = spawn.Queue(), spawn.Event(), spawn.Event()
    link = TensorLink(mode, job_id, "blk", SLOT_BYTES, n_slots=2)
    with Mailbox(zctx, bind_recv, token) as inbox:
        p = _spawn(_blocking_sender_main, mode, job_id, bind_send, inbox.addr, token, q, sent2, sent3)
        p.start()
        try:
            kind, addr = _get(q, p)
            assert kind == "addr", addr
            with Outbox(zctx, addr, token, src_rank=1) as reply:
                assert sent2.wait(30), "first two sends should not block (K=2)"
                # The receiver 'sleeps' without receiving: the sender must stay blocked.
                time.sleep(0.5)
                assert not sent3.is_set(), "3rd send completed although no slot was released"
                t_release = time.monotonic()  # the first slot is released inside this recv
                x0 = link.recv("act", 0, 0, inbox, reply, timeout_s=20)
                assert sent3.wait(20), "3rd send never completed after a slot was released"
                x1 = link.recv("act", 0, 1, inbox, reply, timeout_s=20)
                x2 = link.recv("act", 0, 2, inbox, reply, timeout_s=20)
                msgs = _join(p, q)
        finally:
            if p.is_alive():
                p.kill()
    sent = {m[1]: m[2] for m in msgs if m[0] == "sent"}
    assert sorted(sent) == [0, 1, 2]
    assert sent[2] >= t_release > sent[1]  # CLOCK_MONOTONIC is system-wide on Linux
    for i, x in enumerate((x0, x1, x2)):
        assert bit_equal(x, make_tensor("act", i))
    link.close()


# ------------------------------------------------------------------ single-process tests
def _pair(zctx, tmp_path, token):
    """Two inboxes (A = sender side, B = receiver side) and outboxes A->B, B->A."""
    a = Mailbox(zctx, Endpoint.ipc(str(tmp_path), 0), token)
    b = Mailbox(zctx, Endpoint.ipc(str(tmp_path), 1), token)
    a2b = Outbox(zctx, b.addr, token, src_rank=0)
    b2a = Outbox(zctx, a.addr, token, src_rank=1)
    return a, b, a2b, b2a


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_out_of_order_micro(mode, job_id, zctx, tmp_path):
    token = new_token()
    a, b, a2b, b2a = _pair(zctx, tmp_path, token)
    tx = TensorLink(mode, job_id, "ooo", SLOT_BYTES, n_slots=2).open_sender()
    rx = TensorLink(mode, job_id, "ooo", SLOT_BYTES, n_slots=2)
    # An unrelated control message and micro 1 arrive before micro 0.
    a2b.send("ctl", 5, 0, note="hello")
    tx.send(make_tensor("act", 1), "act", 3, 1, a2b, a, timeout_s=5)
    tx.send(make_tensor("act", 0), "act", 3, 0, a2b, a, timeout_s=5)
    x0, h0 = rx.recv("act", 3, 0, b, b2a, timeout_s=5, return_header=True)
    assert bit_equal(x0, make_tensor("act", 0)) and h0["micro"] == 0 and h0["src"] == 0
    x1 = rx.recv("act", 3, 1, b, b2a, timeout_s=5)
    assert bit_equal(x1, make_tensor("act", 1))
    h, payload = b.recv("ctl", 5, 0, timeout_s=5)
    assert h["note"] == "hello" and payload is None
    tx.wait_released(a, timeout_s=5)
    assert tx.in_flight == 0
    # The received tensors own their memory: later traffic into the same slots does not alter them.
    tx.send(torch.zeros(4, dtype=torch.float32), "act", 4, 0, a2b, a, timeout_s=5)
    tx.send(torch.zeros(4, dtype=torch.float32), "act", 4, 1, a2b, a, timeout_s=5)
    rx.recv("act", 4, 1, b, b2a, timeout_s=5)
    rx.recv("act", 4, 0, b, b2a, timeout_s=5)
    assert bit_equal(x0, make_tensor("act", 0)) and bit_equal(x1, make_tensor("act", 1))
    for o in (tx, rx, a2b, b2a, a, b):
        o.close()
    assert segment_names_for_job(job_id) == []


@pytest.mark.timeout(30)
def test_stranger_messages_rejected(zctx, tmp_path, caplog):
    token = new_token()
    logger = logging.getLogger("test.transport.stranger")
    inbox = Mailbox(zctx, Endpoint.ipc(str(tmp_path), 0), token, logger)
    marker = tmp_path / "pwned"

    class Evil:  # unpickling this would create `marker`
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(inbox.addr)
    caplog.set_level(logging.WARNING, logger=logger.name)
    raw.send(b"\x00\xff\xfegarbage that is not msgpack")  # (a) garbage
    raw.send(msgpack.packb({"tok": "0" * 32, "src": 9, "kind": "act", "step": 0, "micro": 0}))  # (b) wrong token
    raw.send(pickle.dumps(Evil()))  # (c) pickle
    raw.send_multipart([pickle.dumps({"tok": token, "kind": "act"}), b"x"])  # (d) pickled header + payload
    raw.send(msgpack.packb([token, "act"]))  # (e) msgpack, but not a map
    # A legitimate message on the same connection (ZeroMQ keeps per-connection order, so all
    # five strangers' messages have been processed once it is returned) ...
    raw.send_multipart([msgpack.packb({"tok": token, "src": 7, "kind": "act", "step": 0, "micro": 0}), b"ok"])
    h, payload = inbox.recv("act", 0, 0, timeout_s=5)
    assert h["src"] == 7 and bytes(payload) == b"ok"
    assert inbox.rejected == 5
    # ... and one from a regular Outbox.
    with Outbox(zctx, inbox.addr, token, src_rank=1) as legit:
        legit.send("act", 0, 1, payload=b"ok2")
        h, payload = inbox.recv("act", 0, 1, timeout_s=5)
    assert h["src"] == 1 and h["tok"] == token and bytes(payload) == b"ok2"
    assert inbox.pending == 0
    warnings = [r for r in caplog.records if "ignored message from unauthenticated peer" in r.getMessage()]
    assert len(warnings) == 5 and all(r.levelno == logging.WARNING for r in warnings)
    assert not marker.exists()
    with pytest.raises(TransportTimeout):
        inbox.recv(None, timeout_s=0.2)  # none of the strangers' messages is ever returned
    raw.close(0)
    inbox.close()


@pytest.mark.timeout(30)
def test_recv_timeout_and_abort(zctx, tmp_path, job_id):
    token = new_token()
    inbox = Mailbox(zctx, Endpoint.ipc(str(tmp_path), 0), token)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="kind='act'"):
        inbox.recv("act", 0, 0, timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3

    class Abort(Exception):
        pass

    calls = []

    def abort_check():
        calls.append(1)
        if len(calls) >= 3:
            raise Abort

    with pytest.raises(Abort):
        inbox.recv("act", 0, 0, timeout_s=30, abort_check=abort_check)
    # A sender whose receiver never releases times out waiting for a credit.
    peer = Mailbox(zctx, Endpoint.ipc(str(tmp_path), 1), token)
    with Outbox(zctx, peer.addr, token, src_rank=0) as out:
        link = TensorLink("shm", job_id, "to", SLOT_BYTES, n_slots=1).open_sender()
        link.send(torch.ones(3), "act", 0, 0, out, inbox, timeout_s=1)
        with pytest.raises(TransportTimeout, match="slots still held"):
            link.send(torch.ones(3), "act", 0, 1, out, inbox, timeout_s=0.3)
        link.close()
    peer.close()
    inbox.close()


@pytest.mark.timeout(30)
def test_link_validation(zctx, tmp_path, job_id):
    token = new_token()
    a, b, a2b, b2a = _pair(zctx, tmp_path, token)
    tx = TensorLink("shm", job_id, "val", 64, n_slots=2).open_sender()
    with pytest.raises(ValueError, match="slot_bytes is 64"):
        tx.send(torch.zeros(17, dtype=torch.float32), "act", 0, 0, a2b, a, timeout_s=1)
    assert tx.in_flight == 0
    with pytest.raises(ValueError, match="unsupported dtype"):
        tx.send(torch.zeros(2, dtype=torch.complex64), "act", 0, 0, a2b, a, timeout_s=1)
    with pytest.raises(TransportError):
        tx.recv("act", 0, 0, b, b2a, timeout_s=0.1)  # sender end cannot receive
    # Non-contiguous and 0-d / empty tensors round-trip.
    rx = TensorLink("shm", job_id, "val", 64, n_slots=2)
    nc = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    tx.send(nc, "act", 0, 0, a2b, a, timeout_s=1)
    tx.send(torch.tensor(2.5, dtype=torch.bfloat16), "act", 0, 1, a2b, a, timeout_s=1)
    assert torch.equal(rx.recv("act", 0, 0, b, b2a, timeout_s=2), nc)
    s = rx.recv("act", 0, 1, b, b2a, timeout_s=2)
    assert s.shape == () and s.dtype == torch.bfloat16 and s.item() == 2.5
    tx.send(torch.empty(0, 5, dtype=torch.int64), "act", 0, 2, a2b, a, timeout_s=2)
    assert rx.recv("act", 0, 2, b, b2a, timeout_s=2).shape == (0, 5)
    for o in (tx, rx, a2b, b2a, a, b):
        o.close()
    with pytest.raises(ValueError):
        TensorLink("shm", "bad_job", "x", 64)  # '_' not allowed in job ids
    with pytest.raises(ValueError):
        TensorLink("rdma", job_id, "x", 64)


# ----------------------------------------------------------------------- shared memory
@pytest.mark.timeout(30)
def test_segment_mode_and_job_cleanup(job_id):
    names = [segment_name(job_id, "a"), segment_name(job_id, "b")]
    other = new_job_id()
    segs = [ShmSegment.create(n, 4096) for n in names]
    other_seg = ShmSegment.create(segment_name(other, "a"), 4096)
    try:
        for n in names:
            st = os.stat(f"/dev/shm/{n}")
            assert st.st_mode & 0o777 == 0o600
            assert st.st_size == 4096
        with pytest.raises(FileExistsError):
            ShmSegment.create(names[0], 4096)
        assert segment_names_for_job(job_id) == sorted(names)
        # Attach sees the owner's writes.
        segs[0].buf[:5] = b"hello"
        with ShmSegment.attach(names[0]) as att:
            assert bytes(att.buf[:5]) == b"hello" and att.size == 4096 and not att.owner
        assert unlink_job_segments(job_id) == 2
        assert segment_names_for_job(job_id) == []
        assert not os.path.exists(f"/dev/shm/{names[0]}")
        assert unlink_job_segments(job_id) == 0
        assert segment_names_for_job(other) == [segment_name(other, "a")]  # other job untouched
    finally:
        for s in segs:
            s.close()
        other_seg.close()
        other_seg.unlink()


@pytest.mark.timeout(30)
def test_shm_too_small(job_id, monkeypatch):
    class FakeStatvfs:
        f_bavail = 16  # 16 blocks of 4 KiB = 64 KiB "free"
        f_frsize = 4096
        f_bsize = 4096

    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: FakeStatvfs() if str(p).startswith("/dev/shm") else real_statvfs(p))
    name = segment_name(job_id, "big")
    with pytest.raises(ShmTooSmallError) as ei:
        ShmSegment.create(name, 1 << 20)
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert err.required == 1 << 20 and err.available == 65536
    msg = str(err)
    assert "1048576" in msg and "65536" in msg
    assert "--shm-size" in msg and "emptyDir" in msg and "micro_batch" in msg
    assert segment_names_for_job(job_id) == []
    with pytest.raises(ShmTooSmallError):  # also through the link API, at open time
        TensorLink("shm", job_id, "big", 1 << 20, n_slots=2).open_sender()
    ShmSegment.create(name, 4096).__exit__(None, None, None)  # small enough: fine (and unlinked)
    assert segment_names_for_job(job_id) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_slot_ring_roundtrip(dtype, job_id):
    name = segment_name(job_id, "ring")
    with SlotRing.create(name, slot_bytes=1000, n_slots=3) as ring:
        assert ring.stride == 1024 and ring.segment.size == 3 * 1024
        reader = SlotRing.attach(name, 1000, 3)
        data = [(torch.randn(5, 20) * 1000).to(dtype) for _ in range(3)]
        for i, t in enumerate(data):
            ring.write(i, t)
        for i, t in enumerate(data):
            v = reader.view(i, t.shape, dtype)
            assert bit_equal(v, t)
            c = v.clone()
            ring.write(i, torch.zeros_like(t))
            assert bool((v == 0).all())  # zero-copy: the view tracks the writer
            assert bit_equal(c, t)  # the clone does not
            del v
        with pytest.raises(ValueError, match="does not fit"):
            ring.write(0, torch.zeros(300, dtype=torch.float32))
        with pytest.raises(IndexError):
            ring.write(3, torch.zeros(1))
        reader.close()
    assert segment_names_for_job(job_id) == []


@pytest.mark.timeout(30)
def test_endpoints(zctx, job_id, tmp_path):
    run_dir = Endpoint.make_run_dir(job_id, base=str(tmp_path))
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    addr = Endpoint.ipc(run_dir, 3)
    assert addr == f"ipc://{run_dir}/r3.sock"
    with Mailbox(zctx, addr, new_token()) as mb:
        assert mb.addr == addr
        assert os.stat(f"{run_dir}/r3.sock").st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="AF_UNIX"):
        Endpoint.ipc("/tmp/" + "x" * 120, 0)
    assert Endpoint.tcp("10.0.0.2", 5555) == "tcp://10.0.0.2:5555"
    assert Endpoint.tcp("::1", 5555) == "tcp://[::1]:5555"
    assert 0 < Endpoint.free_tcp_port() < 65536
    assert len(new_token()) == 32 and new_token() != new_token()
