"""Vocabulary parallelism's shared-memory exchange (pipeline/vocabshm.py, ``runtime.vocab_exchange=shm``) in P
spawned gloo processes (as card processes), against the whole-vocabulary formulas in fp64 and against the gloo
exchange on the same inputs: several micro-batches through :class:`~npu_train.pipeline.vocab.VocabWork` (hidden
states posted ahead, slots reused), the loss, every card's weight gradient and the head's summed input gradient.
fp32: the loss and the weight gradients equal the gloo path bit for bit (the statistics still go through gloo and
nothing else differs), the head's input gradient too at P = 2 (a + b either way), to 1e-6 at P = 3 (gloo sums in
an order of its own). Also: a schedule that reads a partial late with too few slots raises instead of overwriting;
segments are gone after ``close()`` and, after a card dies without it, after the launcher's cleanup
(``unlink_job_segments``: what teardown, an orphaned card and the next launch's sweep call)."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import secrets
import sys

import pytest
import torch

try:  # spawned children inherit sys.path
    import npu_train  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from npu_train.pipeline.vocab import vocab_rows
from npu_train.transport.shm import segment_names_for_job, unlink_job_segments

b, S, H, V, M = 2, 6, 16, 37, 5  # V % P != 0: uneven slices


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(b, S, H, generator=g).to(dtype) for _ in range(M)]
    W = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    ys = [torch.randint(0, V, (b, S), generator=g) for _ in range(M)]
    ys[1][0, :3] = -100
    return xs, W, ys, float(sum(int((y != -100).sum()) for y in ys))


def _reference(xs, W, ys, divisor):
    """Per micro-batch: the summed cross-entropy ``sum_n logsumexp(z_n) - z_{n, y_n}`` over counted targets, its
    input gradient ``dz W`` with ``dz = (softmax(z) - onehot(y)) valid / divisor``; and the step's ``sum dz^T x``."""
    losses, dxs, dW = [], [], torch.zeros(W.shape, dtype=torch.float64)
    for x, y in zip(xs, ys):
        x2 = x.double().reshape(-1, H)
        z = x2 @ W.double().t()
        y = y.reshape(-1)
        valid = y != -100
        ys_ = torch.where(valid, y, torch.zeros_like(y))
        losses.append(float(((torch.logsumexp(z, 1) - z[torch.arange(len(y)), ys_]) * valid).sum()))
        p = torch.softmax(z, 1)
        p[torch.arange(len(y)), ys_] -= 1.0
        dz = p * valid.unsqueeze(1) / divisor
        dxs.append(dz @ W.double())
        dW += dz.t() @ x2
    return losses, dxs, dW


def _card(rank, P, head, init, q, job, hows, slots, order, dtype, die):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P)
    try:
        res = {how: _one(rank, P, head, q, job, how, slots, order, dtype, die) for how in hows}
        # by value: a tensor put on the queue as is travels as a handle to this process's shared memory, which is
        # gone once this process has exited (FileNotFoundError / ConnectionResetError in the parent's get())
        buf = io.BytesIO()
        torch.save(res, buf)
        q.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def _one(rank, P, head, q, job, how, slots, order, dtype, die):
    """One card's M micro-batches over the ``how`` (shm | gloo) exchange: its losses, the head's input gradients,
    the weight gradient, or the error it raised."""
    import torch.distributed as dist

    from npu_train.pipeline.vocab import GlooExchange, VocabWork
    from npu_train.pipeline.vocabshm import ShmExchange

    g, gx = dist.new_group(list(range(P))), dist.new_group(list(range(P)))
    if how == "shm":
        ex = ShmExchange(g, head, gx, job, "vx0", b * S * H * torch.empty((), dtype=dtype).element_size(), slots)
    else:
        ex = GlooExchange(g, head, xgroup=gx)
    if die:  # a card process that dies without closing: its segments stay for the launcher to remove
        q.put((rank, segment_names_for_job(job)))
        q.close()
        q.join_thread()
        os._exit(0)
    xs, W, ys, divisor = _inputs(dtype)
    a, e = vocab_rows(V, P, rank)
    w = torch.nn.Parameter(W[a:e].clone())
    work = VocabWork(w, a, ex, rank == head)
    losses, dxs, err = [], [], None
    try:
        if rank != head:
            work.post_x(0, None, (b, S))
        for m in range(M):  # "1f1b": the head takes each sum before the next V; "gpipe": all at the end
            if rank == head:
                work.post_x(m, xs[m], (b, S))
            losses.append(work.run(m, ys[m], divisor))
            if rank != head and m + 1 < M:
                work.post_x(m + 1, None, (b, S))
            if rank == head and order == "1f1b":
                dxs.append(work.take_dx(m).float().clone())
        if rank == head and order == "gpipe":
            dxs = [work.take_dx(m).float().clone() for m in range(M)]
        work.finish()
    except RuntimeError as exc:
        err = str(exc)
    if err is None:
        dist.barrier()
    if how == "shm":
        ex.close()
    return {"losses": losses, "dxs": dxs, "dw": w.grad.float().clone() if w.grad is not None else None, "err": err}


def _spawn(tmp_path, P, head, how=("shm",), slots=1, order="1f1b", dtype=torch.float32, die=False, want=None):
    """{rank: result} of P spawned card processes (``want``: only these ranks' results, the others killed) and
    the job id their segments were named by."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = "t" + secrets.token_hex(4)
    init = f"file://{tmp_path}/rdv-{job}"
    ps = [ctx.Process(target=_card, args=(r, P, head, init, q, job, how, slots, order, dtype, die))
          for r in range(P)]
    for p in ps:
        p.start()
    try:
        out = dict(q.get(timeout=120) for _ in (ps if want is None else want))
        out = {r: torch.load(io.BytesIO(v)) if isinstance(v, bytes) else v for r, v in out.items()}
    finally:
        for p in ps:
            p.join(timeout=30 if want is None else 5)
            if p.is_alive():
                p.kill()
    return out, job


@pytest.mark.parametrize("P,head", [(2, 1), (3, 2), (3, 0)])
def test_shm_exchange_equals_the_formulas_and_gloo(tmp_path, P, head):
    xs, W, ys, divisor = _inputs()
    losses, dxs, dW = _reference(xs, W, ys, divisor)
    out, job = _spawn(tmp_path, P, head, ("shm", "gloo"))
    shm, gloo = ({r: out[r][how] for r in out} for how in ("shm", "gloo"))
    assert segment_names_for_job(job) == []  # every card unlinked its own segment at close()
    for r in range(P):
        assert shm[r]["err"] is None, shm[r]["err"]
        assert shm[r]["losses"] == pytest.approx(losses, rel=1e-6)
        assert shm[r]["losses"] == gloo[r]["losses"]  # bit for bit: the same statistics through gloo
        a, e = vocab_rows(V, P, r)
        torch.testing.assert_close(shm[r]["dw"].double(), dW[a:e], rtol=1e-6, atol=1e-7)
        assert torch.equal(shm[r]["dw"], gloo[r]["dw"])
    for got, ref, g in zip(shm[head]["dxs"], dxs, gloo[head]["dxs"]):
        torch.testing.assert_close(got.double().reshape(-1, H), ref, rtol=1e-6, atol=1e-7)
        if P == 2:
            assert torch.equal(got, g)
        else:
            torch.testing.assert_close(got, g, rtol=1e-6, atol=1e-7)


def test_bf16_partials_are_summed_in_bf16(tmp_path):
    """bf16: the hidden state travels exactly (the head's bf16 tensor); the head sums the P bf16 partials in bf16
    (as gloo's reduce does), so within bf16 rounding (2^-8 relative per partial and per sum) of the fp64 formula."""
    xs, W, ys, divisor = _inputs(torch.bfloat16)
    losses, dxs, _ = _reference([x.float() for x in xs], W.float(), ys, divisor)
    out, job = _spawn(tmp_path, 3, 2, dtype=torch.bfloat16)
    out = {r: v["shm"] for r, v in out.items()}
    assert out[2]["err"] is None, out[2]["err"]
    assert out[0]["losses"] == pytest.approx(losses, rel=1e-5)
    for got, ref in zip(out[2]["dxs"], dxs):
        scale = float(ref.abs().max())
        assert float((got.double().reshape(-1, H) - ref).abs().max()) <= 3 * 2 ** -8 * scale
    assert segment_names_for_job(job) == []


def test_a_late_read_with_too_few_slots_raises_and_enough_slots_run(tmp_path):
    """The head takes every sum at the end (GPipe's order): with one partial-gradient slot the second card would
    overwrite partial 0 before the head read it, and raises; with ``reduce_slots('gpipe', ...)`` = M slots it runs
    and equals the formulas."""
    from npu_train.pipeline.vocabshm import reduce_slots

    xs, W, ys, divisor = _inputs()
    _, dxs, _ = _reference(xs, W, ys, divisor)
    bad, job = _spawn(tmp_path, 2, 1, slots=1, order="gpipe", want=[0])  # the head waits for it: killed
    bad = {r: v["shm"] for r, v in bad.items()}
    assert "would overwrite partial input gradient 0" in (bad[0]["err"] or "")
    unlink_job_segments(job)
    k = reduce_slots("gpipe", 2, M, 1)
    assert k == M
    ok, job = _spawn(tmp_path, 2, 1, slots=k, order="gpipe")
    ok = {r: v["shm"] for r, v in ok.items()}
    assert ok[1]["err"] is None, ok[1]["err"]
    for got, ref in zip(ok[1]["dxs"], dxs):
        torch.testing.assert_close(got.double().reshape(-1, H), ref, rtol=1e-6, atol=1e-7)
    assert segment_names_for_job(job) == []


def test_reduce_slots_from_the_schedules():
    """1F1B and the zero-bubble schedules take each sum right after their V: one slot; GPipe takes them at the end."""
    from npu_train.pipeline.schedule import card_of, chunks_per_card
    from npu_train.pipeline.vocabshm import reduce_slots

    for kind in ("1f1b", "zb", "zb-h1", "zb-h2", "zbv", "interleaved"):
        for P, Mm in ((2, 4), (4, 8), (8, 32)):
            head = card_of(kind, P, P * chunks_per_card(kind) - 1)[0]
            assert reduce_slots(kind, P, Mm, head) == 1, (kind, P, Mm)
    assert reduce_slots("gpipe", 4, 8, 3) == 8


def test_segments_of_a_dead_card_are_removed_by_the_job_cleanup(tmp_path):
    """Cards that die without ``close()`` leave their segments (``npt_<job>_vx0-c<i>``); the launcher's teardown
    (and an orphaned card, and the next launch's sweep) remove every ``npt_<job>_*``: nothing is left."""
    out, job = _spawn(tmp_path, 2, 1, die=True)
    names = segment_names_for_job(job)
    assert names == [f"npt_{job}_vx0-c0", f"npt_{job}_vx0-c1"]
    assert unlink_job_segments(job) == 2
    assert segment_names_for_job(job) == []

