"""Placement model: which decoder layers go to which card, which of them keep their optimizer
state on the card ("resident") and which on the host ("offloaded"), and what that costs in card
memory, host memory and step time.

Pure arithmetic: no tensors are created and no device is touched (only :func:`default_capacity`
for ``kind="cuda"`` asks torch for the card size). Planning Llama-3.1-70B on 8 cards takes
milliseconds, so ``--dry-run`` style tools can call :func:`make_plan` freely.

Units are explicit everywhere: ``*_bytes`` are bytes, ``gb()`` converts to decimal gigabytes
(1e9 B), ``gib()`` to binary gibibytes (2**30 B); the plan table prints GiB. Card capacities are
GiB figures (RNGD: 48 GB HBM of which 47.5 GiB is usable = 51.0 GB).

Memory model, per card (= pipeline stage), ``e`` = bytes of the compute dtype (2 for bf16, 4 for
fp32). It follows what the trainer's code allocates (``runtime/worker.py``, ``optim/adamw.py``,
``model/llama.py``); every term is a separate key of ``StagePlan.mem``:

- ``baseline``: ``Rates.process_baseline_bytes``. For ``cpu`` cards the "device memory" is the
  card process's resident set size (RSS), so everything the process holds before it allocates
  model state counts: interpreter, torch and other libraries, gloo/ZeroMQ, the model-file reader
  (a GGUF reader stays cached with its parsed metadata and mapped file pages). ``calibrate``
  measures it in a fresh subprocess; the default is 0.35 GiB. For ``cuda``/``furiosa`` it is 0:
  their memory figures exclude the host process.
- ``weights``: ``e`` B/param for every parameter the stage computes with: its decoder layers,
  the input embedding on the first stage, the final norm and ``lm_head`` on the last stage. With
  tied embeddings and more than one stage the last stage holds a *copy* of the embedding matrix as
  its ``lm_head`` (the first stage owns it).
- ``grads``: gradient accumulators in the compute dtype, same size as ``weights`` (gradients are
  accumulated on the card over the M micro-batches, then handed to the optimizer once per step).
- ``optimizer``: fp32 master + AdamW m + v = 12 B/param for the parameters whose optimizer state
  lives on the card. The master is always a separate fp32 copy (``StageOptimizer`` clones the
  loaded weights), also with fp32 compute. The tied ``lm_head`` copy has its own master and
  moments (the last stage's optimizer updates it with the all-reduced tied gradient), resident
  or offloaded like the stage's other non-layer parameters. On the card: the *resident*
  parameters; on a ``cpu`` card *all* of them, since the host RAM that holds "offloaded" state is
  the same RAM the card process's RSS counts.
- ``activations``: tensors autograd saves for the micro-batches in flight (see
  :func:`activation_bytes_per_layer` and :func:`in_flight_micro_batches`), plus on the last stage
  the fp32 log-probabilities that ``cross_entropy`` saves, ``b*s*V*4`` bytes per micro-batch in
  flight (:func:`saved_logits_bytes`). ``ATTENTION[kind]`` selects the attention term: ``"sdpa"``
  (cpu, cuda: ``scaled_dot_product_attention``'s fused kernels save only the log-sum-exp) or
  ``"eager"`` (furiosa, conservative: the attention probabilities are saved).
- ``transient``: what the peak phase of a step adds on top, ``max(fwd/bwd, optimizer) + held``:

  * fwd/bwd phase, last stage: ``max(2*b*s*V*4, acc)``: the log-softmax backward holds its
    incoming and outgoing gradient (two fp32 logits-sized tensors), the ``lm_head`` backward
    the weight-gradient temporary ``acc``. Other stages: ``max(0, acc - A)``, where ``acc = e *``
    (largest parameter of the stage) is the temporary of gradient accumulation (from the second
    micro-batch on, autograd computes a fresh gradient and adds it to ``.grad``); for the first
    stage that is the embedding, whose gradient appears at the end of a micro-batch's backward,
    when that micro-batch's activations ``A`` are already freed.
  * optimizer phase (activations freed, gradients alive): the larger of the gradient-norm
    temporary (``4 B`` or, for bf16, ``8 B`` x largest parameter) and the fp32 master-gradient
    copies: 4 B/param for offloaded parameters (a copy of the downloaded gradient; counted on
    ``cpu`` cards only, elsewhere it is host RAM) and, with bf16 compute, 4 B/param for resident
    parameters (``grad.float()``), plus one upload temporary.
  * held: with tied embeddings on more than one stage, the first and last stage keep the
    previous step's tied gradient and its fp32 host copy referenced until the next step's
    exchange (loop variables in the worker): ``(e + 4) * V*H`` bytes on a ``cpu`` card, the
    ``e * V*H`` device part elsewhere.
- ``workspace``: ``WORKSPACE[kind] = (constant_bytes, fraction)``: the constant covers runtime /
  compiler / library buffers (CUDA context + cuBLAS workspace, RNGD runtime buffers), the fraction
  of the five terms above allocator slack and temporaries not modelled. For ``cpu`` the constant
  is 0 (the process baseline replaces it) and the fraction is glibc's allocator slack: freed heap
  blocks stay resident and autograd's churn of activation-sized blocks fragments the heap;
  measured with ``mallinfo2`` on SmolLM2-135M stages (fp32, 1-2 threads): free-but-resident heap
  at the RSS peak = 6-17 % of the live bytes, 12 % used. The other kinds' figures are assumed.

Non-layer parameters (embedding, final norm, ``lm_head`` and its tied copy) follow the
``nonlayer_resident`` flag of :func:`make_plan`; the default (``None``) makes them resident exactly
when *all* the card's decoder layers are resident, i.e. offloading starts with them (they are the
largest single tensors and a card that offloads anything already pays the host-optimizer path).

Within a card the resident layers are the *first* ones of the card's range and the offloaded ones
the last: backward runs last-to-first, so the offloaded layers' gradients are complete earliest,
which lets a trainer start their host optimizer soonest.

Host memory: ``host_bytes`` = 12 B/param (fp32 master + m + v) for the stage's offloaded params
(0 for ``cpu`` cards, whose offloaded state is already in the card's ``optimizer`` term).

Time model (per optimizer step of ``M`` micro-batches on ``P`` stages):

- ``t_i`` = compute time of stage i per micro-batch = FLOPs / ``Rates.device_flops``, FLOPs =
  ``6 * tokens * (params of the stage's layers + lm_head)`` + attention scores
  ``12 * s * (heads*head_dim) * tokens`` per layer, times 8/6 with recompute (one extra forward).
  The embedding lookup and norms count no FLOPs. ``device_flops`` is the *sustained training*
  rate (``calibrate`` measures it on a decoder layer's forward + backward, so element-wise work
  and framework overhead are in it); ``Rates.flops_by_dtype`` may give it per compute dtype. The
  ``lm_head`` + loss runs at ``device_flops * Rates.head_flops_ratio`` (measured: its GEMMs have
  one small dimension and the log-softmax spans the vocabulary).
- Pipeline phase (1F1B and GPipe alike): ``(M + P - 1) * max_i t_i``; the slowest stage sets the
  pace, so every stage is busy ``compute = M * t_i`` and idle ``bubble = phase - M*t_i``
  (for balanced stages that is the classical bubble fraction ``(P-1)/(M+P-1)`` of the step).
- ``host_optimizer`` = offloaded params / ``Rates.host_adamw_params_per_s`` (each stage's process
  runs its own host AdamW, concurrently with the other stages').
- ``device_optimizer`` = resident params / ``Rates.device_adamw_params_per_s`` (the card's AdamW
  over its resident masters; on a ``cpu`` card that is the same fused CPU AdamW as the host's).
- ``transfer`` = offloaded params * ``e`` / ``h2d_bytes_per_s`` (updated weights back to the card)
  + offloaded params * ``e`` / ``d2h_bytes_per_s`` (accumulated gradients to the host), plus, with
  tied embeddings on more than one stage, the tied gradient's download and upload on the first and
  last stage. Stage-boundary activations (``s*b*h*e`` bytes per micro-batch and boundary, ~4 MB
  for 8B at S=512), the gloo all-reduce of the tied gradient and the gradient-norm pass are
  ignored.
- Conservatively, the optimizer and the transfers are *not* overlapped with the pipeline:
  stage total = pipeline phase + host_optimizer + device_optimizer + transfer; step time = max
  over stages.
- ``cpu`` cards share the host's cores: each card process runs ``threads`` torch threads
  (the launcher's default ``max(1, cores // number of cpu cards)``, or ``make_plan(cpu_threads=)``);
  rates measured at that thread count are used when the profile has them
  (``Rates.by_threads``). When the cards together run more threads than there are cores (3 cpu
  cards on 2 cores), the pipeline phase counts its ``M + P - 1`` slots by occupancy: in slot j
  only the stages holding a micro-batch compute, and a slot whose computing cpu stages run
  ``a * threads > cores`` threads takes ``a * threads / cores`` times longer (so the
  ``(M+P-1)`` factor becomes the sum of the slots' stretch factors); the optimizers, which all
  run at the same time, get ``cores / (cards * threads)`` of their rate. ``compute`` then includes
  the phase's average slowdown (``M * t_i * slots / (M + P - 1)``).
"""
from __future__ import annotations

import io
import json
import math
import numbers
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from npu_train.model.config import LlamaConfig

__all__ = [
    "PlacementError", "CardSpec", "Rates", "RunShape", "StagePlan", "Plan",
    "DEFAULT_RATES", "WORKSPACE", "ATTENTION", "KINDS",
    "gb", "gib", "default_capacity", "make_cards", "calibration_path", "load_rates",
    "activation_bytes_per_layer", "logits_bytes", "saved_logits_bytes", "in_flight_micro_batches",
    "balanced_split", "make_plan", "format_plan",
]

KINDS = ("cpu", "cuda", "furiosa")
GIB = 2 ** 30

#: RNGD usable HBM per card: 47.5 GiB (= 51.0 GB) of the 48 GB.
FURIOSA_CAPACITY_BYTES = int(47.5 * GIB)


def gb(x: float) -> float:
    """Bytes -> decimal gigabytes (1 GB = 1e9 B)."""
    return x / 1e9


def gib(x: float) -> float:
    """Bytes -> binary gibibytes (1 GiB = 2**30 B)."""
    return x / GIB


class PlacementError(ValueError):
    """A placement that cannot work: over a card's capacity, too little host RAM, or an
    impossible layout (more cards than layers, more resident layers than a card holds)."""


# ------------------------------------------------------------------------------------------------
# cards and rates
# ------------------------------------------------------------------------------------------------
@dataclass
class CardSpec:
    """One accelerator card = one pipeline stage.

    Attributes:
        kind: ``"cpu"``, ``"cuda"`` or ``"furiosa"``.
        index: device index (``None`` for cpu).
        capacity_bytes: usable memory of the card, bytes.
        name: display name, default ``"<kind>:<index>"`` (``"cpu"`` when index is None).
    """

    kind: str
    index: Optional[int]
    capacity_bytes: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"card kind must be one of {KINDS}, got {self.kind!r}")
        if not self.name:
            self.name = self.kind if self.index is None else f"{self.kind}:{self.index}"


def default_capacity(kind: str, index: Optional[int] = None) -> int:
    """Usable memory of one card of ``kind``, bytes.

    - ``furiosa``: 47.5 GiB (RNGD: 48 GB HBM, 47.5 GiB usable). No device call.
    - ``cuda``: ``torch.cuda.get_device_properties(index or 0).total_memory`` when CUDA is
      available, else 80 GiB (H100-class).
    - ``cpu``: total host RAM (``psutil``); dividing it among several CPU "cards" is the
      caller's job.
    """
    if kind == "furiosa":
        return FURIOSA_CAPACITY_BYTES
    if kind == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.get_device_properties(index or 0).total_memory)
        except Exception:  # pragma: no cover - torch without CUDA support
            pass
        return 80 * GIB
    if kind == "cpu":
        import psutil

        return int(psutil.virtual_memory().total)
    raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")


def make_cards(kind: str, n: int, capacity_bytes: Optional[int] = None) -> list[CardSpec]:
    """``n`` cards of ``kind`` with indices ``0..n-1``. Default capacity: :func:`default_capacity`
    (for ``cpu``: host RAM divided by ``n``)."""
    if n < 1:
        raise ValueError(f"need at least one card, got {n}")
    if capacity_bytes is None:
        capacity_bytes = default_capacity(kind)
        if kind == "cpu":
            capacity_bytes //= n
    return [CardSpec(kind, i, int(capacity_bytes)) for i in range(n)]


@dataclass
class Rates:
    """Throughput figures of one card kind (and its host), used for step-time prediction, plus the
    card process's memory baseline.

    Attributes:
        device_flops: sustained training FLOP/s of one card (forward + backward of decoder layers
            in the compute dtype; nominal * assumed utilization when not calibrated).
        h2d_bytes_per_s: host -> card copy bandwidth, B/s.
        d2h_bytes_per_s: card -> host copy bandwidth, B/s.
        host_adamw_params_per_s: fp32 AdamW updates per second on the host, one process.
        device_adamw_params_per_s: fp32 AdamW updates per second of the card's own optimizer over
            its resident masters; 0 means "same as ``host_adamw_params_per_s``" (a cpu card's
            optimizer *is* the host's fused CPU AdamW).
        head_flops_ratio: sustained FLOP/s of the ``lm_head`` + loss forward/backward relative
            to ``device_flops`` (its GEMMs have one small dimension and stream the ``V x H``
            matrix, and the log-softmax runs over the vocabulary); 1.0 = same rate.
        process_baseline_bytes: card memory a card process holds before any model state. cpu:
            the process RSS after start-up (interpreter, torch, npu_train, gloo, ZeroMQ, the
            model-file reader); cuda/furiosa: 0 (their memory figures exclude the host process).
        threads: cpu only: torch intra-op threads the figures above were measured with
            (0 = unknown; then no thread scaling is applied).
        flops_by_dtype: optional ``{"fp32": ..., "bf16": ...}`` sustained FLOP/s per compute dtype;
            ``device_flops`` is used for a dtype that is not listed.
        by_threads: cpu only: optional ``{threads: {field: value}}`` figures measured at other
            thread counts (see :meth:`resolve`).
    """

    device_flops: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    host_adamw_params_per_s: float
    device_adamw_params_per_s: float = 0.0
    head_flops_ratio: float = 1.0
    process_baseline_bytes: float = 0.0
    threads: int = 0
    flops_by_dtype: dict = field(default_factory=dict)
    by_threads: dict = field(default_factory=dict)

    @property
    def device_adamw(self) -> float:
        """``device_adamw_params_per_s``, or the host figure when that is 0."""
        return self.device_adamw_params_per_s or self.host_adamw_params_per_s

    def flops(self, dtype: str) -> float:
        """Sustained FLOP/s for compute dtype ``dtype`` (``flops_by_dtype`` or ``device_flops``)."""
        return float(self.flops_by_dtype.get(dtype, self.device_flops))

    def resolve(self, dtype: Optional[str] = None, threads: Optional[int] = None) -> "Rates":
        """Flat rates for one card: ``device_flops`` for ``dtype``, and for ``threads`` the
        ``by_threads`` entry measured at that thread count; without one, when ``self.threads`` is
        known, the compute-bound figures (FLOP/s, AdamW rates) are scaled by
        ``threads / self.threads`` (assumed linear) and the bandwidths kept."""
        base = {k: getattr(self, k) for k in _RATE_NUMBERS}
        by_dtype = dict(self.flops_by_dtype)
        t = int(threads) if threads else 0
        if t and t != self.threads:
            entry = self.by_threads.get(t, self.by_threads.get(str(t)))
            if isinstance(entry, dict):
                for k in _RATE_NUMBERS:
                    if k in entry:
                        base[k] = float(entry[k])
                if isinstance(entry.get("flops_by_dtype"), dict):
                    by_dtype = dict(entry["flops_by_dtype"])
                elif "device_flops" in entry:
                    by_dtype = {}  # the top level's per-dtype figures belong to another count
            elif self.threads:
                f = t / self.threads
                for k in ("device_flops", "host_adamw_params_per_s", "device_adamw_params_per_s"):
                    # head_flops_ratio is a ratio of two rates: kept
                    base[k] *= f
                by_dtype = {d: v * f for d, v in by_dtype.items()}
        if dtype is not None and dtype in by_dtype:
            base["device_flops"] = float(by_dtype[dtype])
        return Rates(**base, threads=t or self.threads)


#: The plain numeric fields of :class:`Rates` (what a profile may set and ``by_threads`` override).
_RATE_NUMBERS = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
                 "device_adamw_params_per_s", "head_flops_ratio", "process_baseline_bytes")
#: Fields that may be 0 (0 has a meaning: "same as host" / "no baseline").
_RATE_MAY_BE_ZERO = ("device_adamw_params_per_s", "process_baseline_bytes")


#: Uncalibrated defaults (``calibrate`` writes measured ones, see :func:`load_rates`).
#:
#: - furiosa: RNGD spec sheet 512 TFLOPS FP8 / 256 TFLOPS BF16; 0.4 assumed utilization.
#:   h2d 6e9 B/s as measured on an earlier RNGD deployment (one 117 MB tensor); d2h assumed equal.
#:   Device AdamW (unfused, one tensor at a time) 1e10 params/s assumed.
#: - cuda: H100/H200-class 989 TFLOPS dense BF16 * 0.4 assumed; 25e9 B/s PCIe Gen5 pinned copies;
#:   fused device AdamW 5e10 params/s (HBM-bound, ~28 B moved per param).
#: - cpu: 50 GFLOP/s per process; copies are memcpy (~10e9 B/s); process baseline 0.35 GiB
#:   (python + torch + npu_train + gloo/ZeroMQ measured at ~0.25 GiB RSS, plus a model-file
#:   reader); the card's optimizer is the host AdamW.
#: - host AdamW 2e8 params/s per process for every kind (assumed, fp32, multi-threaded torch).
DEFAULT_RATES: dict[str, Rates] = {
    "furiosa": Rates(device_flops=256e12 * 0.4, h2d_bytes_per_s=6e9, d2h_bytes_per_s=6e9,
                     host_adamw_params_per_s=2e8, device_adamw_params_per_s=1e10),
    "cuda": Rates(device_flops=989e12 * 0.4, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9,
                  host_adamw_params_per_s=2e8, device_adamw_params_per_s=5e10),
    "cpu": Rates(device_flops=50e9, h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9,
                 host_adamw_params_per_s=2e8, process_baseline_bytes=0.35 * GIB),
}

#: Per-kind workspace: (constant bytes, fraction of weights+grads+optimizer+activations+transient).
#: cpu: no constant (``Rates.process_baseline_bytes`` covers the process), 12 % glibc allocator
#: slack (measured, see the module docstring); cuda/furiosa: assumed.
WORKSPACE: dict[str, tuple[int, float]] = {
    "furiosa": (1 * GIB, 0.05),
    "cuda": (1 * GIB, 0.05),
    "cpu": (0, 0.12),
}

#: Attention implementation assumed for the activation memory of each kind (see
#: :func:`activation_bytes_per_layer`): the model calls ``scaled_dot_product_attention``, whose CPU
#: and CUDA kernels are fused (flash / memory-efficient: only the log-sum-exp is saved); for
#: furiosa the compiled kernel is not known, so the eager (probabilities saved) figure is kept.
ATTENTION: dict[str, str] = {"cpu": "sdpa", "cuda": "sdpa", "furiosa": "eager"}


def calibration_path(kind: str) -> Path:
    """Default calibration profile of ``kind``: ``~/.cache/npu-train/calibration/<kind>.json``."""
    return Path.home() / ".cache" / "npu-train" / "calibration" / f"{kind}.json"


def _profile_number(path: Path, key: str, value, may_be_zero: bool) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"calibration profile {path}: {key}={value!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not may_be_zero):
        raise ValueError(f"calibration profile {path}: {key}={value!r} must be "
                         + (">= 0" if may_be_zero else "> 0"))
    return v


def load_rates(kind: str, profile_path: Union[str, os.PathLike, None] = None) -> Rates:
    """Rates for ``kind``: :data:`DEFAULT_RATES` overridden by a calibration profile when present.

    The profile is a JSON object whose keys (top level, or under ``"rates"``) are :class:`Rates`
    field names with numbers as values (``flops_by_dtype``: an object of numbers; ``by_threads``:
    an object ``{"<threads>": {field: number}}``); other keys are ignored, missing ones keep the
    default. A missing file gives the defaults; an unreadable or malformed one raises
    ``ValueError``. :func:`npu_train.optim.calibrate.save_profile` writes this format.
    """
    if kind not in DEFAULT_RATES:
        raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")
    d = DEFAULT_RATES[kind]
    values = {k: getattr(d, k) for k in _RATE_NUMBERS}
    threads, by_dtype, by_threads = d.threads, dict(d.flops_by_dtype), dict(d.by_threads)
    path = Path(profile_path) if profile_path is not None else calibration_path(kind)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"calibration profile {path} is unreadable: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("rates"), dict):
            data = data["rates"]
        if not isinstance(data, dict):
            raise ValueError(f"calibration profile {path} is not a JSON object")
        for k in values:
            if k in data:
                values[k] = _profile_number(path, k, data[k], k in _RATE_MAY_BE_ZERO)
        if "threads" in data:
            threads = int(_profile_number(path, "threads", data["threads"], True))
        if isinstance(data.get("flops_by_dtype"), dict):
            by_dtype = {str(dt): _profile_number(path, f"flops_by_dtype.{dt}", v, False)
                        for dt, v in data["flops_by_dtype"].items()}
        if isinstance(data.get("by_threads"), dict):
            by_threads = {}
            for t, entry in data["by_threads"].items():
                if not isinstance(entry, dict):
                    raise ValueError(f"calibration profile {path}: by_threads.{t} is not an object")
                e = {k: _profile_number(path, f"by_threads.{t}.{k}", entry[k], k in _RATE_MAY_BE_ZERO)
                     for k in _RATE_NUMBERS if k in entry}
                if isinstance(entry.get("flops_by_dtype"), dict):
                    e["flops_by_dtype"] = {
                        str(dt): _profile_number(path, f"by_threads.{t}.flops_by_dtype.{dt}", v, False)
                        for dt, v in entry["flops_by_dtype"].items()}
                by_threads[int(t)] = e
    return Rates(**values, threads=threads, flops_by_dtype=by_dtype, by_threads=by_threads)


# ------------------------------------------------------------------------------------------------
# run shape and activation arithmetic
# ------------------------------------------------------------------------------------------------
@dataclass
class RunShape:
    """What one optimizer step processes.

    Attributes:
        seq_len: tokens per sequence S.
        micro_batch: sequences per micro-batch b.
        micro_batches: micro-batches per step M (= gradient-accumulation steps).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        dtype: compute dtype, ``"bf16"`` or ``"fp32"``.
        recompute: activation recomputation (checkpoint each decoder layer's input).
    """

    seq_len: int
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    dtype: str = "bf16"
    recompute: bool = False

    def __post_init__(self) -> None:
        for k in ("seq_len", "micro_batch", "micro_batches"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"RunShape.{k} must be >= 1, got {getattr(self, k)!r}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"RunShape.schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"RunShape.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.micro_batches


def in_flight_micro_batches(stage: int, num_stages: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at peak:
    1F1B ``min(M, P - stage)``; GPipe ``M`` (all forwards before any backward)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, num_stages - stage)
    raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")


def activation_bytes_per_layer(model: LlamaConfig, shape: RunShape, attention: str = "eager") -> int:
    """Saved activations of one decoder layer for one micro-batch *without* recompute, bytes.

    ``attention="eager"`` (default; the figure used for furiosa): adapted from Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models"), whose
    ``s*b*h*(34 + 5*a*s/h)`` is for 16-bit GPT layers with dropout and a 4h GeLU MLP. For a Llama
    layer (no dropout, RMSNorm, grouped-query attention, SwiGLU) with ``e`` bytes per
    compute-dtype element, q = heads*head_dim, kv = kv_heads*head_dim, i = intermediate size:

    - two RMSNorms, input + output each: ``4*s*b*h*e``
    - rotated Q and the attention output (input of o_proj): ``2*s*b*q*e``
    - K and V at kv width (GQA-aware attention; an eager ``repeat_kv`` would save them at q width):
      ``2*s*b*kv*e``
    - attention probabilities, fp32 softmax output plus its compute-dtype copy for P@V
      (eager attention; a flash kernel would save only O(s) statistics): ``a*b*s*s*(4 + e)``
      (``4*a*b*s*s`` for fp32 compute, where the copy is the same tensor)
    - SwiGLU: gate output, up output, silu(gate), product (input of down_proj): ``4*s*b*i*e``

    For Llama-3.1-8B in bf16 that is ``s*b*h*(41 + 6*a*s/h)`` (Korthikanti: 34 + 5*a*s/h),
    136.3 MB at S=512, b=1.

    ``attention="sdpa"`` (cpu, cuda): exactly what autograd saves for
    :class:`npu_train.model.llama.DecoderLayer` when ``scaled_dot_product_attention`` runs a fused
    kernel (checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks``, fp32 and
    bf16, excluding parameters and the shared RoPE tables), per token:

    - each RMSNorm: its fp32 input (the upcast; the input itself for fp32), the normalized value
      cast to the compute dtype and the output (input of the next projections): ``(4 + 2e)*h``,
      plus the fp32 ``rsqrt`` statistic, 4 B
    - attention: rotated Q, K and V as fed to the kernel (the model's ``repeat_kv`` expands K and
      V to q width) and the output (input of o_proj): ``4*e*q``, plus the fp32 log-sum-exp per
      head, ``4*a``
    - SwiGLU as above: ``4*e*i``

    i.e. ``s*b*(2*(4 + 2e)*h + 8 + 4*e*q + 4*a + 4*e*i)``: 12.20 MB for SmolLM2-135M at fp32,
    S=128, b=2 (the eager figure is 11.40 MB there: no s*s term, but wider norms and K/V).
    """
    s, b, e = shape.seq_len, shape.micro_batch, shape.dtype_bytes
    h, i = model.hidden_size, model.intermediate_size
    a = model.num_heads
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    if attention == "sdpa":
        return s * b * (2 * (4 + 2 * e) * h + 8 + 4 * e * q + 4 * a + 4 * e * i)
    if attention != "eager":
        raise ValueError(f"attention must be 'eager' or 'sdpa', got {attention!r}")
    linear = e * s * b * (4 * h + 2 * q + 2 * kv + 4 * i)
    scores = a * b * s * s * (4 + (e if e != 4 else 0))
    return linear + scores


def logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch: fp32 logits and their gradient, ``b*s*V*4*2`` bytes (the
    log-softmax backward's two logits-sized fp32 tensors, see the ``transient`` term)."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4 * 2


def saved_logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch in flight: the fp32 log-probabilities ``cross_entropy`` saves
    for its backward, ``b*s*V*4`` bytes (also with bf16 compute: the logits are cast to fp32)."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4


def balanced_split(num_layers: int, num_cards: int) -> list[int]:
    """``num_layers`` spread over ``num_cards`` as evenly as possible; the remainder goes to the
    first cards (the last card also carries the lm_head)."""
    if num_cards < 1:
        raise ValueError(f"need at least one card, got {num_cards}")
    q, r = divmod(num_layers, num_cards)
    return [q + (1 if k < r else 0) for k in range(num_cards)]


# ------------------------------------------------------------------------------------------------
# plan data
# ------------------------------------------------------------------------------------------------
MEM_KEYS = ("baseline", "weights", "grads", "optimizer", "activations", "transient", "workspace",
            "total")
TIME_KEYS = ("compute", "bubble", "host_optimizer", "device_optimizer", "transfer", "total")


@dataclass
class StagePlan:
    """One card's share of the model and its predicted cost.

    ``mem`` (bytes) has keys baseline, weights, grads, optimizer, activations, transient,
    workspace, total; ``time`` (seconds per optimizer step) has keys compute, bubble,
    host_optimizer, device_optimizer, transfer, total (see the module docstring);
    ``host_bytes`` is the host RAM for the stage's offloaded fp32 master + AdamW moments (0 on a
    cpu card, where that state is part of ``mem``);
    ``in_flight`` the micro-batches whose activations the stage holds at peak.
    """

    card: CardSpec
    first_layer: int
    last_layer: int
    has_embed: bool
    has_head: bool
    resident: list[int]
    offloaded: list[int]
    mem: dict[str, int]
    time: dict[str, float]
    host_bytes: int
    in_flight: int = 0
    nonlayer_resident: bool = False

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer

    @property
    def fits(self) -> bool:
        return self.mem["total"] <= self.card.capacity_bytes

    @property
    def layers_label(self) -> str:
        """E.g. ``"0-15 +emb"``, ``"16-31 +head"``."""
        s = f"{self.first_layer}-{self.last_layer - 1}"
        if self.has_embed:
            s += " +emb"
        if self.has_head:
            s += " +head"
        return s


@dataclass
class Plan:
    """A full placement: one :class:`StagePlan` per card, in pipeline order."""

    model: LlamaConfig
    shape: RunShape
    stages: list[StagePlan]
    step_time_s: float
    tokens_per_step: int
    fits: bool
    rates: list[Rates] = field(default_factory=list)
    host_ram_bytes: Optional[int] = None

    @property
    def split(self) -> list[int]:
        return [st.num_layers for st in self.stages]

    @property
    def resident_counts(self) -> list[int]:
        return [len(st.resident) for st in self.stages]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def host_bytes(self) -> int:
        return sum(st.host_bytes for st in self.stages)

    def to_dict(self) -> dict:
        """JSON-friendly summary (for run directories and ``--dry-run --json``)."""
        return {
            "model": self.model.name,
            "shape": asdict(self.shape),
            "split": self.split,
            "step_time_s": self.step_time_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "host_bytes": self.host_bytes,
            "stages": [
                {
                    "card": st.card.name, "capacity_bytes": st.card.capacity_bytes,
                    "first_layer": st.first_layer, "last_layer": st.last_layer,
                    "has_embed": st.has_embed, "has_head": st.has_head,
                    "resident": list(st.resident), "offloaded": list(st.offloaded),
                    "nonlayer_resident": st.nonlayer_resident, "in_flight": st.in_flight,
                    "mem": dict(st.mem), "time": dict(st.time), "host_bytes": st.host_bytes,
                }
                for st in self.stages
            ],
        }

    def table(self, width: int = 180) -> str:
        """Per-card text table (GiB and seconds), with a totals line and predicted tokens/s."""
        from rich.console import Console
        from rich.table import Table

        t = Table(show_footer=True, box=None, pad_edge=False, padding=(0, 1))
        cols = [
            ("card", "total", "left"), ("layers", f"{self.model.num_layers} layers", "left"),
            ("res", "", "right"), ("off", "", "right"),
            ("base\nGiB", "", "right"), ("weights\nGiB", "", "right"),
            ("grads\nGiB", "", "right"), ("optim\nGiB", "", "right"), ("act\nGiB", "", "right"),
            ("trans\nGiB", "", "right"), ("ws\nGiB", "", "right"),
            ("total\nGiB", "", "right"), ("cap\nGiB", "", "right"),
            ("compute\ns", "", "right"), ("bubble\ns", "", "right"),
            ("host-opt\ns", "", "right"), ("dev-opt\ns", "", "right"), ("xfer\ns", "", "right"),
            ("stage\ns", "", "right"),
            ("host\nGiB", "", "right"),
        ]
        tot_mem = {k: sum(st.mem[k] for st in self.stages) for k in MEM_KEYS}
        footers = {
            "res": str(sum(len(st.resident) for st in self.stages)),
            "off": str(sum(len(st.offloaded) for st in self.stages)),
            "cap\nGiB": f"{gib(sum(st.card.capacity_bytes for st in self.stages)):.1f}",
            "stage\ns": f"step {self.step_time_s:.2f}",
            "host\nGiB": f"{gib(self.host_bytes):.2f}",
        }
        for key, mk in zip(("base", "weights", "grads", "optim", "act", "trans", "ws", "total"),
                           MEM_KEYS):
            footers[f"{key}\nGiB"] = f"{gib(tot_mem[mk]):.2f}"
        for name, footer, justify in cols:
            t.add_column(name, footer=footers.get(name, footer), justify=justify, no_wrap=True)
        for st in self.stages:
            m, tm = st.mem, st.time
            total = f"{gib(m['total']):.2f}" + ("" if st.fits else " !")
            t.add_row(
                st.card.name, st.layers_label, str(len(st.resident)), str(len(st.offloaded)),
                f"{gib(m['baseline']):.2f}", f"{gib(m['weights']):.2f}", f"{gib(m['grads']):.2f}",
                f"{gib(m['optimizer']):.2f}", f"{gib(m['activations']):.2f}",
                f"{gib(m['transient']):.2f}", f"{gib(m['workspace']):.2f}", total,
                f"{gib(st.card.capacity_bytes):.1f}",
                f"{tm['compute']:.2f}", f"{tm['bubble']:.2f}", f"{tm['host_optimizer']:.2f}",
                f"{tm['device_optimizer']:.2f}", f"{tm['transfer']:.2f}", f"{tm['total']:.2f}",
                f"{gib(st.host_bytes):.2f}",
            )
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None, force_terminal=False,
                highlight=False, emoji=False).print(t)
        lines = [buf.getvalue().rstrip("\n")]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        over = [st.card.name for st in self.stages if not st.fits]
        if over:
            verdict += f" (over capacity: {', '.join(over)})"
        if self.host_ram_bytes is not None and self.host_bytes > self.host_ram_bytes:
            verdict += (f" (host RAM {gib(self.host_bytes):.2f} GiB needed > "
                        f"{gib(self.host_ram_bytes):.2f} GiB)")
        lines.append(
            f"predicted: step {self.step_time_s:.2f} s, {self.tokens_per_step} tokens/step, "
            f"{self.tokens_per_s:,.0f} tokens/s; {verdict}"
        )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# stage arithmetic
# ------------------------------------------------------------------------------------------------
@dataclass
class _StageCost:
    resident: int
    nonlayer_resident: bool
    mem: dict
    host_params: int      # params whose optimizer runs on the host (offloaded)
    device_params: int    # params whose optimizer runs on the card (resident)
    xfer_params: int      # params moved card<->host each step (each direction)
    t_mb: float           # compute seconds per micro-batch
    in_flight: int
    host_state_on_card: bool = False   # cpu card: the offloaded state is in the card's memory

    @property
    def host_bytes(self) -> int:
        return 0 if self.host_state_on_card else 12 * self.host_params


class _Model:
    """Per-plan constants, so the split search evaluates stages cheaply."""

    def __init__(self, model: LlamaConfig, shape: RunShape, cards: list[CardSpec],
                 rates: list[Rates], nonlayer_resident: Optional[bool],
                 cpu_threads: Optional[int] = None, host_cores: Optional[int] = None):
        self.model, self.shape, self.cards = model, shape, cards
        self.P = len(cards)
        self.Pl = model.params_per_layer()
        self.E = model.embedding_params()
        self.H = model.hidden_size
        self.e = shape.dtype_bytes
        self.tied = bool(model.tie_word_embeddings)
        self.nl_flag = nonlayer_resident
        # cpu cards share the host's cores (see the module docstring)
        n_cpu = sum(1 for c in cards if c.kind == "cpu")
        cores = int(host_cores or os.cpu_count() or 1)
        self.cpu_threads = int(cpu_threads) if cpu_threads else max(1, cores // max(1, n_cpu))
        # all cpu cards run their optimizers at the same time: each gets its share of the cores
        self.cpu_share = min(1.0, cores / (n_cpu * self.cpu_threads)) if n_cpu else 1.0
        self.rates = []
        for card, rt in zip(cards, rates):
            if card.kind == "cpu":
                r = rt.resolve(shape.dtype, self.cpu_threads)
                r.host_adamw_params_per_s *= self.cpu_share
                r.device_adamw_params_per_s *= self.cpu_share
            else:
                r = rt.resolve(shape.dtype)
            self.rates.append(r)
        # pipeline phase = slots * max_i t_i. Slot j (0 .. M+P-2) of a wave has the stages
        # max(0, j-M+1) .. min(j, P-1) computing; when the cpu ones among them run more threads
        # than there are cores, the slot stretches by (cpu stages * threads / cores).
        M, P = shape.micro_batches, self.P
        cpu_stage = [c.kind == "cpu" for c in cards]
        self.slots = 0.0
        for j in range(M + P - 1):
            active = sum(1 for st in range(max(0, j - M + 1), min(j, P - 1) + 1) if cpu_stage[st])
            self.slots += max(1.0, active * self.cpu_threads / cores)
        self.act_layer = {a: activation_bytes_per_layer(model, shape, a) for a in ("eager", "sdpa")}
        self.layer_input = shape.seq_len * shape.micro_batch * self.H * self.e
        self.saved_logits = saved_logits_bytes(model, shape)
        # largest single tensor of a decoder layer (gate/up/down or q/o projection)
        q = model.num_heads * model.head_dim
        self.layer_maxp = max(self.H * model.intermediate_size, self.H * q)
        tok = shape.tokens_per_micro_batch
        rc = 8.0 / 6.0 if shape.recompute else 1.0
        self.layer_flops = rc * (6.0 * tok * self.Pl
                                 + 12.0 * shape.seq_len * tok * model.num_heads * model.head_dim)
        self.head_flops = rc * 6.0 * tok * self.E
        self._cache: dict = {}

    def nonlayer(self, i: int) -> tuple[int, int]:
        """(owned non-layer params, tied-copy params) of stage i."""
        owned, copy = 0, 0
        if i == 0:
            owned += self.E
        if i == self.P - 1:
            owned += self.H
            if not self.tied:
                owned += self.E
            elif self.P > 1:
                copy += self.E
        return owned, copy

    def cost(self, i: int, n: int, r: int) -> _StageCost:
        key = (i, n, r)
        c = self._cache.get(key)
        if c is not None:
            return c
        kind = self.cards[i].kind
        cpu = kind == "cpu"
        e, E, P, sh = self.e, self.E, self.P, self.shape
        first, last = i == 0, i == P - 1
        owned, copy = self.nonlayer(i)
        nl_res = (r == n) if self.nl_flag is None else bool(self.nl_flag)
        params = n * self.Pl + owned + copy
        res_params = r * self.Pl + (owned + copy if nl_res else 0)
        off_params = params - res_params
        weights = e * params
        grads = weights
        optimizer = 12 * (params if cpu else res_params)
        # activations: saved tensors of the micro-batches in flight
        k = in_flight_micro_batches(i, P, sh.micro_batches, sh.schedule)
        act_layer = self.act_layer[ATTENTION[kind]]
        if sh.recompute:
            acts = k * n * self.layer_input + (act_layer if n else 0)
            one_mb = n * self.layer_input
        else:
            acts = k * n * act_layer
            one_mb = n * act_layer
        if last:
            acts += k * self.saved_logits
        # transient: peak-phase temporaries beyond the saved activations
        maxp = max(self.layer_maxp if n else 0, E if (first or last) else 0)
        accumulates = sh.micro_batches > 1 or (P == 1 and self.tied)
        acc = e * maxp if accumulates else 0
        if last:
            fwd_bwd = acts + max(2 * self.saved_logits, acc)
        else:
            fwd_bwd = acts + max(0, acc - one_mb)
        norm_tmp = (4 if e == 4 else 8) * maxp
        master_grads = (4 * off_params if cpu else 0) + (4 * res_params if e != 4 else 0)
        if cpu and off_params:
            master_grads += e * maxp            # one upload temporary
        opt_phase = max(norm_tmp, master_grads)
        held = 0
        if self.tied and P > 1 and (first or last):
            held = (e + 4) * E if cpu else e * E
        transient = max(fwd_bwd, opt_phase) - acts + held
        const, frac = WORKSPACE[kind]
        body = weights + grads + optimizer + acts + transient
        ws = int(const + frac * body)
        baseline = int(self.rates[i].process_baseline_bytes)
        mem = {"baseline": baseline, "weights": weights, "grads": grads, "optimizer": optimizer,
               "activations": acts, "transient": transient, "workspace": ws}
        mem["total"] = baseline + body + ws
        xfer = off_params + (E if self.tied and P > 1 and (first or last) else 0)
        rt = self.rates[i]
        t_mb = n * self.layer_flops / rt.device_flops
        if last:
            t_mb += self.head_flops / (rt.device_flops * rt.head_flops_ratio)
        c = _StageCost(r, nl_res, mem, off_params, res_params, xfer, t_mb, k,
                       host_state_on_card=cpu)
        self._cache[key] = c
        return c

    def side_time(self, i: int, c: _StageCost) -> tuple[float, float, float]:
        """(host optimizer, device optimizer, transfer) seconds per step."""
        rt = self.rates[i]
        host = c.host_params / rt.host_adamw_params_per_s
        dev = c.device_params / rt.device_adamw
        xfer = self.e * c.xfer_params * (1.0 / rt.h2d_bytes_per_s + 1.0 / rt.d2h_bytes_per_s)
        return host, dev, xfer

    def max_resident(self, i: int, n: int) -> int:
        """Most resident layers (0..n) that fit card i with n layers, or -1 if not even 0 fits."""
        cap = self.cards[i].capacity_bytes
        if self.cost(i, n, 0).mem["total"] > cap:
            return -1
        lo, hi = 0, n  # memory is non-decreasing in r
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost(i, n, mid).mem["total"] <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def build(self, split: list[int], resident: list[int]) -> Plan:
        costs = [self.cost(i, n, r) for i, (n, r) in enumerate(zip(split, resident))]
        M = self.shape.micro_batches
        t_max = max(c.t_mb for c in costs)
        phase = self.slots * t_max
        stages, first = [], 0
        for i, (n, c) in enumerate(zip(split, costs)):
            host, dev, xfer = self.side_time(i, c)
            # with cpu cards sharing cores: including the phase's average slowdown
            compute = M * c.t_mb * self.slots / (M + self.P - 1)
            time = {"compute": compute, "bubble": phase - compute, "host_optimizer": host,
                    "device_optimizer": dev, "transfer": xfer,
                    "total": phase + host + dev + xfer}
            stages.append(StagePlan(
                card=self.cards[i], first_layer=first, last_layer=first + n,
                has_embed=(i == 0), has_head=(i == self.P - 1),
                resident=list(range(first, first + c.resident)),
                offloaded=list(range(first + c.resident, first + n)),
                mem=dict(c.mem), time=time, host_bytes=c.host_bytes, in_flight=c.in_flight,
                nonlayer_resident=c.nonlayer_resident,
            ))
            first += n
        step = max(st.time["total"] for st in stages)
        fits = all(st.fits for st in stages)
        return Plan(self.model, self.shape, stages, step, self.shape.tokens_per_step, fits,
                    rates=list(self.rates))


def _card_label(i: int, card: CardSpec) -> str:
    return f"card {i} ({card.name})"


def _over_capacity_message(pm: _Model, plan: Plan, st_index: int) -> str:
    st = plan.stages[st_index]
    m = st.mem
    r = len(st.resident)
    fixes = []
    if r:
        best = pm.max_resident(st_index, st.num_layers)
        fixes.append(f"fewer resident layers on this card (now {r}; "
                     + (f"at most {best} fit)" if best >= 0 else "even 0 does not fit)"))
    fixes += ["more cards", "recompute=True" if not plan.shape.recompute else None,
              f"smaller micro_batch (now {plan.shape.micro_batch}) or seq_len "
              f"(now {plan.shape.seq_len})"]
    return (
        f"{_card_label(st_index, st.card)} holding layers {st.layers_label}: predicted "
        f"{gib(m['total']):.2f} GiB ("
        + (f"baseline {gib(m['baseline']):.2f} + " if m["baseline"] else "")
        + f"weights {gib(m['weights']):.2f} + grads {gib(m['grads']):.2f}"
        f" + optimizer {gib(m['optimizer']):.2f} + activations {gib(m['activations']):.2f}"
        f" + transient {gib(m['transient']):.2f}"
        f" + workspace {gib(m['workspace']):.2f}) > capacity {gib(st.card.capacity_bytes):.2f} GiB"
        f"; fix: " + ", ".join(f for f in fixes if f)
    )


def _check_host(plan: Plan, host_ram_bytes: Optional[int], strict: bool) -> Plan:
    plan.host_ram_bytes = host_ram_bytes
    if host_ram_bytes is None or plan.host_bytes <= host_ram_bytes:
        return plan
    plan.fits = False
    if strict:
        per = ", ".join(f"{_card_label(i, st.card)} {gib(st.host_bytes):.2f} GiB"
                        for i, st in enumerate(plan.stages) if st.host_bytes)
        raise PlacementError(
            f"host RAM too small for the offloaded optimizer state: predicted "
            f"{gib(plan.host_bytes):.2f} GiB ({per}) > host RAM {gib(host_ram_bytes):.2f} GiB; "
            f"fix: more resident layers, more cards, or a host with more RAM"
        )
    return plan


def _search_split(pm: _Model, L: int) -> Optional[list[int]]:
    """Split minimizing ``(M+P-1) * max_i t_i + max_i (host_i + dev_i + xfer_i)`` with every stage at its
    auto resident count; ``None`` if no split fits. Exact: for a stage, t, host+xfer and memory at
    0 resident are all non-decreasing in its layer count, so for bounds (T, X) each stage admits
    n in [1, U_i(T, X)] and a split exists iff sum U_i >= L."""
    P, M = pm.P, pm.shape.micro_batches
    A = pm.slots
    nmax = L - P + 1
    t_tab, x_tab, ufit = [], [], []
    for i in range(P):
        ts, xs, fit = [], [], 0
        for n in range(1, nmax + 1):
            r = pm.max_resident(i, n)
            if r < 0:
                break
            c = pm.cost(i, n, r)
            h, d, x = pm.side_time(i, c)
            ts.append(c.t_mb)
            xs.append(h + d + x)
            fit = n
        if fit == 0:
            return None
        # enforce monotonicity against float noise / the non-layer step
        for j in range(1, len(ts)):
            ts[j] = max(ts[j], ts[j - 1])
            xs[j] = max(xs[j], xs[j - 1])
        t_tab.append(ts)
        x_tab.append(xs)
        ufit.append(fit)
    if sum(ufit) < L:
        return None
    t_vals = sorted({t for ts in t_tab for t in ts})
    x_vals = sorted({x for xs in x_tab for x in xs})

    def upper(T: float, X: float) -> list[int]:
        return [min(ufit[i], bisect_right(t_tab[i], T), bisect_right(x_tab[i], X))
                for i in range(P)]

    def ok(U: list[int]) -> bool:
        return min(U) >= 1 and sum(U) >= L

    best = None
    for T in t_vals:
        lo, hi = 0, len(x_vals) - 1
        if not ok(upper(T, x_vals[hi])):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(upper(T, x_vals[mid])):
                hi = mid
            else:
                lo = mid + 1
        obj = A * T + x_vals[lo]
        if best is None or obj < best[0] * (1 - 1e-12):
            best = (obj, T, x_vals[lo])
    if best is None:
        return None
    U = upper(best[1], best[2])
    # fill: one layer each, then grow the stage whose next layer costs the least
    split = [1] * P
    for _ in range(L - P):
        cand = [(A * t_tab[i][split[i]] + x_tab[i][split[i]], i)
                for i in range(P) if split[i] < U[i]]
        _, i = min(cand)
        split[i] += 1
    return split


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def make_plan(
    model: LlamaConfig,
    shape: RunShape,
    cards: Sequence[CardSpec],
    rates: Union[Rates, Sequence[Rates]],
    split: Optional[Sequence[int]] = None,
    resident_layers: Union[str, int, Sequence[int]] = "auto",
    host_ram_bytes: Optional[int] = None,
    *,
    nonlayer_resident: Optional[bool] = None,
    strict: bool = True,
    cpu_threads: Optional[int] = None,
    host_cores: Optional[int] = None,
) -> Plan:
    """Place ``model`` on ``cards`` (pipeline order) and predict memory and step time.

    Args:
        model: architecture.
        shape: sequence length, micro-batch, accumulation steps, schedule, dtype, recompute.
        cards: one :class:`CardSpec` per pipeline stage.
        rates: one :class:`Rates` for all cards, or one per card.
        split: decoder layers per card (sums to ``model.num_layers``). ``None``: balanced
            (:func:`balanced_split`), except with ``resident_layers="auto"``, which searches all
            splits (e.g. fewer layers on the last card, which computes the lm_head, or on the
            first, which stores the embedding) for the lowest predicted step time.
        resident_layers: ``"auto"`` (per card the most resident layers that fit, since resident
            layers remove host-optimizer and transfer time), an int N (N on every card; more than
            a card's layers is an error) or a per-card list.
        host_ram_bytes: if given, the offloaded master + moments of all cards must fit in it.
        nonlayer_resident: keyword-only. Optimizer state of embedding / final norm / untied
            lm_head on the card (True), on the host (False), or (None, default) on the card exactly
            when all of that card's layers are resident.
        strict: keyword-only. If False, an infeasible placement returns a plan with
            ``fits=False`` instead of raising (layout errors always raise).
        cpu_threads: keyword-only. torch threads per cpu card process (``runtime.threads``);
            ``None``: the launcher's default ``max(1, host_cores // number of cpu cards)``.
        host_cores: keyword-only. Cores the cpu cards share; ``None``: ``os.cpu_count()``.

    Returns:
        The :class:`Plan`; ``plan.table()`` / :func:`format_plan` render it.

    Raises:
        PlacementError: a card over capacity (message: card, predicted GiB, capacity GiB, fixes),
            nothing fits in auto mode, host RAM too small, more cards than layers, resident count
            above a card's layer count, a bad ``split``.

    Reference figures (Llama-3.1-8B, S=512, micro-batch 1, M=4, bf16, 1F1B, RNGD 47.5 GiB =
    51.0 GB), from an earlier RNGD deployment, reproduced by ``tests/unit/test_placement.py``:

    1. fp32 master + AdamW m, v of one resident decoder layer: 218,112,000 params * 12 B
       = 2.617 GB (2.44 GiB): ``optimizer`` term only.
    2. One card, all 32 layers, 8 resident (24 offloaded + embedding/lm_head offloaded by the
       default rule): "~50 GB, does not fit". Reproduced by the *static state*
       weights + grads + optimizer = 16.06 + 16.06 + 20.94 GB = 53.06 GB = **49.4 GiB**: the
       deployment's "GB" were binary (in decimal it would be 6 % above 50). That alone exceeds
       47.5 GiB; the full plan adds activations (4.9 GB) and workspace (4.0 GB) for 57.7 GiB
       (61.9 GB) total -> ``PlacementError`` / ``fits=False``.
    3. Two cards, 16 layers each, nothing resident: "~15 GB per card". Reproduced by the static
       state weights + grads = 16.06 GB = **14.96 GiB** per card (first: 16 layers + embedding;
       last: 16 layers + norm + lm_head), again binary units (decimal 16.06 GB is within 10 %).
       The full plan adds activations (first card: 2 micro-batches in flight * 16 layers *
       136.3 MB = 4.36 GB; last: 1 * 16 * 136.3 MB + 0.53 GB logits) and workspace (~2 GB):
       22.5 GB (21.0 GiB) on the first card, 20.8 GB (19.4 GiB) on the last.
    """
    cards = list(cards)
    P, L = len(cards), model.num_layers
    if P < 1:
        raise PlacementError("no cards given")
    if P > L:
        raise PlacementError(
            f"more cards ({P}) than decoder layers ({L}) of {model.name}: every card needs at "
            f"least one layer; fix: use at most {L} cards"
        )
    if isinstance(rates, Rates):
        rates_l = [rates] * P
    else:
        rates_l = list(rates)
        if len(rates_l) != P:
            raise ValueError(f"got {len(rates_l)} Rates for {P} cards")

    pm = _Model(model, shape, cards, rates_l, nonlayer_resident, cpu_threads, host_cores)

    if split is not None:
        split_l = [int(n) for n in split]
        if len(split_l) != P:
            raise PlacementError(f"split {split_l} has {len(split_l)} entries for {P} cards")
        if any(n < 1 for n in split_l):
            raise PlacementError(f"split {split_l}: every card needs at least one layer")
        if sum(split_l) != L:
            raise PlacementError(
                f"split {split_l} sums to {sum(split_l)} layers; {model.name} has {L}")
    else:
        split_l = None

    # ---- explicit resident counts ----
    if not isinstance(resident_layers, str):
        if split_l is None:
            split_l = balanced_split(L, P)
        if isinstance(resident_layers, numbers.Integral):
            res_l = [resident_layers] * P
        else:
            res_l = [int(r) for r in resident_layers]
            if len(res_l) != P:
                raise PlacementError(
                    f"resident_layers {res_l} has {len(res_l)} entries for {P} cards")
        for i, (n, r) in enumerate(zip(split_l, res_l)):
            if r < 0:
                raise PlacementError(f"{_card_label(i, cards[i])}: resident layers {r} < 0")
            if r > n:
                raise PlacementError(
                    f"{_card_label(i, cards[i])} holds {n} layers but {r} resident layers were "
                    f"requested; fix: resident_layers <= {n} on this card (split {split_l})")
        plan = pm.build(split_l, res_l)
        if strict:
            for i, st in enumerate(plan.stages):
                if not st.fits:
                    raise PlacementError(_over_capacity_message(pm, plan, i))
        return _check_host(plan, host_ram_bytes, strict)

    if resident_layers != "auto":
        raise ValueError(
            f"resident_layers must be 'auto', an int or a list, got {resident_layers!r}")

    # ---- auto ----
    if split_l is None:
        found = _search_split(pm, L)
        if found is not None:
            bal = balanced_split(L, P)
            rb = [pm.max_resident(i, n) for i, n in enumerate(bal)]
            if min(rb) >= 0:
                # keep the balanced split unless the search is strictly faster
                pb = pm.build(bal, rb)
                pf = pm.build(found, [pm.max_resident(i, n) for i, n in enumerate(found)])
                if pb.step_time_s <= pf.step_time_s * (1 + 1e-9):
                    found = bal
            split_l = found
    if split_l is not None:
        res_l = [pm.max_resident(i, n) for i, n in enumerate(split_l)]
        if min(res_l) >= 0:
            return _check_host(pm.build(split_l, res_l), host_ram_bytes, strict)
    # nothing fits: explain with the given (or balanced) split at 0 resident layers
    split_e = split_l if split_l is not None else balanced_split(L, P)
    plan = pm.build(split_e, [0] * P)
    plan.fits = False
    if not strict:
        return _check_host(plan, host_ram_bytes, strict=False)
    bad = [i for i, st in enumerate(plan.stages) if not st.fits] or [0]
    raise PlacementError(
        "no placement fits even with no resident layers"
        + ("" if split is not None else " on any split")
        + ": " + "; ".join(_over_capacity_message(pm, plan, i) for i in bad)
    )


def format_plan(plan: Plan, width: int = 180) -> str:
    """Dry-run report: model and run shape, the per-card table, and the model's assumptions."""
    m, s = plan.model, plan.shape
    head = [
        f"model {m.name}: {m.total_params():,} params ({m.num_layers} layers x "
        f"{m.params_per_layer():,} + embedding {m.embedding_params():,}"
        f"{' tied' if m.tie_word_embeddings else ' x2 (untied)'})",
        f"run: seq_len {s.seq_len}, micro_batch {s.micro_batch}, micro_batches {s.micro_batches}, "
        f"schedule {s.schedule}, dtype {s.dtype}, recompute {'on' if s.recompute else 'off'}; "
        f"split {plan.split}, resident {plan.resident_counts}",
        "",
        plan.table(width=width),
        "",
        "assumptions: weights+grads in compute dtype; resident params +12 B/param (fp32 master "
        "+ AdamW m, v; on cpu cards all params); offloaded: host AdamW + card<->host copies each "
        "step, not overlapped; activations "
        + ", ".join(f"{k} {gb(activation_bytes_per_layer(m, s, ATTENTION[k])) * 1e3:.1f}"
                    for k in sorted({st.card.kind for st in plan.stages}))
        + " MB/layer/micro-batch (no recompute); transient = peak-phase temporaries; "
        "workspace = const + fraction per kind (cpu: 12% allocator slack); base = process "
        "baseline (cpu: RSS).",
    ]
    seen = set()
    for st, rt in zip(plan.stages, plan.rates or []):
        if st.card.kind in seen:
            continue
        seen.add(st.card.kind)
        head.append(
            f"rates {st.card.kind}: {rt.device_flops / 1e12:.3g} TFLOP/s, h2d "
            f"{rt.h2d_bytes_per_s / 1e9:.1f} GB/s, d2h {rt.d2h_bytes_per_s / 1e9:.1f} GB/s, "
            f"host AdamW {rt.host_adamw_params_per_s / 1e6:.0f} M params/s, device AdamW "
            f"{rt.device_adamw / 1e6:.0f} M params/s"
            + (f", baseline {gib(rt.process_baseline_bytes):.2f} GiB"
               if rt.process_baseline_bytes else "")
            + (f", {rt.threads} thread(s)" if st.card.kind == "cpu" and rt.threads else "")
        )
    return "\n".join(head)
