"""Mixture-of-experts training through the launcher (issue 37): a tiny Qwen3-MoE (8 experts, top-2, renormalised,
layer 1 dense, routers far from uniform) trained 5 steps on 1, 2 and 3 cpu cards against the single-process
reference of tests/integration/reference.py (the sparse MLP and transformers' load-balancing loss written from
their formulas: every expert on every token, one-hot counts), with the aux loss off and on (weight 0.3, large
so that its gradient matters). fp32: per-step loss and final master weights within 1e-5 relative per tensor.
The step records carry the aux loss and each card's expert load.
"""
from __future__ import annotations

import json

import pytest

from conftest import make_tiny_model, reference_for, rel_diff, run_pipeline

pytestmark = pytest.mark.timeout(300)

W = 0.3
#: final weights' tolerance (aux off, on): AdamW divides each gradient by its own RMS, so the aux term's rounding
#: (fp32 softmax derivatives, the coefficients in float64 here and in fp32 autograd there) grows over 5 steps to
#: 1.9e-5 on layer 0's o_proj with one card (measured; experiments/2026-12-06-moe.md). Aux off, the same
#: magnification of fp32 rounding gives 1.17e-5 on layer 0's q_proj on an AMD EPYC host (avx512_bf16), one card
#: as three, at 0ee995b as now, against < 1e-5 on the hosts of earlier runs: 3e-5, as the dense DPO test
TOL = {False: 3e-5, True: 5e-5}
STEPS = ("train.steps=5",)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_moe")), family="qwen3_moe", tied=False, layers=4)


def _records(run_dir) -> list:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(l) for l in f if l.strip()]


@pytest.mark.parametrize("aux", [0.0, W])
@pytest.mark.parametrize("backend", ["[cpu]", "[cpu,cpu]", "[cpu,cpu,cpu]"])
def test_moe_pipeline_matches_reference(moe_model, tmp_path, backend, aux):
    ref_losses, ref_w = reference_for(moe_model, *STEPS, aux_weight=aux)
    losses, reader = run_pipeline(moe_model, str(tmp_path), f"backend={backend}", "train.schedule=1f1b",
                                  f"train.moe_aux_loss={aux}", *STEPS)
    assert len(losses) == 5 and reader.step == 5
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    diffs = {name: rel_diff(reader.get(f"master.{name}"), w) for name, w in ref_w.items()}
    worst = max(diffs, key=diffs.get)
    print(f"MOE-PARITY backend={backend} aux={aux}: worst weight {worst} {diffs[worst]:.2e}, "
          f"losses {max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.2e}")
    assert diffs[worst] < TOL[aux > 0], f"{worst}: rel diff {diffs[worst]:.2e}"
    recs = _records(tmp_path)
    n_cards = backend.count("cpu")
    for r in recs:
        assert len(r["expert_load_cards"]) == n_cards
        assert all(x is None or x >= 1.0 for x in r["expert_load_cards"])
        # transformers' aux is k = 2 for a perfectly balanced router (T_e / R sums to k); None when off
        assert (1.0 < r["aux_loss"] < 8.0) if aux else r["aux_loss"] is None


@pytest.mark.parametrize("backend", ["[cpu,cpu]", "[cpu,cpu,cpu]"])
def test_moe_zero_bubble_pipeline_matches_reference(moe_model, tmp_path, backend):
    """train.schedule=zb (B and W split; the experts' kernel makes each half once, model/moe.py), aux loss off."""
    ref_losses, ref_w = reference_for(moe_model, *STEPS, aux_weight=0.0)
    losses, reader = run_pipeline(moe_model, str(tmp_path), f"backend={backend}", "train.schedule=zb",
                                  "train.moe_aux_loss=0", *STEPS)
    assert len(losses) == 5 and reader.step == 5
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    diffs = {name: rel_diff(reader.get(f"master.{name}"), w) for name, w in ref_w.items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < TOL[False], f"{worst}: rel diff {diffs[worst]:.2e}"


def test_zb_with_aux_loss_is_refused(moe_model, tmp_path):
    from conftest import launch_to_end

    job = launch_to_end(tmp_path, moe_model, "train.schedule=zb", f"train.moe_aux_loss={W}", expect_rc=2,
                        backend="cpu,cpu")
    assert "does not combine with the mixture-of-experts load-balancing loss" in " ".join(job.error_lines())


def test_dp_auto_with_aux_loss_plans_1f1b(moe_model, tmp_path):
    """parallel.dp=auto once chose zb for a model with the load-balancing loss on, which the card processes then
    refused (found by the fresh-clone review): the layout search plans 1f1b there, as train.schedule=auto does."""
    import re

    from conftest import launch_to_end

    job = launch_to_end(tmp_path, moe_model, "plan=true", "parallel.dp=auto", f"train.moe_aux_loss={W}",
                        expect_rc=0, timeout=280, backend="cpu,cpu,cpu,cpu")
    m = re.search(r"parallel\.dp=auto: dp=\d+ x pp=\d+, micro-batch \d+ x accum \d+, ([\w-]+)", job.stdout)
    assert m and m.group(1) == "1f1b", job.stdout[-3000:]
