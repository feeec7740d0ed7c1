"""Exact resume (issue #4): N steps straight == N/2 steps, stop, ``train.resume=latest``, N/2 steps.

The first half runs with ``train.steps=N`` (so the LR schedule is the same) and
``train.stop_after=N/2``, which stops after N/2 steps of that launch and saves a checkpoint.
Same cards and split: per-step losses and every saved tensor (fp32 masters and AdamW moments)
are bit-identical. Another card count (2 -> 3) or resident split (0 -> all resident layers):
the checkpoint is re-sharded by global HF tensor names; losses within 1e-5 relative.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import rel_diff, run_pipeline

pytestmark = pytest.mark.timeout(240)

N = 6
FIRST = ("backend=[cpu,cpu]", "train.resident_layers=0", f"train.steps={N}")


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    """N steps in one launch: (losses, final checkpoint reader)."""
    d = tmp_path_factory.mktemp("straight")
    return run_pipeline(tiny_model, str(d), *FIRST)


@pytest.fixture(scope="module")
def first_half(tiny_model, tmp_path_factory):
    """N/2 steps of an N-step schedule, stopped by train.stop_after: (losses, checkpoint root)."""
    d = tmp_path_factory.mktemp("first_half")
    ck = str(d / "ckpt")
    losses, reader = run_pipeline(tiny_model, str(d / "run"), *FIRST, f"train.stop_after={N // 2}",
                                  f"checkpoint.dir={ck}")
    assert len(losses) == N // 2 and reader.step == N // 2
    return losses, ck


def _resume(tiny_model, tmp_path, first_half, *overrides):
    losses1, ck_src = first_half
    ck = str(tmp_path / "ckpt")
    shutil.copytree(ck_src, ck)  # each test resumes from its own copy
    losses2, reader = run_pipeline(tiny_model, str(tmp_path / "run"), f"train.steps={N}", "train.resume=latest",
                                   f"checkpoint.dir={ck}", *overrides)
    assert len(losses2) == N - N // 2 and reader.step == N
    return losses1 + losses2, reader


def test_stop_after_writes_resumable_checkpoint(first_half):
    from npu_train.checkpoint.store import CheckpointReader, find_checkpoint

    _, ck = first_half
    r = CheckpointReader(find_checkpoint("latest", ck))
    assert r.step == N // 2 and r.manifest["train"]["steps"] == N


def test_resume_is_bit_exact(tiny_model, tmp_path, straight, first_half):
    ref_losses, ref = straight
    losses, got = _resume(tiny_model, tmp_path, first_half, "backend=[cpu,cpu]", "train.resident_layers=0")
    assert losses == ref_losses  # exact float equality, step by step
    assert got.manifest["index"].keys() == ref.manifest["index"].keys()
    for k in ref.manifest["index"]:
        assert torch.equal(got.get(k), ref.get(k)), k


@pytest.mark.parametrize("overrides", [
    ("backend=[cpu,cpu,cpu]",),                               # 2 -> 3 card processes
    ("backend=[cpu,cpu]", "train.resident_layers=3"),       # resident 0 -> all layers resident
], ids=["2to3cards", "resident0toall"])
def test_resume_resharded(tiny_model, tmp_path, straight, first_half, overrides):
    ref_losses, ref = straight
    losses, got = _resume(tiny_model, tmp_path, first_half, *overrides)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    for k in ref.manifest["index"]:
        if k.startswith(("master.", "exp_avg.", "exp_avg_sq.")):
            assert rel_diff(got.get(k), ref.get(k)) < 1e-5, k
