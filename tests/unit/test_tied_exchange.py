"""The tied embedding gradient exchange (npu_train.runtime.tied) between two gloo processes.

Reference, from the definition: both stages end with ``g_first + g_last`` computed in fp32 and cast to
the gradient's dtype (what an all-reduce of the two fp32 copies gives), bit for bit, although only the
looked-up rows of ``g_first`` travel back to the last stage. Spawned processes (as the launcher),
workers at module level so the children can import them.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest
import torch

try:  # spawned children inherit sys.path
    import npu_train  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from npu_train.runtime.tied import looked_up_rows

V, H = 50, 8


class _HostBackend:
    """download / upload as copies (what every backend promises: never aliasing); counts downloads."""

    downloads = 0

    def download(self, t):
        self.downloads += 1
        return t.detach().clone()

    def upload(self, t):
        return t.detach().clone()


def _grads(dtype):
    """(ids per micro-batch, g_first, g_last): g_first non-zero only on the looked-up rows."""
    gen = torch.Generator().manual_seed(5)
    ids = [torch.tensor([[3, 3, 7, 20]]), torch.tensor([[49, 0, 7, 11]])]
    rows = looked_up_rows(ids)
    g_first = torch.zeros(V, H)
    g_first[rows] = torch.randn(len(rows), H, generator=gen)
    g_last = torch.randn(V, H, generator=gen)
    return ids, g_first.to(dtype), g_last.to(dtype)


def _worker(rank, init, q, ev):
    import torch.distributed as dist

    from npu_train.runtime.tied import TiedGradExchange

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        be = _HostBackend()
        ex = TiedGradExchange(rank == 0, 1 - rank, group, (V, H), be)
        out = {}
        # fp32, bf16, then fp32 with a wrong row on the last stage; the receive buffer is reused
        for case, dtype, break_rows in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                        ("broken", torch.float32, True), ("unblocked", torch.float32, False)):
            ids, g_first, g_last = _grads(dtype)
            g = (g_first if rank == 0 else g_last).clone()
            ex.begin()
            if rank == 1:
                n0 = be.downloads
                ex.send_dense(g)
                out[case + "_send_copies"] = be.downloads - n0
            rows = looked_up_rows(ids)
            if break_rows and rank == 1:
                rows = rows.clone()
                rows[0] = 1  # the last stage adds a looked-up row's values to a row never looked up
            if case == "unblocked" and rank == 1:
                # the last stage reaches its finish only once the first stage's finish has returned
                # (a blocking send of the rows would wait here for the 20 s, then go on)
                out["first_returned_first"] = ev.wait(20)
            ex.finish(g, rows)
            if case == "unblocked" and rank == 0:
                ev.set()
            out[case] = g.float().tolist()
            ex.settle()
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


_RESULTS = {}


def _run(tmp_path):
    """{rank: {case: [V, H] fp32 result}} of one spawned pair (cached: one pair for all tests)."""
    if _RESULTS:
        return _RESULTS
    ctx = mp.get_context("spawn")
    q, ev = ctx.Queue(), ctx.Event()
    init = f"file://{tmp_path}/rdv"
    ps = [ctx.Process(target=_worker, args=(r, init, q, ev)) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        out = dict(q.get(timeout=90) for _ in ps)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    _RESULTS.update({r: {c: torch.tensor(v) if isinstance(v, list) else v for c, v in d.items()}
                     for r, d in out.items()})
    return _RESULTS


@pytest.mark.parametrize("case,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_both_stages_hold_the_sum_bit_for_bit(tmp_path, case, dtype):
    _, g_first, g_last = _grads(dtype)
    want = (g_first.float() + g_last.float()).to(dtype).float()
    got = _run(tmp_path)
    assert torch.equal(got[0][case], want), "first stage"
    assert torch.equal(got[1][case], want), "last stage"
    # the sparse path was exercised: most rows of g_first are zero, and g_last is not
    assert (g_first.float().abs().sum(1) == 0).sum() > V // 2 and bool((g_last != 0).all())


def test_a_wrong_row_is_seen(tmp_path):
    """The check above is sharp: a wrong row on the last stage breaks equality there."""
    _, g_first, g_last = _grads(torch.float32)
    got = _run(tmp_path)
    assert torch.equal(got[0]["broken"], g_first + g_last)
    assert not torch.equal(got[1]["broken"], g_first + g_last)


def test_fp32_host_gradient_is_sent_without_a_copy(tmp_path):
    """The last stage's dense send: an fp32 CPU gradient (a cpu card) is already the wire format and
    goes out as is (no [V, H] host copy); a bf16 one is downloaded and cast once. The sums above stay
    bit for bit (same run)."""
    got = _run(tmp_path)
    assert got[1]["fp32_send_copies"] == 0
    assert got[1]["bf16_send_copies"] == 1


def test_first_stage_does_not_wait_for_the_last_stage_to_take_its_rows(tmp_path):
    """The first stage's finish returns with the full sum while the last stage is still busy (its
    rows leave without a wait, :meth:`TiedGradExchange.settle`), and both sums stay exact."""
    _, g_first, g_last = _grads(torch.float32)
    got = _run(tmp_path)
    assert got[1]["first_returned_first"] is True
    assert torch.equal(got[0]["unblocked"], g_first + g_last) and torch.equal(got[1]["unblocked"], g_first + g_last)


def test_looked_up_rows_sorted_unique():
    rows = looked_up_rows([torch.tensor([[5, 1, 5]]), torch.tensor([[2, 1]])])
    assert rows.tolist() == [1, 2, 5] and rows.dtype == torch.int64
