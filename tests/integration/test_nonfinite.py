"""Non-finite values never reach masters, moments, checkpoints or the metrics files (issue 12).

``train.lr=1e30`` on the tiny model makes the step-2 loss non-finite (the step-1 update blows the
weights up); an injected ``inf`` gradient (``NPT_FAULT=...,action=inf``) makes the global grad
norm non-finite while the loss is finite. ``train.nonfinite=stop`` (default) exits 1 naming the
step and the stage; ``skip`` skips the update on every stage and counts the step. The metrics files
stay strict JSON (parsed with a ``parse_constant`` that raises on ``NaN``/``Infinity``).

Mutation check (run, seen failing): ``finite = True`` in ``StageTrainer.train_step`` (non-finite
values ignored, the pre-issue behaviour) makes the injected-inf job exit 0 instead of 1.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import launch_to_end

pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]  # multi-process runs: CI's heavy step


def _strict(text: str):
    def bad(c):
        raise ValueError(f"non-JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def _strict_lines(path: str) -> list:
    with open(path) as f:
        return [_strict(l) for l in f if l.strip()]


def _all_finite(reader) -> None:
    for k in reader.manifest["index"]:
        if not k.startswith("rng."):
            assert torch.isfinite(reader.get(k)).all(), k


def test_injected_inf_gradient_stops_with_step_and_stage(tiny_model, tmp_path):
    ck = str(tmp_path / "ckpt")
    job = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.save_every=1", f"checkpoint.dir={ck}",
                        "checkpoint.keep=1", env={"NPT_FAULT": "rank=1,phase=backward,step=3,action=inf"}, expect_rc=1)
    (err,) = job.error_lines()
    assert "card cpu:1 (stage 1" in err and "NonFiniteError: step 3: non-finite global grad norm" in err, err
    assert "first seen on stage(s) 1" in err and "train.nonfinite=skip" in err, err
    from npu_train.checkpoint.store import CheckpointReader, complete_checkpoints

    cks = complete_checkpoints(ck)
    assert [os.path.basename(p) for p in cks] == ["step_000002"]  # step 3's update never happened
    r = CheckpointReader(cks[-1])
    assert r.manifest["finite"] is True
    _all_finite(r)
    assert len(_strict_lines(os.path.join(job.run_dir, "metrics.jsonl"))) == 2


def test_injected_inf_on_the_first_stage_is_skipped(tiny_model, tmp_path):
    """The first stage's first parameter is the embedding, whose gradient on a cpu card is sparse rows
    (StageModule.sparse_embed_grad): the injected inf reaches it too (the fault once raised
    NotImplementedError on the sparse tensor), and skip leaves that step's update out everywhere:
    the steps before and after it run, the state stays finite."""
    from npu_train.checkpoint.store import CheckpointReader, complete_checkpoints

    ck = str(tmp_path / "ckpt")
    job = launch_to_end(tmp_path, tiny_model, "train.steps=3", "train.nonfinite=skip", f"checkpoint.dir={ck}",
                        env={"NPT_FAULT": "rank=0,phase=backward,step=2,action=inf"})
    recs = _strict_lines(os.path.join(job.run_dir, "metrics.jsonl"))
    assert [bool(r.get("skipped")) for r in recs] == [False, True, False], recs
    r = CheckpointReader(complete_checkpoints(ck)[-1])
    assert r.step == 3 and r.manifest["finite"] is True
    _all_finite(r)


def test_huge_lr_skip_keeps_state_finite_and_json_valid(tiny_model, tmp_path):
    """lr=1e30: step 1's update (clipped to norm 0.5, then Adam's unit-size step x 1e30) makes every
    later loss non-finite; with skip those steps change nothing and are counted."""
    from npu_train.checkpoint.store import CheckpointReader, complete_checkpoints

    ck = str(tmp_path / "ckpt")
    job = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.lr=1e30", "train.nonfinite=skip",
                        "train.save_every=1", f"checkpoint.dir={ck}", "checkpoint.keep=2", "data.eval_batches=2")
    recs = _strict_lines(os.path.join(job.run_dir, "metrics.jsonl"))
    skipped = [r["step"] for r in recs if r.get("skipped")]
    assert skipped and 1 not in skipped, recs
    for r in recs:
        if r.get("skipped"):
            assert r["loss"] is None or r["grad_norm"] is None, r
    _strict_lines(os.path.join(job.run_dir, "eval.jsonl"))
    with open(os.path.join(job.run_dir, "summary.json")) as f:
        summ = _strict(f.read())
    assert summ["skipped_steps"] == len(skipped)
    assert "SKIPPED: non-finite" in job.stdout
    cks = complete_checkpoints(ck)
    for p in cks:
        r = CheckpointReader(p)
        assert r.manifest["finite"] is True
        _all_finite(r)
    # the skipped steps left masters and moments exactly as after step 1
    last, first = CheckpointReader(cks[-1]), CheckpointReader(cks[0])
    assert last.step == 4
    if first.step >= min(skipped) - 1:
        for k in first.manifest["index"]:
            if not k.startswith("rng."):
                assert torch.equal(first.get(k), last.get(k)), k


def test_huge_lr_stop_is_default(tiny_model, tmp_path):
    job = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.lr=1e30", expect_rc=1)
    (err,) = job.error_lines()
    # step 1's update is finite (clipped gradient, Adam's bounded step) but makes the weights ~1e30:
    # step 2 is the first non-finite one (grad norm nan; the loss may still be finite)
    assert "NonFiniteError: step 2: non-finite" in err and "train.nonfinite=skip" in err, err
    assert "first seen on stage(s)" in err and "hold step 1" in err
    for r in _strict_lines(os.path.join(job.run_dir, "metrics.jsonl")):
        assert r["loss"] is not None


def test_model_with_inf_weight_is_a_clear_error(tiny_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "bad_model")
    shutil.copytree(tiny_model, bad)
    t = load_file(os.path.join(bad, "model.safetensors"))
    t["model.layers.4.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(t, os.path.join(bad, "model.safetensors"))
    job = launch_to_end(tmp_path, bad, "train.steps=2", expect_rc=1)
    (err,) = job.error_lines()
    assert "card cpu:1 (stage 1" in err and "during model load" in err, err
    assert "'model.layers.4.mlp.up_proj.weight' holds 1 non-finite value(s)" in err, err
