"""The global grad norm's per-tensor term, :func:`npu_train.optim.offload.squared_sum`, against an
fp64 sum of squares written here (``sum(float64(x)**2)``).

Tolerance 1e-7 relative: the per-row route measured 8e-10 on 28 M elements; a plain fp32
``dot`` over the whole tensor (1.4e-4 there) or ``vector_norm`` (3e-3) would fail it.
"""
from __future__ import annotations

import pytest
import torch

from npu_train.optim.offload import SQ_ROW, squared_sum


def _ref(x: torch.Tensor) -> float:
    return float((x.double() ** 2).sum())


@pytest.mark.parametrize("shape", [(0,), (7,), (SQ_ROW,), (SQ_ROW + 3,), (576,), (192, 576), (3, 5, SQ_ROW + 1),
                                   (4_000_000,)])
def test_squared_sum_matches_fp64(shape):
    g = torch.Generator().manual_seed(len(shape) + sum(shape))
    x = torch.randn(shape, generator=g) * 1e-3 + 1e-4  # a bias: sign cancellation cannot hide errors
    got = squared_sum(x)
    assert got.dtype == torch.float32 and got.shape == () and got.device == x.device
    ref = _ref(x)
    assert abs(float(got) - ref) <= 1e-7 * ref + 1e-30, (float(got), ref)


def test_squared_sum_of_bf16_and_non_contiguous():
    x = torch.randn(SQ_ROW + 9, 33, generator=torch.Generator().manual_seed(3))
    for t in (x.to(torch.bfloat16), x.t(), x[:, ::2]):
        ref = _ref(t.float())
        assert float(squared_sum(t)) == pytest.approx(ref, rel=1e-7)


def test_squared_sum_detaches():
    x = torch.randn(SQ_ROW * 2, requires_grad=True)
    assert not squared_sum(x).requires_grad
