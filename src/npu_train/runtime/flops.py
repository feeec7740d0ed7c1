"""The job's model FLOPs per card and the MFU the plan predicts (:mod:`npu_train.metrics.mfu` has the formulas).

:func:`model_flops_per_rank` feeds the reporter (the cards report their peaks with each step);
:func:`predicted_mfu_line` is printed under the plan table (``plan=true`` and every launch).
"""
from __future__ import annotations

import time
from typing import Optional

from npu_train.metrics.mfu import Peak, measure_matmul_flops, mfu, spec_peak_flops, stage_flops_per_step
from npu_train.planner.spec import duration

__all__ = ["model_flops_per_rank", "predicted_peak", "predicted_mfu_line", "measured_compute_rate", "first_plan_flops"]


def model_flops_per_rank(prep) -> list[float]:
    """Model FLOPs of one optimizer step of every card of the job (global rank order: replica x stages),
    from the plan's split and the run shape (``prep``: the launcher's ``Prepared``); vocabulary-parallel, the
    head's FLOPs shared by the cards in proportion to their rows of it."""
    sh = prep.shape
    tokens = sh.tokens_per_micro_batch * sh.micro_batches
    vocab = sh.vocab_parallel  # the head's FLOPs on every card, by its rows (pipeline/vocab.py::vocab_rows)
    per_stage = [stage_flops_per_step(prep.model_cfg, s.num_layers, s.has_head and not vocab, sh.seq_len, tokens,
                                      sh.active_adapter_params) for s in prep.plan.stages]
    if vocab:
        V, P = prep.model_cfg.vocab_size, len(per_stage)
        head = stage_flops_per_step(prep.model_cfg, 0, True, sh.seq_len, tokens, sh.active_adapter_params)
        per_stage = [f + head * (V // P + (1 if i < V % P else 0)) / V for i, f in enumerate(per_stage)]
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
#: time in aten::mm, the rest norms, RoPE, SwiGLU, attention, autograd: experiments/2026-11-29-placement-validation.md);
#: only the fallback of :func:`first_plan_flops` now (the default job's layer runs at 62 % of this host's matmul)
LAYER_OF_MATMUL = 0.85
#: the first plan times one layer of the job's shape when its FLOPs (6 x tokens x layer params) are at most this
#: (about 1-2 s a repetition on one core; the tokens of a larger micro-batch are halved to fit) ...
FIRST_PLAN_LAYER_FLOPS = 2e11
#: ... and its parameters and their gradients at most this many bytes (the launcher holds them for the probe)
FIRST_PLAN_LAYER_BYTES = 1 << 30


def first_plan_flops(dtype: str, threads: int, model_cfg=None, batch_seq=None) -> Peak:
    """The compute rate (FLOP/s, with its source) a cpu card's first plan uses when nothing is fitted or
    calibrated: one decoder layer of the job's own shape (``model_cfg``: a LlamaConfig; ``batch_seq``: the
    job's (micro-batch, sequence length)) forward + backward in ``dtype`` at ``threads`` torch threads, its
    FLOPs over the fastest of a few repetitions, each timed by :func:`~npu_train.metrics.mfu.cpu_clock`
    (one thread, or several with passive OpenMP waits: CPU time, so a busy host does not read as a slow
    core; at 2 threads with spinning waits it planned 92.47 s a step against 3.8-8.4 s). A bare 1024^2
    matmul x :data:`LAYER_OF_MATMUL` predicted the default job at 3.83 s a step against 5-7 s measured: its small
    matrices (576 x 1536, 256 tokens) run at 62 % of the big matmul's rate here, not 85 %. Falls back to the
    matmul (:func:`predicted_peak`) x :data:`LAYER_OF_MATMUL` without a shape, for a mixture of experts, or for a
    layer above :data:`FIRST_PLAN_LAYER_BYTES`."""
    m = model_cfg
    nbytes = 2 if dtype == "bf16" else 4
    if (m is None or batch_seq is None or getattr(m, "is_moe", False)
            or 2 * nbytes * m.params_per_layer() > FIRST_PLAN_LAYER_BYTES):
        peak = predicted_peak("cpu", dtype, threads)
        return Peak(peak.flops * LAYER_OF_MATMUL, f"matmul measured here x {LAYER_OF_MATMUL:g}, no run fitted yet")
    b, S = max(1, int(batch_seq[0])), max(2, int(batch_seq[1]))
    while 6.0 * b * S * m.params_per_layer() > FIRST_PLAN_LAYER_FLOPS and b * S > 64:
        b, S = (b // 2, S) if b > 1 else (b, max(2, S // 2))
    dims = (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, b, S)
    flops = _time_layer(dtype, threads, dims)
    return Peak(flops, f"one layer of this model, b={b} S={S}, timed here; no run fitted yet")


def _time_layer(dtype: str, threads: int, dims, min_reps: int = 2, min_s: float = 0.5, max_reps: int = 10) -> float:
    """FLOP/s of :func:`~npu_train.calibrate.measure.layer_train_step` at ``dims``: its FLOPs over the fastest of
    at least ``min_reps`` repetitions after one warm-up, more until ``min_s`` seconds (at most ``max_reps``)."""
    import torch

    from npu_train.backends.registry import make_backend
    from npu_train.calibrate.measure import layer_train_step

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    # the layer's random weights and inputs must not move the launcher's RNG (nothing the job draws may change)
    with torch.random.fork_rng(devices=[]):
        try:
            return _fastest(layer_train_step(make_backend("cpu"), dtype, dims), min_reps, min_s, max_reps)
        finally:
            torch.set_num_threads(before)


def _fastest(step_flops, min_reps: int, min_s: float, max_reps: int) -> float:
    """FLOPs over the fastest repetition of ``step`` (``step_flops`` = (step, flops)) by
    :func:`~npu_train.metrics.mfu.cpu_clock`, after one warm-up."""
    from npu_train.metrics.mfu import cpu_clock

    step, flops = step_flops
    step()
    clock = cpu_clock("cpu")
    best, start = float("inf"), time.perf_counter()
    for i in range(max_reps):
        if i >= min_reps and time.perf_counter() - start >= min_s:
            break
        t0 = clock()
        step()
        best = min(best, clock() - t0)
    return flops / max(best, 1e-9)


def measured_compute_rate(rates, kind: str, dtype: str, threads: int, model_cfg=None, batch_seq=None):
    """``rates`` of a ``kind`` card with the compute rate of ``dtype`` set to :func:`first_plan_flops` when it is
    only assumed: a cpu card on a machine with no fitted run and no calibration profile. The first plan on a
    new machine then times compute with what this machine does, not a figure from another (a 0.63 B model:
    59.4 s predicted at the assumed 50 GFLOP/s against 39.1 s measured). Accelerators keep their data-sheet
    figures (the launcher does not touch a card). One measurement per process and setting."""
    if kind != "cpu" or not rates.resolve(dtype).source("device_flops").startswith("assumed"):
        return rates
    m = model_cfg
    key = (dtype, int(threads), tuple(batch_seq) if batch_seq else None, None if m is None else (
        m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.params_per_layer(), m.is_moe))
    if key not in _FIRST_PLAN:
        _FIRST_PLAN[key] = first_plan_flops(dtype, threads, model_cfg, batch_seq)
    got = _FIRST_PLAN[key]
    rates.flops_by_dtype[dtype] = got.flops
    rates.sources[f"device_flops[{dtype}]"] = got.source
    return rates


_FIRST_PLAN: dict = {}


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
    return (f"predicted MFU {100 * m:.1f}% (model FLOPs {sum(flops):.3g} per step in {duration(prep.plan.step_time_s)}; "
            f"peak: {'; '.join(sources)})")
