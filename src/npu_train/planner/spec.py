"""What is planned: the run shape (:class:`RunShape`) and the
planner's user error (:class:`PlacementError`). Units: ``*_bytes`` are bytes; :func:`gb` converts
to decimal gigabytes (1e9 B), :func:`gib` to binary gibibytes (2**30 B); the plan table prints
GiB. Card capacities are GiB figures (RNGD: 47.5 GiB usable = 51.0 GB, :mod:`npu_train.hardware`).
"""
from __future__ import annotations

from dataclasses import dataclass

from npu_train.errors import UserError
from npu_train.hardware import GB, GIB
from npu_train.pipeline.schedule import SCHEDULES

__all__ = ["PlacementError", "RunShape", "gb", "gib"]


def gb(x: float) -> float:
    """Bytes -> decimal gigabytes (1 GB = 1e9 B)."""
    return x / GB


def gib(x: float) -> float:
    """Bytes -> binary gibibytes (1 GiB = 2**30 B)."""
    return x / GIB


class PlacementError(UserError, ValueError):
    """A placement that cannot work: over a card's capacity, too little host RAM, or an
    impossible layout (more cards than layers, more resident layers than a card holds).
    The message names the card, the predicted and available GiB and the fixes."""


@dataclass
class RunShape:
    """What one optimizer step processes.

    Attributes:
        seq_len: tokens per sequence S.
        micro_batch: sequences per micro-batch b.
        micro_batches: micro-batches per step M (= gradient-accumulation steps).
        schedule: a pipeline schedule of :data:`npu_train.pipeline.schedule.SCHEDULES`
            (``"1f1b"``, ``"gpipe"``).
        dtype: compute dtype, ``"bf16"`` or ``"fp32"``.
        recompute: activation recomputation (checkpoint each decoder layer's input).
        lora_params_per_layer: 0 = full fine-tuning; > 0 = LoRA with this many trainable adapter
            parameters per decoder layer (frozen base in the compute dtype, no gradient or optimizer
            state for it; embedding, norms and head frozen).
        grad_accum: where gradients accumulate over the M micro-batches: ``"fp32"`` (default:
            fp32 accumulators on the card, 4 B/param, whatever the compute dtype) or
            ``"compute"`` (the parameters' ``.grad`` in the compute dtype, ``e`` B/param: what
            the predecessor system on RNGD did, the condition of the field record).
        offload: how the offloaded layers' host AdamW + upload meet the pipeline
            (:func:`npu_train.planner.cost.hidden_host_time`): ``"serial"``
            (``train.offload_overlap=false``), ``"overlap"`` (the default) or ``"delayed"``
            (``train.offload_update=delayed``).

    Raises:
        ValueError: a count below 1, an unknown schedule, dtype, grad_accum or offload.
    """

    seq_len: int
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    dtype: str = "bf16"
    recompute: bool = False
    lora_params_per_layer: int = 0
    grad_accum: str = "fp32"
    offload: str = "overlap"

    def __post_init__(self) -> None:
        for k in ("seq_len", "micro_batch", "micro_batches"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"RunShape.{k} must be >= 1, got {getattr(self, k)!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RunShape.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"RunShape.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.offload not in ("serial", "overlap", "delayed"):
            raise ValueError(f"RunShape.offload must be 'serial', 'overlap' or 'delayed', got {self.offload!r}")
        if self.grad_accum not in ("fp32", "compute"):
            raise ValueError(f"RunShape.grad_accum must be 'fp32' or 'compute', got {self.grad_accum!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per compute-dtype element: 2 (bf16) or 4 (fp32)."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient-accumulator element: 4 (``grad_accum="fp32"``) or ``dtype_bytes``."""
        return 4 if self.grad_accum == "fp32" else self.dtype_bytes

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.micro_batches
