"""Model FLOPs utilisation (MFU): the model FLOPs a training step needs over what the cards could do at peak.

MFU = model FLOPs per step / (step wall time (s) x peak FLOP/s), per card and for the job (sums of both).
Model FLOPs count what training the model needs, not what this run executes: activation recompute is not
counted (PaLM's convention, Chowdhery et al. 2022, appendix B). Per token and decoder layer:

- linear layers: 2 FLOPs per parameter and token per pass; full fine-tuning runs three passes (forward,
  input gradient, weight gradient: 6 N, Kaplan et al. 2020); LoRA runs the frozen base's forward and input
  gradient only (4 N) and all three for the adapters (6 A);
- attention scores and the weighted sum: 4 S h d forward (QK^T and AV, 2 FLOPs each, h query heads of
  head_dim d over the sequence S; causal masking not discounted, as in PaLM), twice that backward: 12 S h d;
- lm_head: 6 V H per token (full), 4 V H (LoRA: frozen head); the embedding lookup has no FLOPs.

The same formulas drive the placement model's step time (:mod:`npu_train.planner.cost`; a unit test keeps the
two equal). Peaks (:func:`spec_peak_flops`): RNGD 256 TFLOPS bf16 (FuriosaAI's RNGD product page); NVIDIA
dense tensor-core bf16 / fp32 (non-tensor) figures from the data sheets; anything else, and every CPU, is
measured on the card itself with a square matmul (:func:`measure_matmul_flops`). No torch at import.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Peak", "train_flops_per_token", "stage_flops_per_step", "spec_peak_flops", "measure_matmul_flops",
           "cpu_clock", "mfu"]

#: FuriosaAI RNGD: 256 TFLOPS bf16 (512 TFLOPS fp8); fp32 runs in bf16 on the card's matrix engine
RNGD_BF16_FLOPS = 256e12

#: NVIDIA data-sheet peaks (dense, no sparsity), FLOP/s: name fragment -> (bf16 tensor core, fp32 non-tensor).
#: Matched in order against ``torch.cuda.get_device_name`` (first fragment contained wins).
CUDA_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),  # SXM
    ("GH200", 989e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("V100", 125e12, 15.7e12),  # fp16 tensor core (no bf16)
)


@dataclass(frozen=True)
class Peak:
    """A card's peak FLOP/s in the run's compute dtype and where the figure comes from."""

    flops: float
    source: str


def train_flops_per_token(num_layers_params: int, seq_len: int, num_heads: int, head_dim: int,
                          embedding_params: int, lora_params_per_layer: int = 0) -> tuple[float, float]:
    """``(per decoder layer, lm_head)`` model FLOPs per token of one training step (module docstring).

    ``num_layers_params``: parameters of one decoder layer; ``embedding_params``: V x H (the lm_head's);
    ``lora_params_per_layer``: adapter parameters per layer (0 = full fine-tuning)."""
    a = int(lora_params_per_layer)
    base = 4.0 if a else 6.0
    layer = base * num_layers_params + 6.0 * a + 12.0 * seq_len * num_heads * head_dim
    return layer, base * embedding_params


def stage_flops_per_step(model, n_layers: int, has_head: bool, seq_len: int, tokens_per_step: int,
                         lora_params_per_layer: int = 0) -> float:
    """Model FLOPs of one optimizer step on a stage of ``n_layers`` decoder layers (+ the lm_head when
    ``has_head``) over ``tokens_per_step`` = micro_batch x seq_len x micro-batches positions. ``model``: a
    :class:`~npu_train.model.config.LlamaConfig`; a mixture of experts counts its active (top-k) parameters and
    ``lora_params_per_layer`` the adapters a token passes through (``RunShape.active_adapter_params``)."""
    layer, head = train_flops_per_token(model.active_params_per_layer(), seq_len, model.num_heads, model.head_dim,
                                        model.embedding_params(), lora_params_per_layer)
    return float(tokens_per_step) * (n_layers * layer + (head if has_head else 0.0))


def spec_peak_flops(kind: str, dtype: str, device_name: str = "") -> Optional[Peak]:
    """The data-sheet peak of a ``kind`` card (``device_name``: ``torch.cuda.get_device_name``) for compute
    ``dtype`` (``"bf16"`` / ``"fp32"``), or None when there is none (CPU, an unknown GPU)."""
    if kind == "furiosa":
        return Peak(RNGD_BF16_FLOPS, "RNGD spec 256 TFLOPS bf16")
    if kind == "cuda":
        for frag, bf16, fp32 in CUDA_PEAKS:
            if frag in device_name:
                f = bf16 if dtype == "bf16" else fp32
                return Peak(f, f"{frag} data sheet {f / 1e12:g} TFLOPS {dtype}")
    return None


def measure_matmul_flops(device, dtype, sync: Callable[[], None] = lambda: None, n: int = 1024,
                         reps: int = 5, min_s: float = 0.5, max_reps: int = 200) -> float:
    """Best FLOP/s of ``[n, n] @ [n, n]`` matmuls (``2 n^3`` FLOPs each) on ``device`` in torch ``dtype``, after
    one warm-up; ``sync`` waits for the device. At least ``reps`` trials and more until ``min_s`` seconds have
    passed (at most ``max_reps``): a busy host (the other card processes starting up beside this one) measured
    a CPU peak of half the real one when 5 back-to-back trials all met the same busy tens of ms, and a
    CPU training step then showed an MFU of 126-243 %. About 2 GFLOP a matmul at n = 1024. On a cpu at one torch
    thread each trial is timed in the thread's CPU time (:func:`cpu_clock`): on a shared host the wall time
    of every trial also held other processes' time slices (a best of 11 trials read 62 GFLOP/s at load 12
    where the core does 148)."""
    import torch

    # constant operands, no random numbers: the card's RNG state must not move (an exact resume restores it
    # before this runs; dense matmul time does not depend on the values)
    a = torch.full((n, n), 0.5, device=device, dtype=dtype)
    b = torch.full((n, n), 0.25, device=device, dtype=dtype)
    (a @ b)
    sync()
    clock = cpu_clock(device)
    best = float("inf")
    start = time.perf_counter()
    for i in range(max(int(reps), int(max_reps))):
        if i >= reps and time.perf_counter() - start >= min_s:
            break
        t0 = clock()
        (a @ b)
        sync()
        best = min(best, clock() - t0)
    return 2.0 * n ** 3 / max(best, 1e-9)


def cpu_clock(device) -> Callable[[], float]:
    """The clock a benchmark on ``device`` times with: the calling thread's CPU time (``time.thread_time``, in
    seconds) on a cpu at one torch thread, where all the work runs in this thread, and at several with passive
    OpenMP waits (its serial part and its share of each parallel region:
    :func:`~npu_train.hostmem.passive_waits`): the time the host's other processes held the core is not
    counted, so a busy host does not read as a slow core; else the wall clock (``time.perf_counter``: spinning
    threads, or a device that works while the host waits)."""
    import torch

    from npu_train.hostmem import passive_waits

    if str(device) == "cpu" and (torch.get_num_threads() == 1 or passive_waits()):
        return time.thread_time
    return time.perf_counter


def mfu(flops: float, seconds: float, peak: float) -> Optional[float]:
    """``flops / (seconds * peak)`` (a fraction, not %), or None when the time or the peak is not positive."""
    if seconds <= 0 or peak <= 0:
        return None
    return flops / (seconds * peak)
