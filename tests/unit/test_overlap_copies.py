"""Stage-boundary copies in a copy thread (``runtime/copies.py``): P card threads in one process, each with its
real :class:`~npu_train.runtime.links.LinkComm` (ZeroMQ mailboxes, shared-memory slot rings), running
:class:`~npu_train.pipeline.stage.StageRunner` over a tiny Llama.

Overlap is observed by ordering, not by time: every card -> slot copy (``SlotRing.write``) made in a copy thread
waits until its card thread has begun its next action (or the end-of-step flush) and records whether it did; with
the synchronous path the copy runs in the card thread itself. The training must not change: losses and gradients
bitwise equal with and without the copy thread, and equal to the one-module reference (written from the loss's
formula: summed token cross-entropy over the step's target tokens) to 1e-5."""
from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import zmq

import npu_train.pipeline.stage as stage_mod
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.pipeline.schedule import card_of, chunks_per_card
from npu_train.planner.cost import layer_ranges
from npu_train.runtime.copies import BoundaryCopies, overlap_decision
from npu_train.runtime.layout import ParallelLayout
from npu_train.runtime.links import LinkComm
from npu_train.transport import Endpoint, Mailbox, Outbox, TensorLink
from npu_train.transport import shm as shm_mod
from stage_threads import run_stage_threads

VOCAB, SEQ, MB, LAYERS = 64, 8, 2, 6
TIMEOUT_S = 30.0
WAIT_S = 10.0  # a copy thread's write waits at most this long for its card to move on (then records False)

_where = threading.local()  # .stage: the card a thread belongs to; .copy: a copy thread


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the card threads share one process


class _Backend:
    """A cpu card for LinkComm / StageRunner, with ``memory_flag_thread_local`` as given and a ``kind``."""

    def __init__(self, stage: int, thread_local=True, kind="cpu"):
        self.stage, self.memory_flag_thread_local, self.kind = stage, thread_local, kind

    def device(self):
        return torch.device("cpu")

    def upload(self, t):
        return t.clone()

    def synchronize(self):
        pass

    def thread_init(self):
        _where.stage, _where.copy = self.stage, True


class _Spec:
    """The fields of a WorkerSpec that LinkComm reads."""

    def __init__(self, rank, P, schedule, run_dir, job_id, token, slot_bytes, slots):
        self.rank, self.stage_index, self.replica, self.num_stages = rank, rank, 0, P
        self.layout = ParallelLayout(1, P)
        self.runtime = SimpleNamespace(recv_timeout_s=TIMEOUT_S, transport="shm")
        self.train = SimpleNamespace(schedule=schedule)
        self.inbox = tuple(Endpoint.ipc(run_dir, r) for r in range(P))
        self.token, self.job_id, self.slot_bytes, self.slots = token, job_id, slot_bytes, slots

    def boundary_mode(self, b):
        return "shm"


class _Moves:
    """Per card: how many actions its card thread has begun (and end-of-step flushes); every slot write records
    ``("copy", moved on while it ran)`` in a copy thread, ``("card", None)`` in a card thread."""

    def __init__(self, P):
        self.cv = threading.Condition()
        self.count = [0] * P
        self.writes = [[] for _ in range(P)]
        self.at_send = [[] for _ in range(P)]  # per card, its count at each send handed to the copy thread

    def bump(self):
        with self.cv:
            self.count[_where.stage] += 1
            self.cv.notify_all()


@pytest.fixture
def moves(monkeypatch):
    holder = {}
    real_write = shm_mod.SlotRing.write

    def write(ring, slot, tensor):
        mv = holder["m"]
        s = _where.stage
        if getattr(_where, "copy", False):
            with mv.cv:
                n0 = mv.at_send[s].pop(0)  # the card's count when it handed this send over
                ok = mv.cv.wait_for(lambda: mv.count[s] > n0, WAIT_S)
            mv.writes[s].append(("copy", ok))
        else:
            mv.writes[s].append(("card", None))
        return real_write(ring, slot, tensor)

    monkeypatch.setattr(shm_mod.SlotRing, "write", write)
    for name in ("forward", "backward", "weight"):
        real = getattr(stage_mod._StepRun, name)

        def wrapped(self, *a, _real=real, **k):
            holder["m"].bump()
            return _real(self, *a, **k)

        monkeypatch.setattr(stage_mod._StepRun, name, wrapped)
    real_send = BoundaryCopies.send

    def send(self, *a, **k):
        mv = holder["m"]
        with mv.cv:
            mv.at_send[_where.stage].append(mv.count[_where.stage])
        return real_send(self, *a, **k)

    monkeypatch.setattr(BoundaryCopies, "send", send)
    real_flush = BoundaryCopies.flush

    def flush(self):
        holder["m"].bump()
        return real_flush(self)

    monkeypatch.setattr(BoundaryCopies, "flush", flush)

    def make(P):
        holder["m"] = _Moves(P)
        return holder["m"]

    return make


def _cfg():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=LAYERS, num_heads=4,
                       num_kv_heads=2, tie_word_embeddings=False, max_position_embeddings=64)


def _weights(cfg, seed):
    torch.manual_seed(seed)
    full = StageModule(cfg, 0, cfg.num_layers, True, True)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return {n: p.detach().clone() for n, p in full.named_parameters()}


def _data(M, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in range(M)]
    labels = [torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in range(M)]
    for m, y in enumerate(labels):
        y[:, : m % 3] = -100
    return inputs, labels


def _reference(cfg, weights, inputs, labels):
    """Summed token cross-entropy of the whole model on the step's rows, and the gradients of it / target tokens."""
    model = StageModule(cfg, 0, cfg.num_layers, True, True)
    model.load_named_tensors({n: weights[n] for n in model.param_names()})
    x, y = torch.cat(inputs), torch.cat(labels)
    ce = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    (ce / (y != -100).sum()).backward()
    return float(ce.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_cards(cfg, weights, inputs, labels, P, schedule, overlap, thread_local=True):
    """One step of P card threads over real links; returns (loss_sum, merged {name: grad}, [LinkComm stats])."""
    ranges = layer_ranges(schedule, [LAYERS // P] * P)
    V = P * chunks_per_card(schedule)
    head = card_of(schedule, P, V - 1)[0]
    job = f"ovl{uuid.uuid4().hex[:8]}"
    run_dir = tempfile.mkdtemp(prefix="ovl", dir="/tmp")
    token = uuid.uuid4().hex
    ctx = zmq.Context()
    nbytes = MB * SEQ * cfg.hidden_size * 4
    barrier = threading.Barrier(P)
    results, comms = [None] * P, [None] * P

    def card(s):
        _where.stage, _where.copy = s, False
        comm = None
        try:
            be = _Backend(s, thread_local)
            comm = comms[s] = LinkComm(_Spec(s, P, schedule, run_dir, job, token, nbytes, 2), ctx, be, overlap=overlap)
            barrier.wait(TIMEOUT_S)
            (a, b), second = ranges[s][0], ranges[s][1] if len(ranges[s]) > 1 else None
            mod = StageModule(cfg, a, b, s == 0, s == head, second=second)
            mod.load_named_tensors({n: weights[n] for n in mod.param_names()})
            runner = stage_mod.StageRunner(mod, be, P, s, schedule, comm)
            first, last = runner.first, runner.last
            if first or last:
                res = runner.run_step(0, inputs if first else None, labels if last else None,
                                           total_tokens=sum(int((y != -100).sum()) for y in labels))
            else:
                res = runner.run_middle(0, len(inputs))
            results[s] = (res, {n: p.grad for n, p in mod.named_parameters()})
        except BaseException:
            barrier.abort()  # before the close: the other cards stop waiting at once (then raised by the helper)
            raise
        finally:
            if comm is not None:
                comm.stats = (comm.copies.sends, comm.copies.fetched, comm.copies.direct) if comm.copies else None
                comm.close()

    def cleanup():
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)

    run_stage_threads(P, card, barrier.abort, 4 * TIMEOUT_S, cleanup=cleanup, what="a card thread")
    loss = next(res["loss_sum"] for res, _ in results if res["n_tokens"])
    grads = {n: g for _, gs in results for n, g in gs.items()}
    return loss, grads, [c.stats for c in comms]


CASES = [("1f1b", 2, 4), ("1f1b", 3, 5), ("zb", 3, 4), ("zb-h1", 2, 3), ("zbv", 2, 4), ("zbv", 3, 6),
         ("interleaved", 2, 4), ("interleaved", 3, 6)]


@pytest.mark.parametrize("schedule,P,M", CASES)
def test_copy_thread_overlaps_and_changes_nothing(moves, schedule, P, M):
    cfg = _cfg()
    weights = _weights(cfg, seed=P * 10 + M)
    inputs, labels = _data(M, seed=M)
    mv = moves(P)
    sync_loss, sync_grads, _ = run_cards(cfg, weights, inputs, labels, P, schedule, overlap=False)
    assert all(w == ("card", None) for ws in mv.writes for w in ws)  # synchronous: copies in the card threads
    mv = moves(P)
    loss, grads, stats = run_cards(cfg, weights, inputs, labels, P, schedule, overlap=True)
    # every card -> slot copy ran in a copy thread while its card thread went on to its next action
    writes = [w for ws in mv.writes for w in ws]
    assert writes and all(w == ("copy", True) for w in writes), writes
    # each card crossing: 2 per micro-batch and cross-card boundary (activation, gradient)
    V = P * chunks_per_card(schedule)
    crossings = sum(1 for v in range(V - 1) if card_of(schedule, P, v)[0] != card_of(schedule, P, v + 1)[0])
    assert len(writes) == 2 * M * crossings
    assert sum(s[0] for s in stats) == len(writes)  # sends through the copy thread
    assert sum(s[1] + s[2] for s in stats) == len(writes)  # every receive: fetched ahead or direct
    print(schedule, P, M, "sends, fetched ahead, direct per card:", stats)
    assert loss == sync_loss  # bitwise
    assert grads.keys() == sync_grads.keys()
    for n, g in sync_grads.items():
        assert torch.equal(grads[n], g), n
    ref_loss, ref_grads = _reference(cfg, weights, inputs, labels)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    for n, g in ref_grads.items():
        rel = float((grads[n].double() - g.double()).norm() / g.double().norm())
        assert rel < 1e-5, (n, rel)


def test_process_wide_flag_keeps_the_synchronous_copies(moves):
    """``runtime.overlap_copies=true`` on a card whose memory-type flag is process-wide: no copy thread."""
    cfg = _cfg()
    weights = _weights(cfg, seed=3)
    inputs, labels = _data(3, seed=3)
    mv = moves(2)
    loss, grads, stats = run_cards(cfg, weights, inputs, labels, 2, "1f1b", overlap=True, thread_local=False)
    assert stats == [None, None]
    assert mv.writes[0] and all(w == ("card", None) for ws in mv.writes for w in ws)
    ref_loss, _ = _reference(cfg, weights, inputs, labels)
    assert abs(loss - ref_loss) / ref_loss < 1e-5


def test_overlap_decision():
    on = lambda setting, flag, kind: overlap_decision(setting, _Backend(0, flag, kind))[0]  # noqa: E731
    assert on(None, True, "furiosa") and on(True, True, "furiosa") and on(True, True, "cpu")
    assert not on(None, True, "cpu") and not on(None, True, "cuda")  # auto: RNGD cards only
    assert not on(False, True, "furiosa")
    for flag in (False, None):  # process-wide or not probed: never a second thread on the card
        assert not on(True, flag, "furiosa") and not on(None, flag, "furiosa")


def test_an_input_that_arrived_is_fetched_ahead_in_the_copy_thread(monkeypatch):
    """One sender, one receiver in this thread: a message already in the mailbox is copied by the copy thread
    before ``recv`` asks (counted ``fetched``), one that is not yet there is received directly."""
    seen = []
    real = TensorLink.finish

    def finish(self, *a, **k):
        seen.append(getattr(_where, "copy", False))
        return real(self, *a, **k)

    monkeypatch.setattr(TensorLink, "finish", finish)
    ctx = zmq.Context()
    run_dir = tempfile.mkdtemp(prefix="ovl", dir="/tmp")
    job, tok = f"ovl{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    a_box, b_box = Mailbox(ctx, Endpoint.ipc(run_dir, 0), tok), Mailbox(ctx, Endpoint.ipc(run_dir, 1), tok)
    a_out, b_out = Outbox(ctx, b_box.addr, tok, 0), Outbox(ctx, a_box.addr, tok, 1)
    tx, rx = TensorLink("shm", job, "act0", 1024, 2).open_sender(), TensorLink("shm", job, "act0", 1024, 2)
    be = _Backend(1)
    cp = BoundaryCopies(ctx, {0: a_box.addr}, tok, 1, TIMEOUT_S, be.thread_init)
    try:
        x = torch.arange(12.0).reshape(3, 4)
        assert not cp.fetch_ahead(rx, "act", 0, 0, 0, b_box, None)  # nothing sent yet
        tx.send(x, "act", 0, 0, a_out, a_box)
        for _ in range(200):  # until the message is in b's mailbox
            if cp.fetch_ahead(rx, "act", 0, 0, 0, b_box, None):
                break
            threading.Event().wait(0.01)
        got, h = cp.recv(rx, "act", 0, 0, 0, b_box, b_out, None)
        assert torch.equal(got, x) and (cp.fetched, cp.direct) == (1, 0) and seen == [True]
        tx.send(x + 1, "act", 0, 1, a_out, a_box)
        got, _ = cp.recv(rx, "act", 0, 1, 0, b_box, b_out, None)
        assert torch.equal(got, x + 1) and (cp.fetched, cp.direct) == (1, 1) and seen == [True, False]
        tx.wait_released(a_box, TIMEOUT_S)  # both credits came back (one through the copy thread's outbox)
        cp.flush()
    finally:
        cp.close()
        for o in (tx, rx, a_out, b_out, a_box, b_box):
            o.close()
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
