"""Launcher and coordinator: resolve cards, plan, spawn one process per card, watch, tear down.

The coordinator is not on the per-micro-batch data path: it receives hellos, heartbeats,
per-step metrics, checkpoint reports and errors from the card processes over a ZeroMQ ROUTER
socket (msgpack dicts carrying the job's random token), prints progress, publishes checkpoints
(manifest + atomic rename), and on any failure brings the whole job down:

- a card process that exits non-zero, is killed by a signal, reports an exception, or sends no
  heartbeat for ``runtime.heartbeat_timeout_s`` is named (card, stage, layers, phase, cause);
- every other card process is terminated (SIGTERM, then SIGKILL after a grace period);
- the job's shared-memory segments, IPC sockets and checkpoint staging directories are removed;
- the launcher exits with status 1 (2 for bad input detected before start).
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import msgpack
import zmq

log = logging.getLogger("npu_train")


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bind to port 0 and release)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """Raise :class:`ConfigError` if ``port`` on ``host`` is already taken."""
    from npu_train.config import ConfigError

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"runtime.port={port} on {host} is in use ({e.strerror}): "
                              "pick another runtime.port or use runtime.port=0 for a free one") from None


@dataclass
class RankState:
    rank: int
    card: str
    layers: str
    proc: Optional[mp.Process] = None
    last_seen: float = 0.0
    ready: bool = False
    done: bool = False
    phase: str = "start"
    steps: dict = field(default_factory=dict)


class JobFailed(Exception):
    """The job was brought down; ``str(self)`` names the card, its stage and the cause."""


class Coordinator:
    """Spawns the card processes for ``specs`` and supervises them until done or failed."""

    def __init__(self, specs: list[dict], *, run_dir: str, ipc_dir: str, job_id: str, token: str,
                 heartbeat_timeout_s: float, startup_timeout_s: float, steps: int, start_step: int,
                 ckpt_root: str, ckpt_keep: int, manifest_base: dict, save_on_interrupt: bool,
                 reporter, coord_addr: str):
        self.specs = specs
        self.P = len(specs)
        self.run_dir, self.ipc_dir, self.job_id, self.token = run_dir, ipc_dir, job_id, token
        self.hb_timeout, self.startup_timeout = heartbeat_timeout_s, startup_timeout_s
        self.steps, self.start_step = steps, start_step
        self.ckpt_root, self.ckpt_keep, self.manifest_base = ckpt_root, ckpt_keep, manifest_base
        self.save_on_interrupt = save_on_interrupt
        self.reporter = reporter
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(coord_addr)
        self.ranks = [RankState(s["rank"], s["card"]["name"], s["stage"]["label"]) for s in specs]
        self.ckpt_reports: dict[int, dict[int, str]] = {}
        self.interrupted = 0
        self.stop_sent_at: Optional[float] = None
        self.last_ckpt: Optional[str] = None
        self.rejected = 0

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        ctx = mp.get_context("spawn")
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in old:
            signal.signal(s, self._on_signal)
        try:
            now = time.monotonic()
            for spec, rs in zip(self.specs, self.ranks):
                rs.proc = ctx.Process(target=_worker_entry, args=(spec,), name=f"npu-train-{rs.card}", daemon=False)
                rs.proc.start()
                rs.last_seen = now
            self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.teardown()

    def _on_signal(self, signum, frame) -> None:
        self.interrupted += 1

    def _describe(self, rs: RankState) -> str:
        return f"card {rs.card} (stage {rs.rank}, layers {rs.layers})"

    def _fail(self, rs: RankState, cause: str) -> None:
        raise JobFailed(f"{self._describe(rs)} failed during {rs.phase}: {cause}")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while True:
            for _ in range(256):
                if not poller.poll(0 if _ else 200):
                    break
                self._handle(self.sock.recv_multipart())
            now = time.monotonic()
            if all(rs.done for rs in self.ranks):
                for rs in self.ranks:
                    rs.proc.join(timeout=30)
                return
            if self.interrupted:
                self._handle_interrupt(now)
            for rs in self.ranks:
                code = rs.proc.exitcode
                if code is not None and not (rs.done and code == 0):
                    # drain pending messages first: an error report explains the exit better
                    while poller.poll(50):
                        self._handle(self.sock.recv_multipart())
                    if rs.done and code == 0:
                        continue
                    self._fail(rs, _exit_cause(code))
                limit = self.hb_timeout if rs.ready else max(self.hb_timeout, self.startup_timeout)
                if code is None and now - rs.last_seen > limit:
                    self._fail(rs, f"stopped responding: no heartbeat for {now - rs.last_seen:.0f} s "
                                   f"(runtime.heartbeat_timeout_s={self.hb_timeout:g}; process {rs.proc.pid} hung or stopped)")

    def _handle_interrupt(self, now: float) -> None:
        started = all(rs.ready for rs in self.ranks)
        if self.interrupted >= 2 or not started or not self.save_on_interrupt:
            raise KeyboardInterrupt
        if self.stop_sent_at is None:
            print("\ninterrupt: finishing the current step and saving a checkpoint (Ctrl-C again to abort)",
                  file=sys.stderr, flush=True)
            for rs in self.ranks:
                self._send(rs.rank, {"type": "stop"})
            self.stop_sent_at = now
        elif now - self.stop_sent_at > max(60.0, self.hb_timeout):
            raise KeyboardInterrupt

    def _send(self, rank: int, msg: dict) -> None:
        self.sock.send_multipart([f"w{rank}".encode(), msgpack.packb(dict(msg, tok=self.token), use_bin_type=True)])

    def _handle(self, frames: list[bytes]) -> None:
        try:
            msg = msgpack.unpackb(frames[-1], raw=False)
            ok = isinstance(msg, dict) and msg.get("tok") == self.token and 0 <= int(msg.get("rank", -1)) < self.P
        except Exception:
            ok = False
        if not ok:
            self.rejected += 1
            log.warning("coordinator: ignored a message from an unauthenticated peer")
            return
        rs = self.ranks[int(msg["rank"])]
        rs.last_seen = time.monotonic()
        t = msg.get("type")
        if t == "hb":
            return
        if t == "hello":
            rs.phase = "model load"
        elif t == "ready":
            rs.ready = True
            rs.phase = "training"
        elif t == "step":
            s = int(msg["step"])
            rs.phase = f"step {s + 1}"
            rs.steps[s] = msg
            if all(s in r.steps for r in self.ranks):
                self.reporter.step([r.steps.pop(s) for r in self.ranks])
        elif t == "ckpt":
            s = int(msg["step"])
            rep = self.ckpt_reports.setdefault(s, {})
            rep[rs.rank] = msg["staging"]
            if len(rep) == self.P:
                self._publish(s, rep[0])
        elif t in ("done", "stopped"):
            if t == "done":
                rs.done = True
            rs.phase = "shutdown"
        elif t == "error":
            rs.phase = msg.get("phase", rs.phase)
            with open(os.path.join(self.run_dir, f"card{rs.rank}.traceback.txt"), "w") as f:
                f.write(msg.get("traceback", ""))
            self._fail(rs, f"{msg.get('etype')}: {msg.get('message')} "
                           f"(traceback: {os.path.join(self.run_dir, f'card{rs.rank}.traceback.txt')})")

    def _publish(self, step: int, staging: str) -> None:
        from npu_train.checkpoint.store import finalize

        t0 = time.perf_counter()
        final = finalize(self.ckpt_root, staging, step, self.manifest_base, keep=self.ckpt_keep)
        self.last_ckpt = final
        self.reporter.note(f"checkpoint step {step} saved to {final} ({time.perf_counter() - t0:.1f} s to publish)")

    def teardown(self) -> None:
        """Stop every card process, remove shared memory, sockets and this job's staging dirs."""
        from npu_train.transport.shm import unlink_job_segments

        alive = [rs.proc for rs in self.ranks if rs.proc is not None and rs.proc.is_alive()]
        for p in alive:
            try:
                os.kill(p.pid, signal.SIGCONT)  # a SIGSTOPped process must run to die from SIGTERM
                p.terminate()
            except (ProcessLookupError, OSError):
                pass
        deadline = time.monotonic() + 3.0
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        unlink_job_segments(self.job_id)
        self.sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if os.path.isdir(self.ckpt_root):
            for fn in os.listdir(self.ckpt_root):
                if fn.startswith(".tmp-") and fn.endswith(self.job_id):
                    shutil.rmtree(os.path.join(self.ckpt_root, fn), ignore_errors=True)


def _worker_entry(spec: dict) -> None:
    from npu_train.runtime.worker import worker_main

    worker_main(spec)


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"process killed by signal {name}"
    return f"process exited with status {code}"


# ============================================================================ job preparation
def user_error_types() -> tuple:
    """Exception classes that mean 'bad input': printed as one line, exit status 2."""
    from npu_train.backends.base import BackendUnavailableError
    from npu_train.backends.spec import BackendSpecError
    from npu_train.config import UserError
    from npu_train.data.text import DataError
    from npu_train.model.loading import ModelFormatError
    from npu_train.optim.placement import PlacementError
    from npu_train.transport.shm import ShmTooSmallError

    return (UserError, BackendSpecError, BackendUnavailableError, DataError, ModelFormatError,
            PlacementError, ShmTooSmallError, FileNotFoundError)


def _as_list(v):
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
    ``shape``, ``dtype`` and ``model_path``. Raises one of :func:`user_error_types` on bad input.
    """
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import ConfigError, compute_dtype, validate
    from npu_train.model.loading import load_config, resolve_model_path
    from npu_train.optim.placement import CardSpec, RunShape, default_capacity, load_rates, make_plan

    validate(cfg)
    reqs = resolve_cards(parse_backend_list(_as_list(cfg.backend)), probe=probe)
    mcfg, model_path = _preset_config(cfg.model.path), None
    if mcfg is None:
        model_path = resolve_model_path(cfg.model.path)
        mcfg = load_config(model_path)
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
    rates = [load_rates(r.kind, cfg.placement.profile) for r in reqs]
    resident = _as_list(tr.resident_layers)
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
    plan = make_plan(mcfg, shape, cards, rates, split=_as_list(tr.split), resident_layers=resident,
                     host_ram_bytes=None if cfg.plan else host_ram)
    return {"cards": cards, "requests": reqs, "model_cfg": mcfg, "plan": plan, "shape": shape,
            "dtype": dtype, "model_path": model_path}


def _preset_config(path: str):
    """The preset's LlamaConfig when ``path`` names a preset (and no such file exists), else None."""
    from npu_train.model.presets import get_preset

    if os.path.exists(os.path.expanduser(path)) or path in ("embedded", "smollm2"):
        return None
    try:
        return get_preset(path)
    except KeyError:
        return None


def resident_param_names(model_cfg, stage) -> list[str]:
    """HF names of a stage's parameters that are resident (master + moments on the card).

    Decoder layers follow the plan; the embedding, final norm and LM head are resident exactly
    when every decoder layer of the stage is resident (as the placement model assumes).
    """
    names = []
    for i in stage.resident:
        names += model_cfg.layer_param_names(i)
    all_res = len(stage.resident) == stage.last_layer - stage.first_layer
    if all_res:
        if stage.has_embed:
            names.append("model.embed_tokens.weight")
        if stage.has_head:
            names += ["model.norm.weight", "lm_head.weight"]
    return names


def prepare_data(cfg, model_path: str, model_cfg, run_dir: str):
    """Tokenize and pack the dataset once (cached under ``~/.cache/npu-train/data``) and return it."""
    from npu_train.data.dataset import build_packed_data
    from npu_train.model.loading import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path)
    cache = os.path.join(os.path.expanduser("~"), ".cache", "npu-train", "data")
    return build_packed_data(cfg.data.source, tok, cfg.data.seq_len, cfg.data.val_fraction,
                             eos_id=model_cfg.eos_token_id, cache_dir=cache, vocab_size=model_cfg.vocab_size)


def layers_label(st) -> str:
    s = f"{st.first_layer}-{st.last_layer - 1}" if st.last_layer > st.first_layer else "none"
    if st.has_embed:
        s += " +emb"
    if st.has_head:
        s += " +head"
    return s


def run_job(cfg, run_dir: str) -> dict:
    """Run one training job described by ``cfg`` (an OmegaConf ``Config``) in ``run_dir``.

    Returns the run summary dict. Raises a user error (exit 2) for bad input, :class:`JobFailed`
    (exit 1) when a card process fails.
    """
    from npu_train.checkpoint.store import CheckpointReader, find_checkpoint, remove_stale_staging
    from npu_train.config import ConfigError
    from npu_train.data.dataset import save_packed
    from npu_train.data.sampler import StepSampler
    from npu_train.metrics.report import Reporter
    from npu_train.transport.shm import ShmTooSmallError, shm_free_bytes

    os.makedirs(run_dir, exist_ok=True)
    if cfg.plan:
        prep = prepare(cfg, run_dir, probe=False)
        print(prep["plan"].table())
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
        StepSampler(data.train.shape[0], tr.micro_batch, tr.accum, tr.seed).load_state_dict(
            reader.manifest.get("sampler", {}))
        start_step = reader.step
        if start_step >= tr.steps:
            raise ConfigError(f"checkpoint {resume_dir} is at step {start_step} but train.steps={tr.steps}: "
                              "raise train.steps to continue training")
    os.makedirs(ckpt_root, exist_ok=True)
    remove_stale_staging(ckpt_root)

    job_id = secrets.token_hex(6)
    token = secrets.token_hex(16)
    ipc_dir = tempfile.mkdtemp(prefix=f"npt-{job_id}-")
    os.chmod(ipc_dir, 0o700)
    data_file = os.path.join(run_dir, "data.safetensors")
    save_packed(data, data_file)
    rt = cfg.runtime
    host = rt.host
    if rt.port:
        check_port(host, rt.port)
    port = rt.port or free_port(host)
    elem = 2 if prep["dtype"] == "bf16" else 4
    slot_bytes = tr.micro_batch * cfg.data.seq_len * mcfg.hidden_size * elem
    slots = rt.slots or (min(tr.accum, P) + 1)
    if P > 1 and rt.transport == "shm":
        need = 2 * (P - 1) * slots * (slot_bytes + 64)
        avail = shm_free_bytes()
        if avail < need:
            raise ShmTooSmallError(f"npt_{job_id}_*", need, avail)
    threads = rt.threads or max(1, (os.cpu_count() or 1) // max(1, sum(1 for c in prep["cards"] if c.kind == "cpu") or 1))
    if rt.transport == "shm":
        inbox = [f"ipc://{ipc_dir}/r{r}.sock" for r in range(P)]
        coord_addr = f"ipc://{ipc_dir}/coord.sock"
    else:
        inbox = [f"tcp://{host}:{free_port(host)}" for _ in range(P)]
        coord_addr = f"tcp://{host}:{free_port(host)}"
    train_d = {k: getattr(tr, k) for k in ("steps", "micro_batch", "accum", "lr", "min_lr_ratio", "warmup_steps",
                                           "weight_decay", "beta1", "beta2", "eps", "clip", "schedule",
                                           "recompute", "seed", "save_every", "save_on_interrupt")}
    train_d["dtype"] = prep["dtype"]
    specs = []
    for r, st in enumerate(plan.stages):
        card = prep["cards"][r]
        specs.append({
            "rank": r, "world_size": P, "job_id": job_id, "token": token, "parent_pid": os.getpid(),
            "card": {"kind": card.kind, "index": card.index, "name": card.name},
            "model_path": prep["model_path"], "model_cfg": mcfg.to_dict(),
            "stage": {"first": st.first_layer, "last": st.last_layer, "has_embed": st.has_embed,
                      "has_head": st.has_head, "label": layers_label(st)},
            "resident_names": resident_param_names(mcfg, st),
            "data_file": data_file, "train": train_d, "start_step": start_step, "resume_dir": resume_dir,
            "ckpt_root": ckpt_root, "coord_addr": coord_addr, "inbox": inbox,
            "slot_bytes": slot_bytes, "slots": slots, "dist_init": f"tcp://{host}:{port}",
            "runtime": {"heartbeat_interval_s": rt.heartbeat_interval_s, "transport": rt.transport,
                        "threads": threads, "recv_timeout_s": max(120.0, 2 * rt.heartbeat_timeout_s),
                        "collective_timeout_s": max(120.0, 2 * rt.heartbeat_timeout_s)},
        })
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
                     "data_fingerprint": data.fingerprint, "train": train_d,
                     "model_path": prep["model_path"],
                     "tokenizer_path": cfg.model.tokenizer or prep["model_path"]}
    coord = Coordinator(specs, run_dir=run_dir, ipc_dir=ipc_dir, job_id=job_id, token=token,
                        heartbeat_timeout_s=rt.heartbeat_timeout_s, startup_timeout_s=rt.startup_timeout_s,
                        steps=tr.steps, start_step=start_step, ckpt_root=ckpt_root, ckpt_keep=cfg.checkpoint.keep,
                        manifest_base=manifest_base, save_on_interrupt=tr.save_on_interrupt,
                        reporter=reporter, coord_addr=coord_addr)
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
    if coord.interrupted:
        raise KeyboardInterrupt
    print(f"done: {summ['steps_run']} steps, loss {summ['first_loss']:.4f} -> {summ['last_loss']:.4f}; "
          f"checkpoint {coord.last_ckpt}; metrics {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)
    return summ


def main(cfg, run_dir: str) -> int:
    """CLI body: run the job, map errors to exit codes (0 ok, 1 job failure, 2 bad input, 130 interrupt)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        run_job(cfg, run_dir)
        return 0
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: all card processes stopped", file=sys.stderr, flush=True)
        return 130
    except user_error_types() as e:
        msg = str(e)
        if isinstance(e, FileNotFoundError) and e.filename and msg.startswith("[Errno"):
            msg = f"file not found: {e.filename}"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2
