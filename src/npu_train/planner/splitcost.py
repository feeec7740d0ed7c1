"""The zero-bubble split's cost in seconds, for the calibration (``Rates.split_backward_ratio``).

B + W cost one backward in FLOPs but not in seconds; :func:`split_backward_ratio` times the
difference on a small stage of the model's layers, as the card processes run it
(:mod:`npu_train.pipeline.backward`, the graph cut per layer). Called by
:func:`npu_train.planner.measure.measure_at`.
"""
from __future__ import annotations

from statistics import median

from npu_train.planner import measure
from npu_train.planner.measure import LoopBounds, torch_dtype

__all__ = ["split_backward_ratio", "SPLIT_ROUNDS", "SPLIT_LAYERS"]

#: rounds of the interleaved split-vs-full backward timing (:func:`split_backward_ratio`). 5: with 3, one
#: calibration under the job's 2-process load measured 1.009 where the same figure alone gave 1.07-1.115
#: (experiments/2026-12-02-head.md), and the plan put one layer too many on the last stage
SPLIT_ROUNDS = 5
#: decoder layers of the stage :func:`split_backward_ratio` times (the ratio grows with a stage's depth)
SPLIT_LAYERS = 4


def split_backward_ratio(backend, dtype_name: str, dims, loop: LoopBounds, rounds: int = SPLIT_ROUNDS,
                         layers: int = SPLIT_LAYERS) -> float:
    """``split_backward_ratio``: seconds of a stage of ``layers`` decoder layers of shape ``dims``
    through forward + input-gradient pass + deferred weight-gradient pass, as the zero-bubble
    schedules run it on every stage but the first (graph cut per layer, :func:`npu_train.pipeline.
    backward.backward_input` then :meth:`~npu_train.pipeline.backward.WeightGradWork.run`), over
    forward + one ``backward()`` of the same stage and input. Median of ``rounds`` rounds, each timing
    both back to back, so the machine's drift cancels as in :func:`npu_train.planner.measure._head_vs_layer`.

    Why it is measured: B + W cost one backward in FLOPs, not in seconds on a CPU core. On the
    2-core VM, SmolLM2 layers at 1 x 128 tokens, fp32, 1 thread (experiments/2026-12-01-bench-run7.md):
    1.06 for one layer, 1.07-1.08 for 2, 1.085-1.105 for 4, 1.11-1.12 for 11 (the ratio grows with the
    depth: every layer's activations are held until W); a planner that counted the two alike put
    one layer too many on the last stage of the 2-card default job under ``zb-h2``. ``layers``
    = 4 stands for a stage of a few to a dozen layers."""
    import torch

    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import StageModule
    from npu_train.pipeline.backward import backward_input

    H, I, heads, kv, b, S = dims
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=I, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, name="calibration-stage")
    dt = torch_dtype(dtype_name)
    dev = backend.device()
    with backend.alloc_lock():
        stage = StageModule(cfg, 0, layers, False, False).to(dtype=dt).to(dev)
        x = torch.randn(b, S, H, dtype=dt, device=dev, requires_grad=True)
        g = torch.randn(b, S, H, dtype=dt, device=dev)
    params = list(stage.parameters())

    def full() -> None:
        with backend.alloc_lock():
            stage(x).backward(g)

    def split() -> None:
        with backend.alloc_lock():
            cuts: list = []
            _, work = backward_input(stage(x, cuts=cuts), g, x, params, cuts=cuts)
            work.run()

    return median(t_split / t_full for t_full, t_split in
                  measure.timed_pairs(full, split, backend.synchronize, loop, rounds))
