"""Pure units: pipeline schedules, LR schedule, stage optimizer paths, checkpoint store."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from npu_train.checkpoint.store import (CheckpointError, CheckpointReader, complete_checkpoints, finalize,
                                        find_checkpoint, remove_stale_staging, save_shard, tmp_dir)
from npu_train.optim.lr import lr_at
from npu_train.pipeline.schedule import Action, build_schedule, peak_in_flight, simulate


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7])
def test_schedule_complete_and_deadlock_free(kind, P, M):
    for s in range(P):
        acts = build_schedule(kind, P, M, s)
        assert sorted(a.micro for a in acts if a.kind == "F") == list(range(M))
        assert sorted(a.micro for a in acts if a.kind == "B") == list(range(M))
        seen = set()
        for a in acts:  # a backward never precedes its forward
            if a.kind == "F":
                seen.add(a.micro)
            else:
                assert a.micro in seen
        expect = min(M, P - s) if kind == "1f1b" else M
        assert peak_in_flight(acts) == expect
    ticks = simulate(kind, P, M)
    assert ticks == 2 * (M + P - 1)  # unit-time actions: 2(M+P-1) ticks, bubble (P-1)/(M+P-1)


def test_1f1b_order_example():
    assert build_schedule("1f1b", 3, 4, 0) == [Action("F", 0), Action("F", 1), Action("F", 2), Action("B", 0),
                                               Action("F", 3), Action("B", 1), Action("B", 2), Action("B", 3)]
    assert build_schedule("1f1b", 3, 4, 2) == [Action(k, m) for m in range(4) for k in "FB"]


def test_schedule_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zb", 2, 2, 0)
    with pytest.raises(ValueError):
        build_schedule("1f1b", 2, 0, 0)


def test_lr_schedule():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.25)
    assert lr_at(3, **kw) == pytest.approx(1.0)
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(12, **kw) == pytest.approx(0.55)
    assert lr_at(20, **kw) == pytest.approx(0.1)
    vals = [lr_at(s, **kw) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


class _CpuBackend:
    def device(self):
        return torch.device("cpu")

    def upload(self, t):
        return t.clone()

    def download(self, t):
        return t.detach().clone()

    def synchronize(self):
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_and_offloaded_paths_agree(dtype):
    from npu_train.optim.adamw import StageOptimizer

    torch.manual_seed(0)
    init = {"a.weight": torch.randn(8, 4), "b.weight": torch.randn(4)}
    results = []
    for resident in (set(), set(init)):
        params = {n: torch.nn.Parameter(t.to(dtype).clone()) for n, t in init.items()}
        opt = StageOptimizer(params, init, resident, _CpuBackend(), lr=0.1, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            opt.step(0.05, 0.5)
        results.append(opt.state_tensors())
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=0, atol=0)


def test_optimizer_state_roundtrip_is_exact():
    from npu_train.optim.adamw import StageOptimizer

    init = {"w.weight": torch.randn(5, 3)}
    def make():
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        return params, StageOptimizer(params, init, {"w.weight"}, _CpuBackend(), lr=0.1)
    grads = [torch.randn(5, 3) for _ in range(4)]
    p1, o1 = make()
    for g in grads:
        p1["w.weight"].grad = g.clone()
        o1.step(0.01, 1.0)
    p2, o2 = make()
    for g in grads[:2]:
        p2["w.weight"].grad = g.clone()
        o2.step(0.01, 1.0)
    saved = o2.state_tensors()
    p3, o3 = make()
    o3.load_state_tensors(saved, 2)
    for g in grads[2:]:
        p3["w.weight"].grad = g.clone()
        o3.step(0.01, 1.0)
    assert torch.equal(p1["w.weight"], p3["w.weight"])
    assert torch.equal(o1.state_tensors()["exp_avg_sq.w.weight"], o3.state_tensors()["exp_avg_sq.w.weight"])


def _save(root, step, job="j1", ranks=2):
    st = tmp_dir(root, step, job)
    for r in range(ranks):
        save_shard(st, r, {f"master.p{r}": torch.full((2,), float(step))}, {"rank": r})
    return st


def test_checkpoint_publish_and_latest(tmp_path):
    root = str(tmp_path)
    finalize(root, _save(root, 2), 2, {"model": {"hidden_size": 4}}, keep=2)
    finalize(root, _save(root, 4), 4, {"model": {"hidden_size": 4}}, keep=2)
    finalize(root, _save(root, 6), 6, {"model": {"hidden_size": 4}}, keep=2)
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_000004", "step_000006"]
    path = find_checkpoint("latest", root)
    r = CheckpointReader(path)
    assert r.step == 6 and torch.equal(r.get("master.p1"), torch.full((2,), 6.0))
    with pytest.raises(CheckpointError, match="from another model"):
        r.check_model({"hidden_size": 8})


def test_partial_save_is_never_latest(tmp_path):
    root = str(tmp_path)
    finalize(root, _save(root, 2), 2, {})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    st = tmp_dir(root, 4, "j1", owner_pid=dead.pid)  # shards written, manifest never: a crash mid-save
    save_shard(st, 0, {"master.p0": torch.zeros(2)}, {"rank": 0})
    os.makedirs(os.path.join(root, "step_000008"))  # a directory without manifest
    assert os.path.basename(find_checkpoint("latest", root)) == "step_000002"
    remove_stale_staging(root)
    assert not [f for f in os.listdir(root) if f.startswith(".tmp-")]
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint(os.path.join(root, "step_000008"), root)
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(str(tmp_path / "nope"), root)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint("latest", str(tmp_path / "empty"))
