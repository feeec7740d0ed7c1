"""What is planned: the run shape (:class:`RunShape`), the planner's user error (:class:`PlacementError`)
and the units: :func:`gb` is decimal (1e9 B), :func:`gib` binary (2**30 B, what the plan prints)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from npu_train.errors import UserError
from npu_train.hardware import GB, GIB
from npu_train.pipeline.schedule import ALL_SCHEDULES

__all__ = ["PlacementError", "RunShape", "copies_overlapped", "gb", "gib"]


def gb(x: float) -> float:
    """Bytes -> decimal gigabytes (1 GB = 1e9 B)."""
    return x / GB


def gib(x: float) -> float:
    """Bytes -> binary gibibytes (1 GiB = 2**30 B)."""
    return x / GIB


#: times below this many seconds print in milliseconds, in the plan (:func:`duration`) and the step line
#: (:func:`npu_train.metrics.report.step_time_unit`)
MS_BELOW_S = 0.1


def duration(seconds: float) -> str:
    """A predicted time as the plan prints it: ``"0.56 s"`` (two decimals) from :data:`MS_BELOW_S`, else milliseconds
    to three significant digits, ``"20.3 ms"``, ``"0.412 ms"`` (a tiny model's step read ``0.00 s``); 0 is ``"0 s"``."""
    if seconds >= MS_BELOW_S:
        return f"{seconds:.2f} s"
    if seconds <= 0:
        return "0 s"
    return f"{seconds * 1e3:.3g} ms"


class PlacementError(UserError, ValueError):
    """A placement that cannot work (over capacity, too little host RAM, an impossible layout); the
    message names the card, the predicted and available GiB and the fixes."""


@dataclass
class RunShape:
    """What one optimizer step processes. Raises ``ValueError`` for a count below 1 or an unknown schedule,
    dtype, ``grad_accum`` or ``offload``."""

    seq_len: int  # tokens per sequence S
    micro_batch: int = 1  # sequences per micro-batch b
    micro_batches: int = 1  # micro-batches per step M (gradient accumulation)
    schedule: str = "1f1b"  # one of npu_train.pipeline.schedule.ALL_SCHEDULES
    dtype: str = "bf16"  # compute dtype: "bf16" or "fp32"
    recompute: bool = False  # activation recomputation per decoder layer
    #: selective recompute: only every layer's attention core (npu_train.model.llama.Attention), whose kernel's
    #: saved tensors (an eager kernel's [b, a, S, S] probabilities) are dropped; its forward FLOPs run again in B
    recompute_attention: bool = False
    #: with ``recompute``: each card recomputes whole only the fewest of its layers that fit (its first ``k`` in
    #: execution order, chosen by the planner per card: ``StagePlan.recompute_layers``); the others keep their
    #: activations (their attention core recomputed under ``recompute_attention``)
    recompute_fewest: bool = False
    #: with ``recompute_fewest``: the count per card given (``train.recompute_layers=[k0, k1, ...]``) instead of
    #: the fewest that fit; () = the planner's
    recompute_counts: tuple = ()
    #: 0 = full fine-tuning; > 0 = LoRA with this many adapter parameters per layer (the base is frozen)
    lora_params_per_layer: int = 0
    #: LoRA adapter parameters one token passes through per layer (mixture of experts: its k experts'
    #: adapters of the E counted above, npu_train.planner.moe.lora_params_per_layer); 0 = all of them
    lora_active_params_per_layer: int = 0
    #: mixture of experts under LoRA: the rank of the adapters on every expert's three projections, which run
    #: inside the experts' kernel (npu_train.planner.moe.expert_kernel_bytes); 0 = none (full fine-tuning, the
    #: experts not all adapted, or adapter dropout: the experts then run as modules)
    lora_expert_rank: int = 0
    #: gradient accumulators: "fp32" (4 B/param) or "compute" (the .grad in the compute dtype, as on the
    #: predecessor system on RNGD, the field record's condition)
    grad_accum: str = "fp32"
    #: the offloaded layers' host AdamW + upload: "serial" (train.offload_overlap=false), "overlap", "delayed"
    offload: str = "overlap"
    #: several samples per row (data.pack / data.doc_mask): each micro-batch in flight keeps one
    #: [b, 1, S, S] additive attention mask in the compute dtype, shared by the stage's layers
    packed: bool = False
    #: the model file's dtype, which sizes the load's transients (npu_train.model.chunks.CHECKPOINT_DTYPES:
    #: safetensors "bf16" (the Hub's), "fp16", "fp32", or "gguf")
    checkpoint_dtype: str = "bf16"
    #: the mixture-of-experts load-balancing loss is on: it runs with 1f1b and gpipe only
    #: (npu_train.pipeline.moeaux.check_aux_schedule), so the plan advises no other schedule
    moe_aux_loss: bool = False
    #: vocabulary parallelism (``parallel.vocab``; Yeung et al. 2024): the output layer sharded by vocabulary over
    #: the pipeline's cards, each computing its logits slice in a joint ``V(m)`` per micro-batch
    #: (npu_train.pipeline.schedule.vocab_positions); the head card keeps the final norm. Untied heads only
    vocab_parallel: bool = False
    #: ``runtime.overlap_copies``: the stage-boundary copies in a copy thread (runtime/copies.py): True,
    #: False, or None (auto: on RNGD cards; offline the planner assumes furiosa-torch 2026.4's thread-local
    #: memory-type flag, which the card re-checks at setup); :func:`copies_overlapped` per card
    overlap_copies: Optional[bool] = False
    #: ``runtime.vocab_exchange``: the vocabulary exchange through gloo (TCP) or shm (pipeline/vocabshm.py, where
    #: every card of the job is on one host; ``CostModel.vocab_latency`` prices the path the runtime takes)
    vocab_exchange: str = "gloo"
    #: ``runtime.transport``: the stage boundaries within a host through shared memory (``shm``) or ZeroMQ TCP
    #: (``inline``); the vocabulary exchange takes shared memory only over ``shm`` boundaries (pipeline/hosts.py)
    transport: str = "shm"

    def __post_init__(self) -> None:
        for k in ("seq_len", "micro_batch", "micro_batches"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"RunShape.{k} must be >= 1, got {getattr(self, k)!r}")
        if self.schedule not in ALL_SCHEDULES:
            raise ValueError(f"RunShape.schedule must be one of {ALL_SCHEDULES}, got {self.schedule!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"RunShape.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.offload not in ("serial", "overlap", "delayed"):
            raise ValueError(f"RunShape.offload must be 'serial', 'overlap' or 'delayed', got {self.offload!r}")
        from npu_train.model.chunks import CHECKPOINT_DTYPES

        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"RunShape.checkpoint_dtype must be one of {CHECKPOINT_DTYPES}, got {self.checkpoint_dtype!r}")
        if self.transport not in ("shm", "inline"):
            raise ValueError(f"RunShape.transport must be 'shm' or 'inline', got {self.transport!r}")
        if self.grad_accum not in ("fp32", "compute"):
            raise ValueError(f"RunShape.grad_accum must be 'fp32' or 'compute', got {self.grad_accum!r}")

    def boundary_bytes(self, hidden_size: int) -> int:
        """Bytes of one stage-boundary tensor (an activation or its gradient): ``b * S * H`` in the compute dtype."""
        return self.dtype_bytes * self.tokens_per_micro_batch * int(hidden_size)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per compute-dtype element: 2 (bf16) or 4 (fp32)."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient-accumulator element: 4 (``fp32``) or :attr:`dtype_bytes`."""
        return 4 if self.grad_accum == "fp32" else self.dtype_bytes

    @property
    def active_adapter_params(self) -> int:
        """Adapter parameters per layer the compute counts: ``lora_active_params_per_layer`` or, when 0,
        ``lora_params_per_layer``."""
        return int(self.lora_active_params_per_layer or self.lora_params_per_layer)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.micro_batches


def copies_overlapped(shape: RunShape, kind: str) -> bool:
    """Whether a card of ``kind`` runs its stage-boundary copies in a copy thread under ``shape.overlap_copies``
    (``overlap_decision`` of runtime/copies.py without the setup probe: True on, None on ``furiosa`` only)."""
    s = shape.overlap_copies
    return s is True or (s is None and kind == "furiosa")
