"""The job's model FLOPs per card and the MFU the plan predicts (:mod:`npu_train.metrics.mfu` has the formulas).

:func:`model_flops_per_rank` feeds the reporter (the cards report their peaks with each step);
:func:`predicted_mfu_line` is printed under the plan table (``plan=true`` and every launch).
"""
from __future__ import annotations

from typing import Optional

from npu_train.metrics.mfu import Peak, measure_matmul_flops, mfu, spec_peak_flops, stage_flops_per_step

__all__ = ["model_flops_per_rank", "predicted_peak", "predicted_mfu_line", "measured_compute_rate"]


def model_flops_per_rank(prep) -> list[float]:
    """Model FLOPs of one optimizer step of every card of the job (global rank order: replica x stages),
    from the plan's split and the run shape (``prep``: the launcher's ``Prepared``)."""
    sh = prep.shape
    tokens = sh.tokens_per_micro_batch * sh.micro_batches
    per_stage = [stage_flops_per_step(prep.model_cfg, s.num_layers, s.has_head, sh.seq_len, tokens,
                                      sh.active_adapter_params) for s in prep.plan.stages]
    return per_stage * int(prep.dp)


def predicted_peak(kind: str, dtype: str, threads: int, _measured: dict = {}) -> Optional[Peak]:  # noqa: B006
    """The peak the plan's MFU uses for a ``kind`` card: the data sheet's (RNGD; for CUDA the local GPU's name
    when torch sees one, else H100 assumed as the planner's default rates do), else a CPU matmul measured
    here at ``threads`` threads (once per process and setting)."""
    if kind == "cuda":
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
        return spec_peak_flops(kind, dtype, name)
    if kind != "cpu":
        return spec_peak_flops(kind, dtype)
    key = (dtype, int(threads))
    if key not in _measured:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(max(1, int(threads)))
        try:
            _measured[key] = measure_matmul_flops("cpu", torch.bfloat16 if dtype == "bf16" else torch.float32)
        finally:
            torch.set_num_threads(before)
    f = _measured[key]
    return Peak(f, f"matmul measured here {f / 1e9:.1f} GFLOP/s {dtype} at {threads} thread(s)")


#: a decoder layer's forward + backward on a CPU runs at 81-88 % of a bare 1024^2 matmul's FLOP/s (86 % of its
#: time in aten::mm, the rest norms, RoPE, SwiGLU, attention, autograd: experiments/2026-11-29-placement-validation.md)
LAYER_OF_MATMUL = 0.85


def measured_compute_rate(rates, kind: str, dtype: str, threads: int):
    """``rates`` of a ``kind`` card with the compute rate of ``dtype`` set to the matmul peak measured here
    (:func:`predicted_peak`, the figure the MFU line uses) x :data:`LAYER_OF_MATMUL` when it is only assumed: a cpu card on a machine with
    no fitted run and no calibration profile. The first plan on a new machine then times compute with what
    this machine does, not a figure from another (a 0.63 B model: 59.4 s predicted at the assumed 50 GFLOP/s
    against 39.1 s measured). Accelerators keep their data-sheet figures (the launcher does not touch a card)."""
    if kind != "cpu" or not rates.resolve(dtype).source("device_flops").startswith("assumed"):
        return rates
    peak = predicted_peak(kind, dtype, threads)
    rates.flops_by_dtype[dtype] = peak.flops * LAYER_OF_MATMUL
    rates.sources[f"device_flops[{dtype}]"] = f"matmul measured here x {LAYER_OF_MATMUL:g}, no run fitted yet"
    return rates


def predicted_mfu_line(prep) -> Optional[str]:
    """``"predicted MFU 4.1% (model FLOPs 1.2e+12 per step in 11.19 s; peak per card: ...)"``, or None when a
    card has no known peak."""
    flops = model_flops_per_rank(prep)
    peaks = []
    for i, st in enumerate(prep.plan.stages):
        p = predicted_peak(st.card.kind, prep.dtype, prep.threads)
        rates = prep.plan.rates[i] if i < len(prep.plan.rates) else None
        if p is not None and rates is not None and rates.device_flops > p.flops:
            # the plan's sustained rate above the measured peak: the measurement met a busy host (or the rate
            # is assumed); the step's FLOP/s cannot exceed the peak, so the rate bounds it from below
            p = Peak(rates.device_flops, f"the plan's {rates.device_flops / 1e9:.1f} GFLOP/s (above the {p.source})")
        peaks.append(p)
    peaks = peaks * int(prep.dp)
    if any(p is None for p in peaks) or not prep.plan.step_time_s:
        return None
    m = mfu(sum(flops), prep.plan.step_time_s, sum(p.flops for p in peaks))
    if m is None:
        return None
    sources = sorted({p.source for p in peaks})
    return (f"predicted MFU {100 * m:.1f}% (model FLOPs {sum(flops):.3g} per step in {prep.plan.step_time_s:.2f} s; "
            f"peak: {'; '.join(sources)})")
