"""The zero-bubble split's cost in seconds (``Rates.split_backward_ratio``): B + W cost one backward in
FLOPs but not in seconds.
"""
from __future__ import annotations

from statistics import median

from npu_train.calibrate.timing import LoopBounds, timed_pairs, torch_dtype

__all__ = ["split_backward_ratio", "SPLIT_ROUNDS", "SPLIT_LAYERS"]

#: rounds of the interleaved split-vs-full backward timing (5, not 3: experiments/2026-12-02-head.md)
SPLIT_ROUNDS = 5
#: decoder layers of the stage :func:`split_backward_ratio` times (the ratio grows with a stage's depth)
SPLIT_LAYERS = 4


def split_backward_ratio(backend, dtype_name: str, dims, loop: LoopBounds, rounds: int = SPLIT_ROUNDS,
                         layers: int = SPLIT_LAYERS) -> float:
    """Seconds of forward + B + W of a ``layers``-layer stage (cut per layer, as the runner does) over forward
    + ``backward()``; median of ``rounds`` back-to-back pairs. ``layers`` = 4 stands for a stage of a few to
    a dozen layers (experiments/2026-12-01-bench-run7.md)."""
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
                  timed_pairs(full, split, backend.synchronize, loop, rounds))
