"""The typed, frozen input of a card process: :class:`WorkerSpec`.

Built in exactly one place (:func:`npu_train.runtime.job.build_worker_specs`) from the job's
configuration and placement plan, pickled by ``multiprocessing`` (spawn) into the card process and
read by :class:`npu_train.runtime.trainer.StageTrainer`. A misspelt field is an ``AttributeError``
at the line that reads it (and a type checker's error), not a silent ``KeyError`` in another process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from npu_train.backends.furiosa_compile import FuriosaCompileOptions
from npu_train.hardware import Card


@dataclass(frozen=True)
class StageInfo:
    """The stage's decoder layers ``[first, last)`` and whether it holds the embedding / final norm + LM head.

    ``label`` is the human-readable layer range printed in messages (e.g. ``19-29 +head``).
    """

    first: int
    last: int
    has_embed: bool
    has_head: bool
    label: str


@dataclass(frozen=True)
class TrainSpec:
    """Optimisation settings of the run (``train.*`` and ``data.eval_*`` after validation).

    Units: ``lr`` per step, ``steps``/``warmup_steps``/``save_every``/``stop_after``/``eval_every`` in
    optimizer steps, ``micro_batch`` in sequences, ``accum`` = micro-batches M per optimizer step,
    ``clip`` = max global grad norm (0: off), ``dtype`` the resolved compute dtype (``bf16`` | ``fp32``),
    ``nonfinite`` what a non-finite loss or global grad norm does (``stop`` | ``skip``, see
    :class:`npu_train.config.TrainConf`).
    """

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
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple = ()

    def lora_spec(self):
        """The :class:`~npu_train.model.lora.LoraSpec` of a ``lora`` run (None for ``full``)."""
        if self.mode != "lora":
            return None
        from npu_train.model.lora import LoraSpec

        return LoraSpec(r=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                        targets=tuple(self.lora_targets))

    def to_dict(self) -> dict:
        """Plain dict (written into the checkpoint manifest's ``train`` entry)."""
        from dataclasses import asdict

        return asdict(self)


#: gloo needs a finite timeout: 7 days (in seconds) stands for "never". Liveness is decided by the
#: coordinator from heartbeats (``runtime.heartbeat_timeout_s``), which kills every card process of
#: the job when one dies or hangs; a wait on a live peer (a 150 s first-step compilation, a long
#: checkpoint write) must not time out on its own. 7 days in nanoseconds (6e14) is far from int64
#: overflow in the C++ deadline arithmetic.
WAIT_FOREVER_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class RuntimeSpec:
    """Process-level settings: heartbeat interval (s), boundary transport (``shm`` | ``inline``),
    torch intra-op ``threads`` of this card process (the same figure the planner used for its step
    time, see :func:`npu_train.planner.threads_per_card`), the receive / collective timeouts (s),
    the RNGD compile settings (``runtime.furiosa.*``, with ``loaded_modules`` as planned),
    the RNGD memory accounting, whether the card process warms up (compiles) before step 1 and
    whether its ``malloc`` keeps freed host memory (``keep_host_memory``, :mod:`npu_train.hostmem`).

    ``recv_timeout_s`` None: stage-boundary receives and sends wait as long as it takes;
    ``collective_timeout_s``: the gloo timeout (rendezvous, all-reduce, barrier), by default
    :data:`WAIT_FOREVER_S`. A dead or hung peer is detected by the coordinator's heartbeat
    timeout instead, which tears the whole job down (see :mod:`npu_train.runtime.coordinator`).
    """

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

    def backend_kwargs(self, kind: str) -> dict:
        """Keyword arguments of :func:`~npu_train.backends.make_backend` for a card of ``kind``
        (furiosa: ``accounting`` and ``compile_options``; others: none)."""
        if kind == "furiosa":
            return {"accounting": self.furiosa_accounting, "compile_options": self.furiosa}
        return {}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one card process needs; frozen and picklable.

    Attributes:
        rank, world_size: this card process's global rank ``replica * P + stage`` and the number of
            card processes ``dp * P`` (:class:`~npu_train.runtime.layout.ParallelLayout`).
        job_id, token: the job's random id (names shm segments and staging dirs) and the secret every
            control and boundary message carries (never printed or written to disk).
        parent_pid: the launcher's pid (a card process whose parent changes cleans up and exits).
        card, stage: the card and the layers it runs.
        model_path: HF directory or GGUF file; ``model_cfg``: ``LlamaConfig.to_dict()``.
        resident_names: HF names of the parameters whose fp32 master + AdamW moments stay on the card.
        data_file: the packed token data (safetensors) written by the launcher into ``ipc_dir``
            (removed with it: not needed to resume).
        train, runtime: see :class:`TrainSpec`, :class:`RuntimeSpec`.
        start_step, resume_dir: 0-based step to start at and the checkpoint to restore (None: fresh).
        ckpt_root: the checkpoint root (shards go to a staging dir under it).
        coord_addr: the coordinator's ZeroMQ address; ``inbox``: every stage's boundary mailbox address.
        ipc_dir: the private 0700 directory of the job's ipc sockets ('' with the inline transport).
        slot_bytes, slots: bytes per shared-memory slot (``micro_batch x seq_len x hidden x element``)
            and slots per ring.
        dist_init: the gloo rendezvous URL (``tcp://host:port``).
        boundary_transport: per stage boundary ``b`` (stages ``b | b+1``) its transport, ``shm`` (both
            stages on one node) or ``inline`` (ZeroMQ TCP frames: across nodes); empty = every boundary
            uses ``runtime.transport``.
        dp, zero: data-parallel replicas of the pipeline (``parallel.dp``) and the ZeRO stage
            (``parallel.zero``: 0, or 1 = optimizer state sharded across the stage's replicas).
        model_index: a GGUF model's tensor table (:func:`npu_train.model.gguf.gguf_tensor_index`: file
            key, per tensor GGML type, shape, byte offset, size; a few hundred entries) read by the
            launcher, so this process reads its tensors without parsing the file's metadata; None for
            safetensors (or when built elsewhere: the file is then parsed as before).
    """

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
