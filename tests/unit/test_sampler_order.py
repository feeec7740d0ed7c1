"""The epoch order of large data sets (``StepSampler`` above ``RANDPERM_MAX_ROWS`` rows): a keyed Feistel
permutation computed per micro-batch, so no card holds an O(rows) permutation. Checked from the definition of a
permutation (every row exactly once per epoch), the key (seed, epoch), resume, data-parallel shares, and that a
data set of 10**12 rows is sampled without an O(rows) tensor."""
from __future__ import annotations

import pytest
import torch

from npu_train.data import sampler as sampler_mod
from npu_train.data.sampler import PairSampler, StepSampler, feistel_order


def _flat(mbs):
    return torch.cat(mbs).tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 4097, 65536 + 7])
def test_feistel_order_is_a_permutation(n):
    for seed, epoch in ((0, 0), (7, 3), (123456789, 0)):
        y = feistel_order(torch.arange(n), n, seed, epoch)
        assert y.dtype == torch.int64 and y.shape == (n,)
        assert sorted(y.tolist()) == list(range(n))


def test_feistel_order_depends_on_seed_and_epoch_and_shuffles():
    n = 10_000
    base = feistel_order(torch.arange(n), n, 7, 0)
    assert torch.equal(base, feistel_order(torch.arange(n), n, 7, 0))  # a pure function
    for other in (feistel_order(torch.arange(n), n, 8, 0), feistel_order(torch.arange(n), n, 7, 1)):
        assert (other == base).float().mean() < 0.01  # another key: another order
    # a shuffle, not a shift or a near-identity: few fixed points, neighbours scattered, no linear trend
    pos = torch.arange(n, dtype=torch.float64)
    assert (base == torch.arange(n)).sum() < 10
    assert (base[1:] - base[:-1]).abs().float().median() > n / 10
    corr = torch.corrcoef(torch.stack([pos, base.double()]))[0, 1]
    assert abs(float(corr)) < 0.05
    # any slice of positions gives the same rows as the whole order
    assert torch.equal(feistel_order(torch.arange(4000, 4100), n, 7, 0), base[4000:4100])


@pytest.fixture
def feistel_from(monkeypatch):
    """Use the Feistel order from ``k`` rows on (the module's threshold, lowered for a small data set)."""
    def set_(k: int) -> None:
        monkeypatch.setattr(sampler_mod, "RANDPERM_MAX_ROWS", k)
    return set_


def test_large_data_sets_visit_every_row_once_per_epoch(feistel_from):
    feistel_from(0)
    s = StepSampler(1000, micro_batch=8, micro_batches=5, seed=3)
    per_epoch = s.steps_per_epoch  # 25 steps of 40 rows
    e0 = [i for k in range(per_epoch) for i in _flat(s.micro_batches_for_step(k))]
    e1 = [i for k in range(per_epoch, 2 * per_epoch) for i in _flat(s.micro_batches_for_step(k))]
    assert sorted(e0) == sorted(e1) == list(range(1000))
    assert e0 != e1
    assert e0[:40] == feistel_order(torch.arange(40), 1000, 3, 0).tolist()
    assert not s._perms  # nothing of O(rows) held


def test_large_data_sets_resume_and_dp_shares(feistel_from):
    feistel_from(0)
    a = StepSampler(997, micro_batch=3, micro_batches=4, seed=5)
    full = [_flat(a.micro_batches_for_step(k)) for k in range(30)]
    b = StepSampler(997, micro_batch=3, micro_batches=4, seed=5)
    b.load_state_dict(a.state_dict())
    assert [_flat(b.micro_batches_for_step(k)) for k in range(12, 30)] == full[12:]
    # two data-parallel replicas of 2 micro-batches take the one-replica order's halves
    shares = [StepSampler(997, 3, 2, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for k in range(5):
        assert _flat(shares[0].micro_batches_for_step(k)) + _flat(shares[1].micro_batches_for_step(k)) == full[k]


def test_pairs_of_large_preference_sets(feistel_from):
    feistel_from(0)
    s = PairSampler(200, micro_batch=4, micro_batches=2, seed=1)
    rows = [i for k in range(s.steps_per_epoch) for i in _flat(s.micro_batches_for_step(k))]
    assert sorted(rows) == list(range(200))
    assert all(rows[j] % 2 == 0 and rows[j + 1] == rows[j] + 1 for j in range(0, 200, 2))


def test_the_order_follows_the_row_count_so_a_resume_keeps_it():
    """Small sets keep the documented randperm order (existing runs and checkpoints unchanged); above the
    threshold a 10**12-row set is sampled at once, without a permutation tensor."""
    small = StepSampler(100, 4, 3, seed=7)
    assert _flat(small.micro_batches_for_step(0)) == torch.randperm(
        100, generator=torch.Generator().manual_seed(7))[:12].tolist()
    huge = StepSampler(10 ** 12, micro_batch=4, micro_batches=2, seed=7)
    got = _flat(huge.micro_batches_for_step(123456))
    assert len(set(got)) == 8 and all(0 <= i < 10 ** 12 for i in got)
    assert got == feistel_order(torch.arange(123456 * 8, 123457 * 8), 10 ** 12, 7, 0).tolist()
    assert not huge._perms
