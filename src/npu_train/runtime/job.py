"""Job preparation: everything between the parsed configuration and the first card process.

:func:`run_job` validates the configuration, resolves ``backend=`` into cards, plans the placement
(:mod:`npu_train.planner`), checks the model files' headers, tokenizes and packs the data, checks
the resume checkpoint, ``/dev/shm`` and ports, builds one :class:`~npu_train.runtime.spec.WorkerSpec`
per card (:func:`build_worker_specs`, the only place they are built), then hands them to the
:class:`~npu_train.runtime.coordinator.Coordinator`. Every check that can reject the job runs before
anything is written, and raises a :class:`~npu_train.errors.UserError` naming the fix.
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from typing import Optional

from npu_train.env import cache_dir, getenv
from npu_train.errors import ConfigError, Interrupted
from npu_train.runtime.coordinator import Coordinator
from npu_train.runtime.spec import CardInfo, RuntimeSpec, StageInfo, TrainSpec, WorkerSpec
from npu_train.transport.channel import Endpoint


def check_port(host: str, port: int) -> None:
    """Raise :class:`ConfigError` if ``port`` on ``host`` is already taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"runtime.port={port} on {host} is in use ({e.strerror}): "
                              "pick another runtime.port or use runtime.port=0 for a free one") from None




def as_list(v):
    """A Hydra/OmegaConf list value (or a plain one) as a Python list; scalars and None unchanged."""
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return list(v)
    try:
        from omegaconf import ListConfig, OmegaConf

        if isinstance(v, ListConfig):
            return list(OmegaConf.to_container(v))
    except ImportError:
        pass
    return v


def prepare(cfg, run_dir: str, *, probe: bool = True) -> dict:
    """Validate ``cfg`` and build everything needed before a card process starts.

    Returns a dict with ``cards``, ``model_cfg`` (LlamaConfig), ``plan`` (placement Plan),
    ``shape``, ``dtype`` and ``model_path``. Raises a :class:`~npu_train.errors.UserError` on bad input.
    """
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import compute_dtype, validate
    from npu_train.model.loading import load_config, resolve_model_path
    from npu_train.planner import CardSpec, RunShape, default_capacity, load_rates, make_plan, threads_per_card

    validate(cfg)
    reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)), probe=probe)
    mcfg, model_path = _preset_config(cfg.model.path), None
    if mcfg is None:
        model_path = resolve_model_path(cfg.model.path)
        mcfg = load_config(model_path)
        if not cfg.plan:
            check_model_files(model_path, mcfg)
    elif not cfg.plan:
        raise ConfigError(f"model.path={cfg.model.path} is a shape preset without weights: use it with plan=true, "
                          "or point model.path at an HF directory or a GGUF file")
    tr = cfg.train
    if cfg.data.seq_len > mcfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's maximum sequence length "
                          f"{mcfg.max_position_embeddings} (max_position_embeddings): lower data.seq_len")
    if len(reqs) > mcfg.num_layers:
        raise ConfigError(f"{len(reqs)} cards but the model has only {mcfg.num_layers} layers: "
                          f"use at most {mcfg.num_layers} backend entries")
    dtype = compute_dtype(tr.dtype, [r.kind for r in reqs])
    shape = RunShape(seq_len=cfg.data.seq_len, micro_batch=tr.micro_batch, micro_batches=tr.accum,
                     schedule=tr.schedule, dtype=dtype, recompute=tr.recompute)
    n_cpu = sum(1 for r in reqs if r.kind == "cpu")
    cards = []
    for r in reqs:
        cap = default_capacity(r.kind)
        if r.kind == "cpu" and n_cpu:
            cap = cap // n_cpu
        if cfg.placement.capacity_gib:
            cap = int(cfg.placement.capacity_gib * 2 ** 30)
        name = r.kind if r.kind == "cpu" and n_cpu == 1 else (f"cpu:{len([c for c in cards if c.kind == 'cpu'])}" if r.kind == "cpu" else f"{r.kind}:{r.index}")
        cards.append(CardSpec(kind=r.kind, index=r.index, capacity_bytes=cap, name=name))
    # one thread count for the plan's step time and the card processes (WorkerSpec.runtime.threads)
    threads = threads_per_card(cfg.runtime.threads, len(cards))
    rates = [load_rates(r.kind, cfg.placement.profile, threads=threads) for r in reqs]
    resident = as_list(tr.resident_layers)
    if isinstance(resident, str) and resident != "auto":
        try:
            resident = int(resident)
        except ValueError:
            raise ConfigError(f"train.resident_layers={resident!r}: use auto, an integer, or a list per card") from None
    try:
        import psutil

        host_ram = psutil.virtual_memory().total
    except Exception:
        host_ram = None
    # A dry run plans for the target server, not this machine: its host RAM is not checked then
    # (the table shows the host GiB the offloaded state needs).
    plan = make_plan(mcfg, shape, cards, rates, split=as_list(tr.split), resident_layers=resident,
                     host_ram_bytes=None if cfg.plan else host_ram, threads=threads)
    return {"cards": cards, "requests": reqs, "model_cfg": mcfg, "plan": plan, "shape": shape,
            "dtype": dtype, "model_path": model_path, "threads": threads}


def _preset_config(path: str):
    """The preset's LlamaConfig when ``path`` names a preset (and no such file exists), else None."""
    from npu_train.model.presets import get_preset

    if os.path.exists(os.path.expanduser(path)) or path in ("embedded", "smollm2"):
        return None
    try:
        return get_preset(path)
    except KeyError:
        return None


def check_model_files(model_path: str, mcfg) -> None:
    """Check that the weights file(s) hold every parameter with the right shape (headers only).

    Without this, a missing or mis-shaped tensor is only found by the card process that loads
    it, after every process has started (exit 1, a run directory with partial artifacts); here
    it is a user error (exit 2) before anything is spawned. Reads safetensors headers
    (``safe_open`` keys and ``get_slice().get_shape()``) or the GGUF tensor table: no tensor data.
    Raises :class:`~npu_train.model.loading.ModelFormatError`.
    """
    from npu_train.model import loading as L
    from npu_train.model.llama import checkpoint_source_name

    names = list(mcfg.param_shapes(None))
    for i in range(mcfg.num_layers):
        names += list(mcfg.param_shapes(i))
    wanted = {checkpoint_source_name(mcfg, n): (n, L._expected_shape(mcfg, n)) for n in names}
    path = os.path.expanduser(model_path)
    if L._is_gguf_path(path):
        by_name = {t.name: t for t in L._gguf_reader(path).tensors}
        for src, (n, shape) in wanted.items():
            t = by_name.get(L._hf_to_gguf_name(src))
            if t is None:
                raise L.ModelFormatError(f"tensor {src!r} (GGUF {L._hf_to_gguf_name(src)!r}) not found in {path}: "
                                         "the file is incomplete or not this model; re-download or re-convert it")
            found = tuple(int(x) for x in reversed(t.shape))
            if found != tuple(shape):
                raise _shape_mismatch(L, n, src, path, shape, found)
        return
    from safetensors import safe_open

    where, source = L._safetensors_index(L._hf_dir(path))
    by_file: dict[str, list[str]] = {}
    for src in wanted:
        fp = where.get(src)
        if fp is None:
            raise L.ModelFormatError(f"tensor {src!r} not found in {source}: the weights do not match "
                                     "config.json (incomplete download or another model); re-download the model")
        by_file.setdefault(fp, []).append(src)
    for fp, srcs in by_file.items():
        if not os.path.isfile(fp):
            raise L.ModelFormatError(f"{fp}: shard listed in the index is missing; re-download the model")
        try:
            with safe_open(fp, framework="pt") as f:
                keys = set(f.keys())
                for src in srcs:
                    n, shape = wanted[src]
                    if src not in keys:
                        raise L.ModelFormatError(f"tensor {src!r} not found in {fp}; re-download the model")
                    found = tuple(f.get_slice(src).get_shape())
                    if found != tuple(shape):
                        raise _shape_mismatch(L, n, src, fp, shape, found)
        except L.ModelFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - unreadable header
            raise L.ModelFormatError(f"{fp}: not a readable safetensors file ({e}); re-download the model") from e


def _shape_mismatch(L, name, src, where, expected, found):
    e = L._shape_error(name, src, where, expected, found)
    return L.ModelFormatError(f"{e}: the weights do not match config.json (another model or a corrupt file); "
                              "re-download the model or fix config.json")


def _shm_free_bytes() -> int:
    """Free bytes in /dev/shm; ``NPT_SHM_FREE_BYTES`` overrides the figure (test-only: simulates
    a small /dev/shm, e.g. Docker's 64 MB default, for the pre-spawn check)."""
    from npu_train.transport.shm import shm_free_bytes

    override = getenv("SHM_FREE_BYTES")
    return int(override) if override else shm_free_bytes()


def resident_param_names(model_cfg, stage) -> list[str]:
    """HF names of a stage's parameters that are resident (master + moments on the card).

    Decoder layers follow the plan; the embedding, final norm and LM head follow the plan's
    ``nonlayer_resident`` flag (the placement model's choice, so memory is predicted for what runs).
    """
    names = []
    for i in stage.resident:
        names += model_cfg.layer_param_names(i)
    if stage.nonlayer_resident:
        if stage.has_embed:
            names.append("model.embed_tokens.weight")
        if stage.has_head:
            names += ["model.norm.weight", "lm_head.weight"]
    return names


def prepare_data(cfg, model_path: str, model_cfg, run_dir: str):
    """Tokenize and pack the dataset once (cached under ``$NPT_CACHE/data``, default ``~/.cache/npu-train/data``) and return it."""
    from npu_train.data.dataset import build_packed_data
    from npu_train.model.loading import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path)
    cache = str(cache_dir("data"))
    return build_packed_data(cfg.data.source, tok, cfg.data.seq_len, cfg.data.val_fraction,
                             eos_id=model_cfg.eos_token_id, cache_dir=cache, vocab_size=model_cfg.vocab_size)


#: modules a card process imports (calibration measures their resident memory as the process baseline)
CARD_PROCESS_MODULES = ("npu_train.runtime.worker", "npu_train.runtime.trainer", "npu_train.backends",
                        "npu_train.optim.adamw", "npu_train.pipeline.stage", "npu_train.data.dataset",
                        "npu_train.checkpoint.store", "npu_train.transport")


def train_spec(cfg, dtype: str) -> TrainSpec:
    """The :class:`~npu_train.runtime.spec.TrainSpec` of ``cfg`` with the resolved compute ``dtype``."""
    tr = cfg.train
    return TrainSpec(steps=tr.steps, micro_batch=tr.micro_batch, accum=tr.accum, lr=tr.lr,
                     min_lr_ratio=tr.min_lr_ratio, warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay,
                     beta1=tr.beta1, beta2=tr.beta2, eps=tr.eps, clip=tr.clip, schedule=tr.schedule,
                     recompute=tr.recompute, seed=tr.seed, save_every=tr.save_every,
                     save_on_interrupt=tr.save_on_interrupt, stop_after=tr.stop_after, dtype=dtype,
                     eval_every=cfg.data.eval_every, eval_batches=cfg.data.eval_batches, nonfinite=tr.nonfinite)


def build_worker_specs(plan, prep: dict, *, train: TrainSpec, runtime: RuntimeSpec, job_id: str, token: str,
                       data_file: str, start_step: int, resume_dir: Optional[str], ckpt_root: str, ipc_dir: str,
                       host: str, port: int, slot_bytes: int, slots: int) -> list[WorkerSpec]:
    """One :class:`~npu_train.runtime.spec.WorkerSpec` per stage of ``plan`` (the only place they are built).

    Addresses: with the ``shm`` transport the boundary mailboxes and the coordinator are ipc sockets in
    ``ipc_dir``; with ``inline`` they are TCP ports on ``host``. gloo rendezvous: ``tcp://host:port``.
    """

    P = len(plan.stages)
    mcfg = prep["model_cfg"]
    if runtime.transport == "shm":
        inbox = tuple(f"ipc://{ipc_dir}/r{r}.sock" for r in range(P))
        coord_addr = f"ipc://{ipc_dir}/coord.sock"
    else:
        inbox = tuple(f"tcp://{host}:{Endpoint.free_tcp_port(host)}" for _ in range(P))
        coord_addr = f"tcp://{host}:{Endpoint.free_tcp_port(host)}"
    specs = []
    for r, st in enumerate(plan.stages):
        card = prep["cards"][r]
        specs.append(WorkerSpec(
            rank=r, world_size=P, job_id=job_id, token=token, parent_pid=os.getpid(),
            card=CardInfo(card.kind, card.index, card.name), model_path=prep["model_path"], model_cfg=mcfg.to_dict(),
            stage=StageInfo(st.first_layer, st.last_layer, st.has_embed, st.has_head, st.layers_label),
            resident_names=tuple(resident_param_names(mcfg, st)), data_file=data_file, train=train, runtime=runtime,
            start_step=start_step, resume_dir=resume_dir, ckpt_root=ckpt_root, coord_addr=coord_addr, inbox=inbox,
            ipc_dir=ipc_dir, slot_bytes=slot_bytes, slots=slots, dist_init=f"tcp://{host}:{port}"))
    return specs


def run_job(cfg, run_dir: str) -> dict:
    """Run one training job described by ``cfg`` (an OmegaConf ``Config``) in ``run_dir``.

    Returns the run summary dict. Raises a :class:`~npu_train.errors.UserError` (exit 2) for bad input, :class:`~npu_train.errors.JobFailed`
    (exit 1) when a card process fails, :class:`~npu_train.errors.Interrupted` (130/143) on SIGINT/SIGTERM.
    """
    from npu_train.checkpoint.store import CheckpointReader, find_checkpoint, remove_stale_staging
    from npu_train.data.dataset import save_packed
    from npu_train.data.sampler import StepSampler
    from npu_train.metrics.report import Reporter, fmt_loss, rotate_previous_run
    from npu_train.runtime.leftovers import sweep_dead_jobs, write_job_owner
    from npu_train.transport.shm import ShmTooSmallError

    os.makedirs(run_dir, exist_ok=True)
    if cfg.calibrate:
        from npu_train.backends.spec import parse_backend_list, resolve_cards
        from npu_train.planner import main_calibrate

        reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)))
        kinds = [r.kind if r.index is None else f"{r.kind}:{r.index}" for r in reqs]
        saved = main_calibrate(kinds, modules=CARD_PROCESS_MODULES, model_path=cfg.model.path if _preset_config(cfg.model.path) is None else None,
                               profile=cfg.placement.profile)
        return {"calibrate": saved}
    if cfg.plan:
        prep = prepare(cfg, run_dir, probe=False)
        print(prep["plan"].table())
        host_need = sum(st.host_bytes for st in prep["plan"].stages)
        try:
            import psutil

            here = psutil.virtual_memory().total
            if host_need > here:
                print(f"note: the offloaded optimizer state needs {host_need / 2**30:.1f} GiB of host RAM on the "
                      f"training server; this machine has {here / 2**30:.1f} GiB (not checked in a dry run)")
        except ImportError:
            pass
        return {"plan": True}
    prep = prepare(cfg, run_dir)
    plan, mcfg, tr = prep["plan"], prep["model_cfg"], cfg.train
    P = len(plan.stages)
    data = prepare_data(cfg, prep["model_path"], mcfg, run_dir)
    if data.train.shape[0] < tr.micro_batch:
        raise ConfigError(f"the training split has {data.train.shape[0]} sequences, fewer than "
                          f"train.micro_batch={tr.micro_batch}: lower train.micro_batch or data.seq_len")

    ckpt_root = os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
    start_step, resume_dir = 0, None
    if tr.resume:
        resume_dir = find_checkpoint(tr.resume, ckpt_root)
        reader = CheckpointReader(resume_dir)
        reader.check_model(mcfg.to_dict())
        allowed = reader.check_run({k: getattr(tr, k) for k in reader.RUN_KEYS}, data.fingerprint,
                                   allow=tr.resume_mismatch == "allow")
        for d in allowed:
            print(f"note: resuming with a changed setting (train.resume_mismatch=allow): {d}", flush=True)
        try:
            StepSampler(data.train.shape[0], tr.micro_batch, tr.accum, tr.seed).load_state_dict(
                reader.manifest.get("sampler", {}))
        except ValueError as e:
            raise ConfigError(f"{e}. The checkpoint's run settings are in {resume_dir}/manifest.json ('train'); "
                              "repeat the original run's overrides (data.source, data.seq_len, data.val_fraction, "
                              "train.seed, train.micro_batch, train.accum) together with train.resume") from None
        start_step = reader.step
        if start_step >= tr.steps:
            raise ConfigError(f"checkpoint {resume_dir} is at step {start_step} but train.steps={tr.steps}: "
                              "raise train.steps to continue training")

    # Every check that can reject the job runs before anything is written (checkpoint dir,
    # packed data file, IPC dir, metrics): a rejected job leaves only Hydra's own files.
    job_id = secrets.token_hex(6)
    token = secrets.token_hex(16)
    rt = cfg.runtime
    host = rt.host
    if rt.port:
        check_port(host, rt.port)
    port = rt.port or Endpoint.free_tcp_port(host)
    elem = 2 if prep["dtype"] == "bf16" else 4
    slot_bytes = tr.micro_batch * cfg.data.seq_len * mcfg.hidden_size * elem
    slots = rt.slots or (min(tr.accum, P) + 1)
    # leftovers of jobs whose launcher is gone (kill -9 of a whole process group) free /dev/shm first
    swept = sweep_dead_jobs()
    if swept:
        print(f"removed shared memory and IPC directories of {len(swept)} dead job(s): {', '.join(swept)}", flush=True)
    if P > 1 and rt.transport == "shm":
        need = 2 * (P - 1) * slots * (slot_bytes + 64)
        avail = _shm_free_bytes()
        if avail < need:
            raise ShmTooSmallError(f"npt_{job_id}_*", need, avail)

    os.makedirs(ckpt_root, exist_ok=True)
    for p in remove_stale_staging(ckpt_root):  # only staging dirs of jobs that are gone
        print(f"removed {p}: staging directory of a job that is no longer running", flush=True)
    ipc_dir = tempfile.mkdtemp(prefix=f"npt-{job_id}-")
    os.chmod(ipc_dir, 0o700)
    write_job_owner(job_id, ipc_dir)
    moved = rotate_previous_run(run_dir)
    if moved:
        print(f"note: {run_dir} held the metrics of an earlier launch; moved them to {moved}", flush=True)
    data_file = os.path.join(run_dir, "data.safetensors")
    save_packed(data, data_file)
    threads = prep["threads"]  # the figure the plan used (planner.threads_per_card)
    train = train_spec(cfg, prep["dtype"])
    # no fixed receive / collective timeout: liveness is the coordinator's heartbeat check (issue 12)
    specs = build_worker_specs(plan, prep, train=train, runtime=RuntimeSpec(
        heartbeat_interval_s=float(rt.heartbeat_interval_s), transport=rt.transport, threads=threads),
        job_id=job_id, token=token, data_file=data_file, start_step=start_step, resume_dir=resume_dir,
        ckpt_root=ckpt_root, ipc_dir=ipc_dir, host=host, port=port, slot_bytes=slot_bytes, slots=slots)
    print(plan.table(), flush=True)
    print(f"job {job_id}: {P} card process(es), {mcfg.name}, {data.train.shape[0]} train / {data.val.shape[0]} "
          f"val sequences of {cfg.data.seq_len} tokens, dtype {prep['dtype']}, schedule {tr.schedule}, "
          f"micro-batch {tr.micro_batch} x accumulation {tr.accum}; run dir {run_dir}", flush=True)
    if resume_dir:
        print(f"resuming from {resume_dir} at step {start_step}", flush=True)
    reporter = Reporter(run_dir, tr.steps, predicted_mem=[s.mem["total"] for s in plan.stages],
                        predicted_step_s=plan.step_time_s)
    manifest_base = {"model": mcfg.to_dict(), "world_size": P, "job_id": job_id,
                     "split": [[s.first_layer, s.last_layer] for s in plan.stages],
                     "sampler": StepSampler(data.train.shape[0], tr.micro_batch, tr.accum, tr.seed).state_dict(),
                     "data_fingerprint": data.fingerprint, "train": train.to_dict(),
                     "model_path": prep["model_path"],
                     "tokenizer_path": cfg.model.tokenizer or prep["model_path"]}
    coord = Coordinator(specs, run_dir=run_dir, ipc_dir=ipc_dir, job_id=job_id, token=token,
                        heartbeat_timeout_s=rt.heartbeat_timeout_s, startup_timeout_s=rt.startup_timeout_s,
                        steps=tr.steps, start_step=start_step, ckpt_root=ckpt_root, ckpt_keep=cfg.checkpoint.keep,
                        manifest_base=manifest_base, save_on_interrupt=tr.save_on_interrupt,
                        reporter=reporter, coord_addr=specs[0].coord_addr)
    try:
        coord.run()
    finally:
        reporter.close()
        try:
            os.remove(data_file)
        except OSError:
            pass
    summ = reporter.finish({"checkpoint": coord.last_ckpt, "job_id": job_id, "cards": [c.name for c in prep["cards"]],
                            "predicted_step_s": plan.step_time_s,
                            "predicted_mem_bytes": [s.mem["total"] for s in plan.stages]})
    if coord.rejected:
        print(f"note: ignored {coord.rejected} unauthenticated message(s) on the coordinator socket "
              "(wrong or missing job token)", file=sys.stderr, flush=True)
    if coord.interrupted:
        where = (f"checkpoint {coord.last_ckpt} saved; resume by rerunning the same command with "
                 f"train.resume=latest checkpoint.dir={ckpt_root}") if coord.last_ckpt else "no checkpoint saved"
        raise Interrupted(coord.signum, where)
    skipped = f" ({summ['skipped_steps']} skipped: non-finite)" if summ.get("skipped_steps") else ""
    print(f"done: {summ['steps_run']} steps{skipped}, loss {fmt_loss(summ['first_loss'])} -> "
          f"{fmt_loss(summ['last_loss'])}; "
          f"checkpoint {coord.last_ckpt}; metrics {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)
    return summ
