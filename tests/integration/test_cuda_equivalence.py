"""The CUDA backend against the single-process CPU reference (same seed, same data order).

Skipped without a CUDA device (CI has none); run on a GPU machine with
``python -m pytest -q tests/integration/test_cuda_equivalence.py``. One GPU is enough: a card list
may not name one GPU twice, so the multi-stage cases mix ``cuda:0`` with CPU card processes, which
exercises the device <-> host boundary (download before the shm ring, upload after it).

Tolerances: fp32 per-step loss and final master weights within 1e-5 relative (TF32 is off for fp32
matmuls by default in PyTorch: ``torch.backends.cuda.matmul.allow_tf32 = False``); bf16 compute with
fp32 masters: per-step loss within 2e-2 relative of the fp32 reference.
"""
from __future__ import annotations

import pytest
import torch

from conftest import cached_reference, check_against_reference, run_pipeline

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]

@pytest.mark.parametrize("backend", ["[cuda:0]", "[cuda:0,cpu]", "[cpu,cuda:0,cpu]"])
def test_cuda_fp32_matches_reference(tiny_model, tmp_path, backend):
    ref_losses, ref_w = cached_reference(tiny_model)
    losses, reader = run_pipeline(tiny_model, str(tmp_path), f"backend={backend}", "train.dtype=fp32")
    check_against_reference(losses, reader, ref_losses, ref_w, loss_tol=1e-5)


@pytest.mark.parametrize("resident", ["0", "3"])
def test_cuda_bf16_offloaded_and_resident(tiny_model, tmp_path, resident):
    ref_losses, _ = cached_reference(tiny_model)
    losses, reader = run_pipeline(tiny_model, str(tmp_path), "backend=[cuda:0,cpu]", "train.dtype=bf16",
                                  f"train.resident_layers={resident}")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 2e-2, (losses, ref_losses)
    assert reader.get("master.model.norm.weight").dtype == torch.float32
