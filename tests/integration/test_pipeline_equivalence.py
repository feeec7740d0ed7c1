"""Multi-process pipeline runs vs the single-process reference (same seed, same data order).

Tolerances: fp32 per-step loss and final master weights relative difference < 1e-5
(||a-b||/||b|| per tensor); bf16 compute (fp32 masters) against the fp32 reference: per-step loss
< 1e-3 and final master weights < 4e-3 per tensor (see the bf16 test for the measured figures).
Every run uses accumulation 4 (unless stated), clipping by the global norm (clip=0.5 is active:
the tiny model's grad norms are > 2) and, by default, tied input/output embeddings.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import cached_reference, reference_for, rel_diff, run_pipeline

pytestmark = pytest.mark.timeout(240)

# The key bias's gradient is zero in exact arithmetic: softmax is unchanged by adding q . b_k to every score of
# a query's row. What reaches AdamW is rounding noise near its eps (1e-8), so the update follows the noise of
# each summation order: 1.52e-05 between the qwen2 reference and a P = 2 pipeline on an AVX-512 host, under
# 1e-5 on another. It is held to NOISE_TOL; the q and v biases, which have real gradients, keep ``tol``.
NOISE_TOL = 1e-4
NOISE_GRADIENT = (".self_attn.k_proj.bias",)


def _check_weights(reader, ref_w, tol):
    for name, w in ref_w.items():
        got = reader.get(f"master.{name}")
        bound = NOISE_TOL if name.endswith(NOISE_GRADIENT) else tol
        assert rel_diff(got, w) < bound, f"{name}: rel diff {rel_diff(got, w):.2e}"
    if reader.has("master.lm_head.weight") and "lm_head.weight" not in ref_w:  # tied, P > 1
        got = reader.get("master.lm_head.weight")
        assert rel_diff(got, ref_w["model.embed_tokens.weight"]) < tol, f"tied lm_head: {rel_diff(got, ref_w['model.embed_tokens.weight']):.2e}"


@pytest.mark.parametrize("backend", ["[cpu]", "[cpu,cpu]", "[cpu,cpu,cpu]"])
def test_fp32_pipeline_matches_reference(tiny_model, tmp_path, backend):
    ref_losses, ref_w = cached_reference(tiny_model)
    losses, reader = run_pipeline(tiny_model, str(tmp_path), f"backend={backend}")
    assert len(losses) == 3 and reader.step == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    _check_weights(reader, ref_w, 1e-5)


@pytest.mark.parametrize("backend,schedule,extra", [
    ("[cpu,cpu]", "zb", ()), ("[cpu,cpu,cpu]", "zb", ()),
    ("[cpu,cpu]", "zb-h2", ()),  # M = 4 >= 2P-1: ZB-H2's warm-up and 2s-deferred W passes
    ("[cpu,cpu,cpu]", "zb-h2", ("train.accum=5",)),  # M = 5 = 2P-1: stage 0 holds 5 micro-batches
])
def test_fp32_zb_matches_reference(tiny_model, tmp_path, backend, schedule, extra):
    """train.schedule=zb / zb-h2 (B/W split backward) reproduce the reference as 1F1B does."""
    ref_losses, ref_w = cached_reference(tiny_model, *extra)
    losses, reader = run_pipeline(tiny_model, str(tmp_path), f"backend={backend}",
                                  f"train.schedule={schedule}", *extra)
    assert len(losses) == 3 and reader.step == 3
    with open(tmp_path / "metrics.jsonl") as f:  # the idle split of the step (issue 9)
        recs = [json.loads(l) for l in f if l.strip()]
    for r in recs:
        assert 0 <= r["bubble_s"] and 0 <= r["collective_s"] and r["bubble_s"] + r["collective_s"] <= r["step_s"]
        assert 0 <= r["tied_s"] <= r["collective_s"] and len(r["compute_s_cards"]) == len(r["mem_peak_bytes"])
        # CPU seconds per card: the three phases (schedule, collectives, optimizer) make up the step's
        assert len(r["cpu_s_cards"]) == len(r["mem_peak_bytes"])
        assert all(min(ph) >= 0 and abs(sum(ph) - c) < 1e-6 for c, ph in zip(r["cpu_s_cards"], r["cpu_phases_s_cards"]))
        # the compute's own CPU seconds (the fit's input): a part of the schedule phase's CPU seconds
        assert all(0 < c <= ph[0] + 1e-6 for c, ph in zip(r["compute_cpu_s_cards"], r["cpu_phases_s_cards"]))
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    _check_weights(reader, ref_w, 1e-5)


def test_untied_gpipe_three_stages(tiny_model_untied, tmp_path):
    ref_losses, ref_w = cached_reference(tiny_model_untied)
    losses, reader = run_pipeline(tiny_model_untied, str(tmp_path), "backend=[cpu,cpu,cpu]", "train.schedule=gpipe")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5
    _check_weights(reader, ref_w, 1e-5)


def test_bf16_pipeline_loss_close_to_fp32_reference(tiny_model, tmp_path):
    """bf16 compute, fp32 masters, 2 stages, 3 steps against the fp32 reference.

    Checks, with the figures measured on CPU (torch 2.13) for the real pipeline / with stale bf16
    compute weights (never refreshed from the masters):

    - the training update over all parameters, ``||w - w_ref|| / ||w_ref - w_init||``: 0.094 / 0.19,
      tolerance 0.13;
    - final master weights per tensor: max 3.1e-3 / 5.2e-3, tolerance 4e-3;
    - per-step loss: max 1.4e-4 / 1.1e-2, tolerance 1e-3 (the old loss-only tolerance of 2e-2 let
      stale compute weights pass).

    Mutation check (run, seen failing on the update check and, ordered first, on the per-tensor check):
    the ``copy_`` of the masters into the compute-dtype parameters removed from ``StageOptimizer.step``
    (resident and offloaded)."""
    from npu_train.model import load_config, load_tensors

    ref_losses, ref_w = cached_reference(tiny_model)
    losses, reader = run_pipeline(tiny_model, str(tmp_path), "backend=[cpu,cpu]", "train.dtype=bf16")
    assert reader.get("master.model.norm.weight").dtype == torch.float32  # masters stay fp32
    init = load_tensors(tiny_model, load_config(tiny_model), list(ref_w))
    num = sum(float((reader.get(f"master.{n}").double() - w.double()).norm() ** 2) for n, w in ref_w.items())
    den = sum(float((w.double() - init[n].double()).norm() ** 2) for n, w in ref_w.items())
    assert (num / den) ** 0.5 < 0.13, f"update rel diff {(num / den) ** 0.5:.3f}"
    _check_weights(reader, ref_w, 4e-3)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-3, (losses, ref_losses)


def test_resident_vs_offloaded_same_weights(tiny_model, tmp_path):
    # one split for all three runs: each finished run refits the planner's figures (planner.fit), and another
    # split sums the global grad norm in another order
    split = "train.split=[3,3]"
    _, r_off = run_pipeline(tiny_model, str(tmp_path / "off"), "backend=[cpu,cpu]", split, "train.resident_layers=0")
    _, r_res = run_pipeline(tiny_model, str(tmp_path / "res"), "backend=[cpu,cpu]", split, "train.resident_layers=3")
    _, r_mix = run_pipeline(tiny_model, str(tmp_path / "mix"), "backend=[cpu,cpu]", split,
                            "train.resident_layers=[1,2]")
    assert r_off.manifest["index"].keys() == r_res.manifest["index"].keys()
    for k in r_off.manifest["index"]:
        if k.startswith("rng."):
            continue
        assert torch.equal(r_off.get(k), r_res.get(k)), k
        assert torch.equal(r_off.get(k), r_mix.get(k)), k


@pytest.mark.parametrize("backend,accum", [("[cpu,cpu,cpu]", 2), ("[cpu,cpu]", 1), ("[cpu,cpu]", 7)])
def test_micro_batch_counts(tiny_model, tmp_path, backend, accum):
    """M = 1 has no accumulation to average the rounding: an element whose gradient is a near-cancelling sum sits
    near AdamW's eps and its update follows the summation order. Measured on an AVX-512 host (1f1b, zb and auto
    alike): one element of layer 0's v_proj (2048) off by 4.2e-5 (rel diff 1.13e-5 of the tensor), every other
    element of every tensor within 1.1e-6. So M = 1 allows that tensor-level noise (2e-5) but checks the
    elements: at most one per tensor beyond 1e-5, none beyond the 3 steps' AdamW displacement (3 x lr)."""
    ref_losses, ref_w = cached_reference(tiny_model, f"train.accum={accum}")
    losses, reader = run_pipeline(tiny_model, str(tmp_path), f"backend={backend}", f"train.accum={accum}")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5
    if accum > 1:
        _check_weights(reader, ref_w, 1e-5)
        return
    _check_weights(reader, ref_w, 2e-5)
    for name, w in ref_w.items():
        d = (reader.get(f"master.{name}").double() - w.double()).abs()
        assert int((d > 1e-5).sum()) <= 1 and float(d.max()) <= 3 * 1e-3, (name, int((d > 1e-5).sum()), float(d.max()))


def test_eval_loss_matches_reference(tiny_model, tmp_path):
    """Held-out loss computed through the 3-stage pipeline equals the reference model's on the same batches."""
    import json

    from npu_train.data.batches import micro_batch_tensors
    from npu_train.model.llama import causal_lm_loss_sum, full_model
    from npu_train.model import load_config, load_tensors
    from npu_train.data.prepare import prepare_data
    from conftest import make_cfg

    _, ref_w = cached_reference(tiny_model)
    run_pipeline(tiny_model, str(tmp_path), "backend=[cpu,cpu,cpu]", "data.eval_batches=3")
    with open(tmp_path / "eval.jsonl") as f:
        evals = [json.loads(l) for l in f]
    assert [e["step"] for e in evals] == [0, 3]
    cfg = load_config(tiny_model)
    data = prepare_data(make_cfg(tiny_model), tiny_model, cfg)
    batches = [micro_batch_tensors(data, torch.arange(2 * m, 2 * m + 2), split="val") for m in range(3)]

    def val_loss(weights):
        model = full_model(cfg)
        model.load_named_tensors(weights)
        with torch.no_grad():
            sums = [causal_lm_loss_sum(model(x), y) for x, y in batches]
        return sum(float(s) for s, _ in sums) / sum(n for _, n in sums)

    init = load_tensors(tiny_model, cfg, full_model(cfg).param_names())
    assert abs(evals[0]["val_loss"] - val_loss(init)) / val_loss(init) < 1e-5
    assert abs(evals[1]["val_loss"] - val_loss(ref_w)) / val_loss(ref_w) < 1e-5


@pytest.mark.parametrize("schedule", ["zb", "zb-h2"])
def test_bf16_zb_equals_1f1b(tiny_model, tmp_path, schedule):
    """bf16 compute: the split backward's W gradients are folded into the fp32 accumulators per
    micro-batch, as the full backward's are, so a zb run equals the 1F1B run on the same split, bit
    for bit (losses and every checkpoint tensor). When W summed the micro-batches' gradients in bf16
    (the bug this test was written for) the step-1 global grad norm already differed by 2.4e-5
    relative; the fp32 tests cannot see it (no fold there)."""
    ov = ("backend=[cpu,cpu]", "train.dtype=bf16", "train.split=[4,2]")
    la, ra = run_pipeline(tiny_model, str(tmp_path / "f"), *ov, "train.schedule=1f1b")
    lb, rb = run_pipeline(tiny_model, str(tmp_path / "z"), *ov, f"train.schedule={schedule}")
    assert la == lb, (la, lb)
    keys = [k for k in ra.manifest["index"] if not k.startswith("rng.")]
    assert keys and keys == [k for k in rb.manifest["index"] if not k.startswith("rng.")]
    for k in keys:
        assert torch.equal(ra.get(k), rb.get(k)), k


def _prompt_completion_rows(tmp_path, n=200):
    """Short prompt/completion rows cut from Botchan (the tiny model has no chat template: plain text +
    EOS); 20-40 tokens each, so several fit in a sequence of 96."""
    import re

    from npu_train.data.text import botchan_text

    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", botchan_text()) if 8 < len(s.strip())]
    rows = [{"prompt": sents[i][:20 + i % 25], "completion": " " + sents[i + 1][:15 + (i * 7) % 30]}
            for i in range(n)]
    p = tmp_path / "pc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_packed_sft_pipeline_matches_reference(tiny_model, tmp_path, schedule):
    """data.pack=true (the default): 2 stages, each looking up its micro-batches' positions, equal the
    reference that runs every packed sample alone (reference.ref_segments)."""
    from npu_train.data.prepare import prepare_data
    from npu_train.model import load_config
    from conftest import make_cfg

    ov = (f"data.source={_prompt_completion_rows(tmp_path)}", "data.format=prompt_completion", "data.seq_len=96")
    data = prepare_data(make_cfg(tiny_model, *ov), tiny_model, load_config(tiny_model))
    starts = (data.train_positions == 0).sum(1)
    assert data.train_positions is not None and float(starts.float().mean()) > 2, starts  # really packed
    ref_losses, ref_w = reference_for(tiny_model, *ov)
    losses, reader = run_pipeline(tiny_model, str(tmp_path / "run"), "backend=[cpu,cpu]", f"train.schedule={schedule}",
                                  *ov)
    assert len(losses) == 3 and reader.step == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    _check_weights(reader, ref_w, 1e-5)


@pytest.mark.parametrize("backend", ["[cpu,cpu]", "[cpu,cpu,cpu]"])
def test_family_pipeline_matches_reference(tiny_family_model, tmp_path, backend):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 24 != 64 / 4, untied) and Mistral: P = 2 and 3 runs
    equal the reference, whose decoder is written from the formulas (reference.RefDecoder), 1e-5 relative.
    Mutations run (each seen failing here): q/k/v biases dropped from Attention.forward; q_norm skipped."""
    ref_losses, ref_w = cached_reference(tiny_family_model)
    losses, reader = run_pipeline(tiny_family_model, str(tmp_path), f"backend={backend}")
    assert len(losses) == 3 and reader.step == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    _check_weights(reader, ref_w, 1e-5)
    assert any(n.endswith((".bias", "q_norm.weight")) for n in ref_w) or "mistral" in tiny_family_model


def test_family_offloaded_layers_match_reference(tiny_family_model, tmp_path):
    """Every layer offloaded (host AdamW over the 1-D biases and q/k norm gains too) at P = 2 equals the
    reference within 1e-5 relative, as the resident runs do."""
    ref_losses, ref_w = cached_reference(tiny_family_model)
    losses, reader = run_pipeline(tiny_family_model, str(tmp_path), "backend=[cpu,cpu]", "train.resident_layers=0")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    _check_weights(reader, ref_w, 1e-5)


def test_a_validation_split_smaller_than_a_micro_batch_is_evaluated(tiny_model, tmp_path, capsys):
    """One held-out row and micro-batches of 2: the evaluation once ran nothing and said nothing
    (``first_val_loss`` null). Now the row is evaluated, padded to the micro-batch with an untrained row: the
    loss is the reference model's over that row alone, and the launch says so once."""
    import json

    from conftest import make_cfg
    from npu_train.data.batches import micro_batch_tensors
    from npu_train.data.prepare import prepare_data
    from npu_train.model import load_config, load_tensors
    from npu_train.model.llama import causal_lm_loss_sum, full_model

    few = ("data.val_fraction=0.0003", "train.steps=1")
    cfg = load_config(tiny_model)
    data = prepare_data(make_cfg(tiny_model, *few), tiny_model, cfg)
    assert data.n_val == 1  # the case: fewer held-out rows than a micro-batch (2)
    run_pipeline(tiny_model, str(tmp_path), *few)
    out = capsys.readouterr().out
    assert "note: evaluation runs on 1 held-out row(s), fewer than a micro-batch (2)" in out
    assert "start-up: model load (card " in out and "start-up: evaluation after step 0 (card " in out
    with open(tmp_path / "eval.jsonl") as f:
        first = json.loads(f.readline())
    x, y = micro_batch_tensors(data, torch.arange(0, 1), split="val")
    model = full_model(cfg)
    model.load_named_tensors(load_tensors(tiny_model, cfg, model.param_names()))
    with torch.no_grad():
        s, n = causal_lm_loss_sum(model(x), y)
    assert first["step"] == 0 and first["tokens"] == n
    assert abs(first["val_loss"] - float(s) / n) / (float(s) / n) < 1e-5
