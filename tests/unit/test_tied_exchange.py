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
import time

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


def _worker(rank, init, q, shm_name=None):
    import torch.distributed as dist

    from npu_train.runtime.tied import TiedGradExchange

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        be = _HostBackend()
        ex = TiedGradExchange(rank == 0, 1 - rank, group, (V, H), be, shm_name=shm_name)
        dist.barrier()  # the last stage has created the segment (the trainer's barrier)
        out = {}
        # fp32, bf16, then fp32 with a wrong row on the last stage; the receive buffer is reused
        for case, dtype, break_rows in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                        ("broken", torch.float32, True)):
            ids, g_first, g_last = _grads(dtype)
            g = (g_first if rank == 0 else g_last).clone()
            ex.begin()
            if rank == 0 and case == "fp32":
                # the first stage reads the dense gradient late (after it sent its rows, so the last stage
                # is free to go on to the next step's send): a write into the segment that did not wait
                # for the read would show in this step's sum
                slow = ex._work

                class _Late:
                    def wait(self):
                        time.sleep(0.5)
                        return slow.wait()

                ex._work = _Late()
            if rank == 1:
                n0 = be.downloads
                ex.send_dense(g)
                out[case + "_send_copies"] = be.downloads - n0
            rows = looked_up_rows(ids)
            if break_rows and rank == 1:
                rows = rows.clone()
                rows[0] = 1  # the last stage adds a looked-up row's values to a row never looked up
            ex.finish(g, rows)
            out[case] = g.float().tolist()
        ex.close()
        dist.barrier()
        out["segment_left"] = os.path.exists(f"/dev/shm/{shm_name}") if shm_name else False
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


_RESULTS: dict = {}


@pytest.fixture(params=["gloo", "shm"])
def transport(request):
    """The dense gradient through gloo (stages on two nodes) or a shared-memory segment (one node)."""
    return request.param


def _run(tmp_path, transport="gloo"):
    """{rank: {case: [V, H] fp32 result}} of one spawned pair per transport (cached: one pair for all
    tests). Three steps in a row on the same exchange object: the receive buffer (or the segment) is
    reused, and through shared memory a step's write waits for the previous step's read."""
    if transport in _RESULTS:
        return _RESULTS[transport]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path}/rdv"
    shm_name = f"npt_test{os.getpid()}-{transport}_tied0" if transport == "shm" else None
    ps = [ctx.Process(target=_worker, args=(r, init, q, shm_name)) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        out = dict(q.get(timeout=90) for _ in ps)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    _RESULTS[transport] = {r: {c: torch.tensor(v) if isinstance(v, list) else v for c, v in d.items()}
                           for r, d in out.items()}
    return _RESULTS[transport]


@pytest.mark.parametrize("case,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_both_stages_hold_the_sum_bit_for_bit(tmp_path, transport, case, dtype):
    _, g_first, g_last = _grads(dtype)
    want = (g_first.float() + g_last.float()).to(dtype).float()
    got = _run(tmp_path, transport)
    assert torch.equal(got[0][case], want), "first stage"
    assert torch.equal(got[1][case], want), "last stage"
    # the sparse path was exercised: most rows of g_first are zero, and g_last is not
    assert (g_first.float().abs().sum(1) == 0).sum() > V // 2 and bool((g_last != 0).all())


def test_a_wrong_row_is_seen(tmp_path, transport):
    """The check above is sharp: a wrong row on the last stage breaks equality there."""
    _, g_first, g_last = _grads(torch.float32)
    got = _run(tmp_path, transport)
    assert torch.equal(got[0]["broken"], g_first + g_last)
    assert not torch.equal(got[1]["broken"], g_first + g_last)


def test_fp32_host_gradient_is_sent_without_a_copy(tmp_path):
    """The last stage's dense send: an fp32 CPU gradient (a cpu card) is already the wire format and
    goes out as is (no [V, H] host copy); a bf16 one is downloaded and cast once. The sums above stay
    bit for bit (same run)."""
    got = _run(tmp_path)
    assert got[1]["fp32_send_copies"] == 0
    assert got[1]["bf16_send_copies"] == 1


def test_shared_memory_segment_is_removed_by_close(tmp_path):
    got = _run(tmp_path, "shm")
    assert got[0]["segment_left"] is False and got[1]["segment_left"] is False


def test_looked_up_rows_sorted_unique():
    rows = looked_up_rows([torch.tensor([[5, 1, 5]]), torch.tensor([[2, 1]])])
    assert rows.tolist() == [1, 2, 5] and rows.dtype == torch.int64
