"""The per-action timeline (``runtime.trace``): what :class:`StageRunner` records, the Chrome trace
file and the idle summary (:mod:`npu_train.metrics.trace`).

References: the schedule's own action list (:func:`build_schedule`) for what is recorded, causality
between threads for the waits (a stage cannot be ready for micro-batch m before its neighbour sent
it), and a timeline worked out by hand for :func:`summarize`.
"""
from __future__ import annotations

import json

import pytest
import torch

from npu_train.metrics.trace import TraceWriter, format_summary, step_events, summarize
from npu_train.pipeline.schedule import build_schedule
from test_stage_inprocess import _cfg, _data, _weights, run_pipeline


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])
def test_runner_records_every_action_in_schedule_order_with_causal_waits(schedule):
    P, M = 2, 5
    cfg = _cfg(tied=False)
    weights = _weights(cfg, seed=1)
    inputs, labels = _data(M, seed=2)
    traces = [[] for _ in range(P)]
    loss, grads = run_pipeline(cfg, weights, inputs, labels, P, schedule, traces=traces)
    for s in range(P):
        kinds = [(k, m) for k, m, *_ in traces[s]]
        assert kinds == [(a.kind, a.micro) for a in build_schedule(schedule, P, M, s)], (s, kinds)
        for i, (_, _, t0, t1, t2, t3) in enumerate(traces[s]):
            assert t0 <= t1 <= t2 <= t3
            if i:
                assert traces[s][i - 1][5] <= t0  # one action at a time on a stage
    computed = [{(k, m): t2 for k, m, _, _, t2, _ in traces[s]} for s in range(P)]
    for k, m, t0, t1, _, _ in traces[1]:
        if k == "F":  # stage 1 is ready for F_m only after stage 0 computed it
            assert t1 >= computed[0][("F", m)]
    for k, m, t0, t1, _, _ in traces[0]:
        if k == "B":  # stage 0 is ready for B_m only after stage 1 computed the input gradient
            assert t1 >= computed[1][("B", m)]
    # the first stage's forwards never wait (its input is token ids), the last stage sends no activation
    assert all(t1 - t0 < 0.05 for k, _, t0, t1, _, _ in traces[0] if k == "F")
    assert all(t3 == t2 for k, _, _, _, t2, t3 in traces[1] if k == "F")
    # recording changes nothing: the same gradients, bit for bit, as a run without it
    loss2, grads2 = run_pipeline(cfg, weights, inputs, labels, P, schedule)
    assert loss == loss2
    for g, g2 in zip(grads, grads2):
        assert all(torch.equal(g[n], g2[n]) for n in g)


# A hand-made step of two cards (seconds):
# card 0: F0 [0, 1], F1 [1, 2], B0 waits 2..3 then [3, 4]; collectives [4, 6] of which tied [4, 4.5];
#         optimizer [6, 6.5]
# card 1: F0 waits 0..1, computes [1, 2.5] and sends [2.5, 2.9], B0 [2.9, 3.0]; collectives [3, 5.9]
#         (no tied exchange); optimizer [5.9, 6.2]; the job's step ends at 6.5 (card 0's optimizer)
STEP = [
    [("F", 0, 0.0, 0.0, 1.0, 1.0), ("F", 1, 1.0, 1.0, 2.0, 2.0), ("B", 0, 2.0, 3.0, 4.0, 4.0),
     ("tied", -1, 4.0, 4.0, 4.5, 4.5), ("collectives", -1, 4.0, 4.0, 6.0, 6.0),
     ("optimizer", -1, 6.0, 6.0, 6.5, 6.5)],
    [("F", 0, 0.0, 1.0, 2.5, 2.9), ("B", 0, 2.9, 2.9, 3.0, 3.0),
     ("tied", -1, 3.0, 3.0, 3.0, 3.0), ("collectives", -1, 3.0, 3.0, 5.9, 5.9),
     ("optimizer", -1, 5.9, 5.9, 6.2, 6.2)],
]


def _shift(step, dt):
    return [[(k, m, *(t + dt for t in ts)) for k, m, *ts in card] for card in step]


def test_summarize_splits_a_hand_made_step():
    r0, r1 = summarize([STEP])
    # the tied exchange (mostly a wait for the peer) is in the collectives, not in compute
    assert r0 == pytest.approx(dict(step_s=6.5, compute_s=3.0, start_wait_s=0.0, inner_wait_s=1.0,
                                    collectives_s=2.0, end_wait_s=0.0, optimizer_s=0.5,
                                    idle_share=1 - 3.5 / 6.5))
    assert r1 == pytest.approx(dict(step_s=6.5, compute_s=2.0, start_wait_s=1.0, inner_wait_s=0.0,
                                    collectives_s=2.9, end_wait_s=0.3, optimizer_s=0.3,
                                    idle_share=1 - 2.3 / 6.5))
    # every second of a card's step is in exactly one column
    for r in (r0, r1):
        parts = (r["compute_s"] + r["optimizer_s"] + r["start_wait_s"] + r["inner_wait_s"] + r["collectives_s"]
                 + r["end_wait_s"])
        assert parts == pytest.approx(r["step_s"])
    # two steps: the mean
    shifted = _shift(STEP, 10.0)
    for got, want in zip(summarize([STEP, shifted]), (r0, r1)):
        assert got == pytest.approx(want)
    text = format_summary([r0, r1], 2, 3)
    assert "steps 2-3" in text and "46.2%" in text  # card 0 idle 1 - 3.5/6.5


def test_trace_file_is_chrome_trace_json_also_before_close(tmp_path):
    path = str(tmp_path / "trace.json")
    w = TraceWriter(path, [0, 1])
    w.step(1, STEP)
    with open(path) as f:  # a run that crashed here: the array's closing bracket is missing
        events = json.loads(f.read() + "\n]")
    w.step(2, _shift(STEP, 10.0))
    w.close()
    with open(path) as f:
        events = json.load(f)
    names = [e["args"]["name"] for e in events if e["ph"] == "M"]
    assert names == ["rank 0", "rank 1"]
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == 2 * len(step_events(1, STEP, 0.0))
    b0 = [e for e in x if e["name"] == "B0" and e["tid"] == 0 and e["args"]["step"] == 2]
    assert b0 and b0[0]["ts"] == pytest.approx(13e6) and b0[0]["dur"] == pytest.approx(1e6)
    waits = [e for e in x if e["cat"] in ("wait", "send") and e["args"]["step"] == 1]
    assert sorted((e["tid"], e["name"], e["dur"]) for e in waits) == [
        (0, "wait B0", 1e6), (1, "send F0", pytest.approx(0.4e6)), (1, "wait F0", 1e6)]
    assert "steps 2-2" in w.summary()
