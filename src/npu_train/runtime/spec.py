"""The typed, frozen input of a card process (:class:`WorkerSpec`), built only by
:func:`npu_train.runtime.job.build_worker_specs` and pickled into the spawned process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from npu_train.backends.furiosa_compile import FuriosaCompileOptions
from npu_train.hardware import Card


@dataclass(frozen=True)
class StageInfo:
    """The stage's decoder layers ``[first, last)``, embedding / head flags, printed ``label`` (``19-29 +head``);
    ``second``: a two-chunk schedule's second range ``(a, b)`` on this card (None: one chunk)."""

    first: int
    last: int
    has_embed: bool
    has_head: bool
    label: str
    second: Optional[tuple] = None
    #: layers recomputed whole under train.recompute, the card's first in execution order (the plan's
    #: ``StagePlan.recompute_layers``, train.recompute_layers=fewest); None: all of them
    recompute_layers: Optional[int] = None
    #: bytes of heap holes a cpu card keeping freed memory lets stand before it returns them
    #: (:class:`~npu_train.hostmem.HeapGuard`; the plan's ``StagePlan.heap_cap``); None: no guard
    heap_cap_bytes: Optional[int] = None
    #: RSS growth (bytes) past which the guard reads its live bytes again (``StagePlan.heap_slack``)
    heap_slack_bytes: int = 0
    #: RSS (bytes) below which the guard never trims: the plan's total less its heap term's slack and one layer's
    #: frees and less the experts' kernel's workspaces (``StagePlan.heap_limit``); None: trim at the cap alone
    heap_limit_bytes: Optional[int] = None


@dataclass(frozen=True)
class TrainSpec:
    """``train.*`` and ``data.eval_*`` after validation: ``steps``, ``warmup_steps``, ``save_every``,
    ``stop_after``, ``eval_every`` in optimizer steps; ``micro_batch`` in sequences; ``accum`` micro-batches
    per step; ``clip`` max grad norm (0: off); ``dtype`` bf16 | fp32; ``nonfinite`` stop | skip."""

    steps: int
    micro_batch: int
    accum: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip: float
    schedule: str
    recompute: bool
    seed: int
    save_every: int
    save_on_interrupt: bool
    stop_after: int
    dtype: str
    eval_every: int
    eval_batches: int
    nonfinite: str = "stop"
    #: ``train.recompute_attention`` resolved: every layer's attention core recomputed in the backward
    recompute_attention: bool = False
    #: ``checkpoint.save``: false = no checkpoint is ever written (not at ``save_every``, the end, an interrupt)
    save_checkpoints: bool = True
    #: ``fp32`` accumulators or ``compute`` (the compute dtype's ``.grad``), ``train.grad_accum``
    grad_accum: str = "fp32"
    #: host-optimizer overlap of offloaded layers (``train.offload_overlap``) and ``sync`` | ``delayed``
    #: update (``train.offload_update``), see :mod:`npu_train.optim.offload`
    offload_overlap: bool = True
    offload_update: str = "sync"
    #: ``full`` or ``lora`` (then the ``lora_*`` fields give rank, alpha, dropout and target modules)
    mode: str = "full"
    #: weight of the mixture-of-experts load-balancing loss, resolved (0: off; :mod:`npu_train.pipeline.moeaux`)
    moe_aux_loss: float = 0.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple = ()
    #: mixtures of experts: routers trained in full beside the adapters (``lora.train_router``)
    lora_train_router: bool = False
    #: ``train.objective``: sft (next-token cross-entropy) | dpo (then ``dpo_*`` = ``dpo.beta``, ``dpo.loss``,
    #: ``dpo.label_smoothing``; :mod:`npu_train.pipeline.objective`)
    objective: str = "sft"
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    #: ``parallel.vocab``: the output layer cut by vocabulary rows over the pipeline's cards
    #: (:mod:`npu_train.pipeline.vocab`; each card's rows: :func:`~npu_train.pipeline.vocab.vocab_rows`)
    vocab: bool = False

    def lora_spec(self):
        """The :class:`~npu_train.model.lora.LoraSpec` of a ``lora`` run (None for ``full``)."""
        if self.mode != "lora":
            return None
        from npu_train.model.lora import LoraSpec

        return LoraSpec(r=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                        targets=tuple(self.lora_targets), train_router=bool(self.lora_train_router))

    def to_dict(self) -> dict:
        """Plain dict (written into the checkpoint manifest's ``train`` entry)."""
        from dataclasses import asdict

        return asdict(self)


@dataclass(frozen=True)
class ReferenceSpec:
    """Where a DPO run's reference log-probabilities live and which rows the cards still compute:
    ``run_file`` (in the checkpoint root; None with ``checkpoint.save=false``), ``cache_file`` (beside the data
    cache; None without one), ``key`` (hex, data + model + compute dtype + card kinds), ``train_rows`` /
    ``val_rows``: the row indices the run uses whose value no file holds yet (empty: nothing to compute)."""

    run_file: Optional[str]
    cache_file: Optional[str]
    key: str
    train_rows: tuple = ()
    val_rows: tuple = ()

    @property
    def compute(self) -> bool:
        """Whether the card processes run a reference pass before training."""
        return bool(self.train_rows or self.val_rows)

    @property
    def n_compute(self) -> int:
        return len(self.train_rows) + len(self.val_rows)

    def existing(self) -> Optional[str]:
        """The file to read (the run's first), or None."""
        for f in (self.run_file, self.cache_file):
            if f and os.path.isfile(f):
                return f
        return None


#: gloo needs a finite timeout: 7 days (in seconds) stands for "never". Liveness is decided by the
#: coordinator from heartbeats (``runtime.heartbeat_timeout_s``), which kills every card process of
#: the job when one dies or hangs; a wait on a live peer (a 150 s first-step compilation, a long
#: checkpoint write) must not time out on its own. 7 days in nanoseconds (6e14) is far from int64
#: overflow in the C++ deadline arithmetic.
WAIT_FOREVER_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class RuntimeSpec:
    """Process settings: heartbeat interval (s), transport (shm | inline), torch ``threads`` (as planned), RNGD
    compile and accounting settings, warm-up, ``keep_host_memory``. ``recv_timeout_s`` None: boundary
    transfers wait as long as it takes; ``collective_timeout_s``: gloo's, default :data:`WAIT_FOREVER_S`
    (the coordinator's heartbeat timeout detects dead peers)."""

    heartbeat_interval_s: float
    transport: str
    threads: int
    recv_timeout_s: Optional[float] = None
    collective_timeout_s: float = WAIT_FOREVER_S
    furiosa: FuriosaCompileOptions = FuriosaCompileOptions()
    furiosa_accounting: str = "dispatch"
    warmup: bool = False
    keep_host_memory: bool = True
    #: ``runtime.trace``: record each step's per-action timeline (:mod:`npu_train.metrics.trace`)
    trace: bool = False
    #: ``runtime.overlap_copies``: the boundary copies in a copy thread (:mod:`npu_train.runtime.copies`)
    overlap_copies: Optional[bool] = None
    #: ``runtime.vocab_exchange``: gloo | shm (:mod:`npu_train.pipeline.vocabshm`, where the pipeline is on one host)
    vocab_exchange: str = "gloo"

    def backend_kwargs(self, kind: str) -> dict:
        """Keyword arguments of :func:`~npu_train.backends.make_backend` for ``kind`` (furiosa only)."""
        if kind == "furiosa":
            return {"accounting": self.furiosa_accounting, "compile_options": self.furiosa}
        return {}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one card process needs; frozen and picklable.

    ``rank``/``world_size``: ``replica * P + stage`` / ``dp * P``; ``token``: secret on every message, never
    written; ``parent_pid``: the launcher's; ``model_cfg``: ``LlamaConfig.to_dict()``; ``resident_names``:
    parameters whose master + moments stay on the card; ``data_file``: the packed data in ``ipc_dir``;
    ``start_step`` (0-based) and ``resume_dir`` (None: fresh); ``slot_bytes`` = micro_batch x seq_len x
    hidden x element size, ``slots`` per ring; ``boundary_transport``: per boundary shm | inline (empty: all
    ``runtime.transport``); ``zero``: 0 or 1; ``model_index``: a GGUF tensor table read by the launcher (None
    for safetensors)."""

    rank: int
    world_size: int
    job_id: str
    token: str
    parent_pid: int
    card: Card
    model_path: str
    model_cfg: dict
    stage: StageInfo
    resident_names: tuple
    data_file: str
    train: TrainSpec
    runtime: RuntimeSpec
    start_step: int
    resume_dir: Optional[str]
    ckpt_root: str
    coord_addr: str
    inbox: tuple
    ipc_dir: str
    slot_bytes: int
    slots: int
    dist_init: str
    boundary_transport: tuple = ()

    def boundary_mode(self, b: int) -> str:
        """Transport of boundary ``b`` (between stages ``b`` and ``b + 1``): ``shm`` or ``inline``."""
        return self.boundary_transport[b] if self.boundary_transport else self.runtime.transport
    dp: int = 1
    zero: int = 0
    model_index: Optional[dict] = None
    #: DPO: where the reference log-probabilities are read or written (None for SFT)
    reference: Optional[ReferenceSpec] = None

    @property
    def layout(self):
        """The job's :class:`~npu_train.runtime.layout.ParallelLayout` (``dp`` x ``world_size / dp``)."""
        from npu_train.runtime.layout import ParallelLayout

        return ParallelLayout(self.dp, self.world_size // self.dp)

    @property
    def stage_index(self) -> int:
        """This process's stage in its pipeline (``rank % P``)."""
        return self.rank % (self.world_size // self.dp)

    @property
    def replica(self) -> int:
        """This process's replica (``rank // P``)."""
        return self.rank // (self.world_size // self.dp)

    @property
    def num_stages(self) -> int:
        """Stages per pipeline P."""
        return self.world_size // self.dp

    def __repr__(self) -> str:  # never show the token
        return f"WorkerSpec(rank={self.rank}/{self.world_size}, card={self.card.name}, job={self.job_id})"


def eval_micro_batches(n_val: int, micro_batch: int, eval_batches: int, pairs: bool) -> list[int]:
    """The held-out rows of each evaluated micro-batch: the first ``eval_batches`` whole micro-batches of the
    validation split's ``n_val`` rows (``micro_batch`` each). A split with fewer rows than one micro-batch
    (SFT) still gets one micro-batch: its rows, padded to the micro-batch's shape with rows that have no
    target (so the card runs the shapes it compiled and the loss is over the real rows only). DPO pairs are
    not padded (a padded pair would count in the loss's mean over pairs): none then. ``[]``: no evaluation."""
    if eval_batches <= 0 or n_val <= 0:
        return []
    full = min(eval_batches, n_val // micro_batch)
    if full == 0 and not pairs:
        return [n_val]
    return [micro_batch] * full


def eval_note(n_val: int, micro_batch: int, eval_batches: int, pairs: bool) -> str:
    """One line when the validation split is smaller than a micro-batch, so the held-out evaluation is padded
    (SFT) or (DPO) skipped, naming how to get more (``""`` otherwise, and when ``data.eval_batches=0``)."""
    if eval_batches <= 0 or n_val <= 0 or n_val >= micro_batch:
        return ""
    fix = "raise data.val_fraction (or give data.val_split more rows) or lower train.micro_batch"
    if pairs:
        return (f"note: no held-out evaluation: {n_val // 2} held-out pair(s), fewer than a micro-batch "
                f"({micro_batch // 2} pairs); for one: {fix}")
    return (f"note: evaluation runs on {n_val} held-out row(s), fewer than a micro-batch ({micro_batch}), padded "
            f"with untrained rows; for more: {fix}")
