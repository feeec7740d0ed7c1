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
from npu_train.pipeline.schedule import (Action, bubble_fraction, build_schedule, peak_in_flight,
                                         peak_pending_weight_grads, simulate, step_time)


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
        assert peak_in_flight(kind, s, P, M) == expect
    ticks = simulate(kind, P, M)
    assert ticks == 2 * (M + P - 1)  # unit-time actions: 2(M+P-1) ticks, bubble (P-1)/(M+P-1)
    for slots in (1, 2):
        simulate(kind, P, M, slots=slots)  # finite boundary rings: no deadlock either
    assert bubble_fraction(kind, P, M) == pytest.approx((P - 1) / (M + P - 1))


@pytest.mark.parametrize("kind", ["zb", "zb-h1"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("M", range(1, 9))
def test_zero_bubble_schedule(kind, P, M):
    for s in range(P):
        acts = build_schedule(kind, P, M, s)
        for k in "FBW":  # exactly one F, one B, one W per micro-batch
            assert sorted(a.micro for a in acts if a.kind == k) == list(range(M)), (k, acts)
        pos = {(a.kind, a.micro): i for i, a in enumerate(acts)}
        for m in range(M):
            assert pos[("F", m)] < pos[("B", m)] < pos[("W", m)], acts
        # activations held from F to W, never more than 1F1B holds from F to B
        held, peak = set(), 0
        for a in acts:
            if a.kind == "F":
                held.add(a.micro)
            elif a.kind == "W":
                held.remove(a.micro)
            peak = max(peak, len(held))
        assert peak == peak_in_flight(kind, s, P, M)
        if kind == "zb":  # 1F1B's memory on every stage
            assert peak <= peak_in_flight("1f1b", s, P, M) == min(M, P - s)
            assert peak_pending_weight_grads(kind, s, P, M) == (0 if s == 0 else 1)
        else:  # ZB-H1: 1F1B's largest (stage 0's) memory on every stage
            assert peak == min(M, P) == max(peak_in_flight("1f1b", r, P, M) for r in range(P))
            assert peak_pending_weight_grads(kind, s, P, M) == (0 if s == 0 else min(M, s + 1))
    for slots in (None, 1, 2, 3):
        simulate(kind, P, M, slots=slots)
    # unit F/B/W: 1F1B idles (P-1)(F+B+W) per stage, zb (P-1)(F+B), zb-h1 (P-1)(F+B-W)
    assert bubble_fraction("1f1b", P, M) == pytest.approx((P - 1) / (M + P - 1))
    if kind == "zb":
        assert bubble_fraction(kind, P, M) == pytest.approx(2 * (P - 1) / (3 * M + 2 * (P - 1)))
    elif M >= P:
        assert bubble_fraction(kind, P, M) == pytest.approx((P - 1) / (3 * M + P - 1))
    if P > 1 and M >= P:
        assert bubble_fraction(kind, P, M) < bubble_fraction("1f1b", P, M)
        assert step_time(kind, P, M, 1.0, 1.2, 0.8) < step_time("1f1b", P, M, 1.0, 1.2, 0.8)


@pytest.mark.parametrize("P", range(1, 7))
@pytest.mark.parametrize("M", range(1, 17))
def test_zb_h2_schedule(P, M):
    """ZB-H2 (Qi et al. 2024, section 3.1): complete, F < B < W per micro-batch, warm-up
    min(2(P-s)-1, M) forwards, memory 2P-1 micro-batches (when M >= 2P-1), deadlock-free with
    1-slot rings and the launcher's default min(M, P) + 1 slots, never slower than ZB-H1."""
    h2_regime = M >= 2 * P - 1
    for s in range(P):
        acts = build_schedule("zb-h2", P, M, s)
        for k in "FBW":
            assert sorted(a.micro for a in acts if a.kind == k) == list(range(M)), (k, acts)
        pos = {(a.kind, a.micro): i for i, a in enumerate(acts)}
        for m in range(M):
            assert pos[("F", m)] < pos[("B", m)] < pos[("W", m)], acts
        warm = next(i for i, a in enumerate(acts) if a.kind != "F")
        assert warm == min(2 * (P - s) - 1, M)
        # held from F to W, counted here from the formula's definition
        held, peak, pend, ppeak = 0, 0, 0, 0
        for a in acts:
            held += {"F": 1, "B": 0, "W": -1}[a.kind]
            pend += {"F": 0, "B": 1, "W": -1}[a.kind]
            peak, ppeak = max(peak, held), max(ppeak, pend)
        assert peak == peak_in_flight("zb-h2", s, P, M)
        assert peak_pending_weight_grads("zb-h2", s, P, M) == (0 if s == 0 else ppeak)
        if h2_regime:
            assert peak == 2 * P - 1  # the paper's (2p-1) M_B, on every stage
            assert ppeak == 2 * s + 1
    for slots in (None, 1, 2, min(M, P) + 1):
        simulate("zb-h2", P, M, slots=slots)
    # the launcher's default ring (runtime.slots = min(M, P) + 1) never holds the extra warm-up
    # forwards back: the same unit-time ticks as unbounded rings
    assert simulate("zb-h2", P, M, slots=min(M, P) + 1) == simulate("zb-h2", P, M)
    for t in [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.0, 1.0, 1.2), ([1.0] * (P - 1) + [1.4], 1.3, 0.7)]:
        assert step_time("zb-h2", P, M, *t) <= step_time("zb-h1", P, M, *t) + 1e-9
    if h2_regime:
        # unit times: the lower bound (P-1) t_F + 3M of the last stage, as ZB-H1
        assert bubble_fraction("zb-h2", P, M) == pytest.approx((P - 1) / (3 * M + P - 1))
        # t_B > t_W: the deferred W passes cover the input gradient's way back to stage 0
        assert step_time("zb-h2", P, M, 1.0, 1.3, 0.7) == pytest.approx((P - 1) + 3.0 * M)


def test_zb_h2_order_example():
    want = "F0 F1 F2 F3 F4 B0 W0 F5 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5".split()  # stage 0 of 3: 2P-1 warm-up
    assert build_schedule("zb-h2", 3, 6, 0) == [Action(a[0], int(a[1:])) for a in want]
    want = "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 W0 F5 B5 W1 W2 W3 W4 W5".split()  # last: W 4 = 2s late
    assert build_schedule("zb-h2", 3, 6, 2) == [Action(a[0], int(a[1:])) for a in want]
    # P=3, M=8, unit times: 1F1B 30, ZB-H1 26, ZB-H2 26; t_B=1.3, t_W=0.7: ZB-H1 27.2, ZB-H2 26
    assert [step_time(k, 3, 8) for k in ("1f1b", "zb-h1", "zb-h2")] == pytest.approx([30, 26, 26])
    assert [step_time(k, 3, 8, 1.0, 1.3, 0.7) for k in ("zb-h1", "zb-h2")] == pytest.approx([27.2, 26.0])


def test_zero_bubble_order_example():
    want = "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3".split()
    assert build_schedule("zb", 3, 4, 0) == [Action(a[0], int(a[1:])) for a in want]
    assert build_schedule("zb", 3, 2, 2) == [Action(k, m) for m in range(2) for k in "FBW"]
    want = "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3".split()  # last stage of 3: W two micro-batches late
    assert build_schedule("zb-h1", 3, 4, 2) == [Action(a[0], int(a[1:])) for a in want]


def test_step_time_per_stage_durations():
    """Two stages, stage 1 twice as slow: 1F1B's steady state runs at the slow stage's pace."""
    t = step_time("1f1b", 2, 4, t_f=[1.0, 2.0], t_b=[1.0, 2.0], t_w=[1.0, 2.0])
    # stage 1 starts after stage 0's first forward (1) and then is busy 4 * (2 + 4) = 24;
    # stage 0 ends with B3 (2) right after stage 1's B3
    assert t == pytest.approx(1 + 24 + 2)
    with pytest.raises(ValueError, match="one value per stage"):
        step_time("zb", 2, 4, t_f=[1.0])


def test_1f1b_order_example():
    assert build_schedule("1f1b", 3, 4, 0) == [Action("F", 0), Action("F", 1), Action("F", 2), Action("B", 0),
                                               Action("F", 3), Action("B", 1), Action("B", 2), Action("B", 3)]
    assert build_schedule("1f1b", 3, 4, 2) == [Action(k, m) for m in range(4) for k in "FB"]


def test_schedule_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zbx", 2, 2, 0)
    with pytest.raises(ValueError):
        build_schedule("1f1b", 2, 0, 0)
    with pytest.raises(ValueError):
        simulate("zb", 2, 2, slots=0)


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
    kind = "cpu"  # fp32 resident parameters are their own masters (StageOptimizer.shared)

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


def test_warmup_longer_than_the_run_is_noted():
    from npu_train.optim.lr import warmup_note

    # steps 0..1 of a 10-step ramp: lr * 2/10 at most (written from the ramp's formula)
    note = warmup_note(lr=1e-3, warmup_steps=10, total_steps=2)
    assert note.startswith("note: train.warmup_steps=10 > train.steps=2") and "peaks at 2e-4 (20% of train.lr=0.001)" in note
    assert warmup_note(lr=1e-3, warmup_steps=2, total_steps=2) is None
    assert warmup_note(lr=1e-3, warmup_steps=0, total_steps=20) is None
