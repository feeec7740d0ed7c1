"""The plan bounds every card's memory at real shapes from bf16 checkpoints (issue 43): a random Qwen2.5-0.5B
(0.49 B, 151936 vocabulary, q/k/v biases) saved by transformers in bf16 with SmolLM2's tokenizer, on two cpu
cards: LoRA with ``placement.capacity_gib`` squeezed until ``auto`` picks activation recompute, and DPO with
``train.recompute=true``. Each card's RssAnon + RssShmem is sampled from outside every 0.1 s through every
phase (load, reference pass, evaluation, steps, save: tests/memwatch.py) and must stay within its plan;
``summary.json`` must report the run's peak per phase from the same measure. Short sequences keep each run to
a few minutes on 2 cores (the full fine-tuning from bf16 is tests/e2e/test_scale.py)."""
from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1200)]

G = 2**30
RUN = ("data.seq_len=64", "train.micro_batch=1", "train.accum=2", "train.steps=2", "train.save_every=1",
       "data.eval_batches=1", "train.mode=lora", "runtime.startup_timeout_s=900", "runtime.heartbeat_timeout_s=300",
       "checkpoint.keep=0")
#: the capacity per card at which the LoRA run's plan fits with recompute only (checked in the test;
#: plan=true with the cpu baseline at the measured 0.15 GiB + the 0.10 GiB runtime constant: ZB-V without recompute
#: fits from 1.72 GiB; interleaved + recompute of the fewest layers from 1.71 (10/5 per card) to 1.68 (12/7),
#: nothing fits at 1.66)
SQUEEZED_GIB = 1.70


@pytest.fixture(scope="module")
def qwen05b(tmp_path_factory):
    import importlib.util

    # by path: experiments/bench also holds a memwatch.py, which must not shadow tests/memwatch.py
    spec = importlib.util.spec_from_file_location("make_bf16_model",
                                                  os.path.join(ROOT, "experiments", "bench", "make_bf16_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make("qwen2.5-0.5b", str(tmp_path_factory.mktemp("qwen05b") / "model"))


def _watched(tmp_path, model, *overrides, name):
    from launch_util import watched_job

    job, peaks = watched_job(tmp_path, model, *RUN, *overrides, name=name, timeout=1100,
                             env={"NPT_CALIBRATE": "never", "NPT_CACHE": str(tmp_path / "cache")})
    with open(os.path.join(job.run_dir, "plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(job.run_dir, "summary.json")) as f:
        summ = json.load(f)
    return plan, peaks, summ


def _check(plan, peaks, summ):
    limits = {st["card"]: int(st["mem"]["total"]) for st in plan["stages"]}
    report = {c: {"plan": limits[c] / G, "peak": peaks[c].anon_shared / G,
                  **{ph: v / G for ph, v in peaks[c].by_phase.items()}} for c in limits}
    print(json.dumps(report, indent=1))
    for c, limit in limits.items():
        assert peaks[c].anon_shared <= limit, f"{c}: peak {peaks[c].anon_shared / G:.2f} GiB > plan {limit / G:.2f}: {report}"
    # the cards' own report: every phase, the load included, from the measure the plan bounds
    assert {"load", "steps", "save"} <= set(summ["phase_peak_mem_bytes"])
    for i, c in enumerate(limits):
        own = summ["run_peak_mem_bytes"][i]
        assert own <= peaks[c].anon_shared * 1.05 + 64 * 2**20, (c, own, report)  # sampled in-process: not above


def test_lora_squeezed_until_auto_picks_recompute(tmp_path, qwen05b):
    plan, peaks, summ = _watched(tmp_path, qwen05b, f"placement.capacity_gib={SQUEEZED_GIB}", name="squeezed")
    assert plan["shape"]["checkpoint_dtype"] == "bf16", plan["shape"]
    assert plan["shape"]["recompute"], (f"auto did not pick recompute at placement.capacity_gib={SQUEEZED_GIB} "
                                        f"(the planner changed): lower SQUEEZED_GIB until it does; {plan['shape']}")
    _check(plan, peaks, summ)


def test_dpo_lora_with_recompute(tmp_path, qwen05b):
    plan, peaks, summ = _watched(tmp_path, qwen05b, "train.micro_batch=2", "train.objective=dpo", "data.format=preference",
                                 "data.source=botchan-prefs", "train.recompute=true", "train.schedule=1f1b",
                                 name="dpo")
    assert plan["shape"]["recompute"]
    _check(plan, peaks, summ)
    assert "reference" in summ["phase_peak_mem_bytes"]
