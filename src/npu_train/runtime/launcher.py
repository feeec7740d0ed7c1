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

When several card processes fail together (one is killed, its neighbours then see broken
collectives), the coordinator names the root cause: a process that died without reporting
(killed by a signal, exited silently) or stopped answering beats one that reported an error,
and among reported errors the first one received wins (after a short grace period, so that a
peer's death that caused the error is seen first).

SIGINT/SIGTERM (Ctrl-C, ``kubectl delete``): with ``train.save_on_interrupt`` the card processes
finish the current step, agree on it through the all-reduce stop flag and save a checkpoint; the
launcher then exits 128 + signal number (130 / 143). A second signal aborts at once.

If the launcher itself is killed (``kill -9``), every card process notices within a heartbeat
interval that its parent changed, removes the job's ``/dev/shm/npt_<job_id>_*`` segments and IPC
directory, and exits. Only if the launcher and all card processes die at once (``kill -9`` of
the whole process group, the OOM killer) can segments remain; the next launch does not remove
other jobs' segments (it cannot tell a dead job from a live one in another PID namespace), so
remove them with ``rm /dev/shm/npt_<job_id>_*`` (the job id is printed at start and is in
``job.json``).

While a job runs, ``<run_dir>/job.json`` describes it (job id, launcher and card process ids,
socket addresses, shared-memory prefix; never the token) for tools and tests.
"""
from __future__ import annotations

import hmac
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

from npu_train.transport.channel import Endpoint

log = logging.getLogger("npu_train")


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
    error: Optional[str] = None       # cause reported by the card process itself
    error_at: float = 0.0             # when the report arrived (monotonic)


class JobFailed(Exception):
    """The job was brought down; ``str(self)`` names the card, its stage and the cause."""


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped the job; ``signum`` gives the exit status 128 + signum."""

    def __init__(self, signum: int = signal.SIGINT, message: str = ""):
        super().__init__(message)
        self.signum = int(signum)
        self.message = message


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
        self.signum = int(signal.SIGINT)  # the last signal received (exit status 128 + signum)
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
            self._write_job_file()
            self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.teardown()

    #: after the first error report, wait this long for a peer's death to show (root cause)
    ERROR_GRACE_S = 0.5

    def _on_signal(self, signum, frame) -> None:
        self.interrupted += 1
        self.signum = int(signum)

    def _write_job_file(self) -> None:
        """``<run_dir>/job.json``: ids, pids and addresses of this job (no token), written atomically."""
        info = {
            "job_id": self.job_id, "launcher_pid": os.getpid(), "run_dir": self.run_dir,
            "ipc_dir": self.ipc_dir, "coord_addr": self.specs[0]["coord_addr"],
            "transport": self.specs[0]["runtime"]["transport"], "shm_prefix": f"npt_{self.job_id}_",
            "ckpt_root": self.ckpt_root,
            "cards": [{"rank": rs.rank, "card": rs.card, "layers": rs.layers, "pid": rs.proc.pid,
                       "inbox": spec["inbox"][rs.rank] if self.P > 1 else None}
                      for rs, spec in zip(self.ranks, self.specs)],
        }
        path = os.path.join(self.run_dir, "job.json")
        with open(path + ".part", "w") as f:
            json.dump(info, f, indent=1)
        os.replace(path + ".part", path)

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
            self._check_failures(poller, now)

    def _check_failures(self, poller, now: float) -> None:
        """Raise :class:`JobFailed` naming the root cause if any card process failed."""
        codes = {rs.rank: rs.proc.exitcode for rs in self.ranks}
        if any(c is not None and not (self.ranks[r].done and c == 0) for r, c in codes.items()):
            # drain pending messages first: an error report explains an exit better than its status
            while poller.poll(50):
                self._handle(self.sock.recv_multipart())
        primary = []  # died without a report (signal, silent exit) or hung: a root cause
        for rs in self.ranks:
            code = codes[rs.rank]
            if code is not None and not (rs.done and code == 0) and rs.error is None:
                primary.append((rs, _exit_cause(code)))
            limit = self.hb_timeout if rs.ready else max(self.hb_timeout, self.startup_timeout)
            if code is None and now - rs.last_seen > limit:
                primary.append((rs, f"stopped responding: no heartbeat for {now - rs.last_seen:.0f} s "
                                    f"(runtime.heartbeat_timeout_s={self.hb_timeout:g}; process {rs.proc.pid} "
                                    f"hung or stopped)"))
        if primary:
            self._fail(*primary[0])
        reported = sorted((rs for rs in self.ranks if rs.error is not None), key=lambda r: r.error_at)
        if reported:
            settled = all(rs.error is not None or codes[rs.rank] is not None for rs in self.ranks)
            if settled or now - reported[0].error_at >= self.ERROR_GRACE_S:
                self._fail(reported[0], reported[0].error)

    def _handle_interrupt(self, now: float) -> None:
        started = all(rs.ready for rs in self.ranks)
        if self.interrupted >= 2 or not started or not self.save_on_interrupt:
            raise Interrupted(self.signum)
        if self.stop_sent_at is None:
            print(f"\ninterrupt ({signal.Signals(self.signum).name}): finishing the current step and saving a "
                  "checkpoint (Ctrl-C again to abort)", file=sys.stderr, flush=True)
            for rs in self.ranks:
                self._send(rs.rank, {"type": "stop"})
            self.stop_sent_at = now
        elif now - self.stop_sent_at > max(60.0, self.hb_timeout):
            raise Interrupted(self.signum)

    def _send(self, rank: int, msg: dict) -> None:
        self.sock.send_multipart([f"w{rank}".encode(), msgpack.packb(dict(msg, tok=self.token), use_bin_type=True)])

    def _handle(self, frames: list[bytes]) -> None:
        try:
            # never unpickled: msgpack only, and a size limit keeps strangers from exhausting memory
            if len(frames) != 2 or len(frames[-1]) > 1 << 20:
                raise ValueError("unexpected frames")
            msg = msgpack.unpackb(frames[-1], raw=False)
            tok = msg.get("tok") if isinstance(msg, dict) else None
            ok = (isinstance(tok, str) and hmac.compare_digest(tok.encode(), self.token.encode())
                  and 0 <= int(msg.get("rank", -1)) < self.P)
        except Exception:
            ok = False
        if not ok:
            self.rejected += 1
            if self.rejected <= 20 or self.rejected % 1000 == 0:
                log.warning("coordinator: ignored a message from an unauthenticated peer "
                            "(%d so far; wrong or missing job token, or not msgpack)", self.rejected)
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
            rs.phase = f"step {self.start_step + 1}"
        elif t == "phase":
            rs.phase = str(msg.get("phase", rs.phase))
        elif t == "step":
            s = int(msg["step"])
            rs.phase = f"step {s + 1}"
            rs.steps[s] = msg
            if all(s in r.steps for r in self.ranks):
                self.reporter.step([r.steps.pop(s) for r in self.ranks])
        elif t == "eval":
            self.reporter.eval(int(msg["step"]), float(msg["val_loss"]), int(msg["tokens"]))
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
            if rs.error is None:  # decided in _check_failures: a peer's death may be the root cause
                rs.error = (f"{msg.get('etype')}: {msg.get('message')} "
                            f"(traceback: {os.path.join(self.run_dir, f'card{rs.rank}.traceback.txt')})")
                rs.error_at = time.monotonic()

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
        # Card processes ignore SIGINT/SIGTERM (a signal to the whole process group, e.g. from
        # `timeout` or Slurm, must reach only the launcher, which stops them after a checkpoint),
        # and they hold nothing that needs flushing (checkpoints are published atomically by the
        # coordinator), so teardown kills them outright.
        for p in alive:
            try:
                p.kill()
                os.kill(p.pid, signal.SIGCONT)  # a SIGSTOPped process is reaped promptly too
            except (ProcessLookupError, OSError):
                pass
        for p in alive:
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

    override = os.environ.get("NPT_SHM_FREE_BYTES")
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
    """Tokenize and pack the dataset once (cached under ``~/.cache/npu-train/data``) and return it."""
    from npu_train.data.prepare import prepare_data as prepare_job_data
    return prepare_job_data(cfg, model_path, model_cfg)


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
    from npu_train.transport.shm import ShmTooSmallError

    os.makedirs(run_dir, exist_ok=True)
    if cfg.calibrate:
        from npu_train.backends.spec import parse_backend_list, resolve_cards
        from npu_train.optim.calibrate import main_calibrate

        reqs = resolve_cards(parse_backend_list(_as_list(cfg.backend)))
        kinds = [r.kind if r.index is None else f"{r.kind}:{r.index}" for r in reqs]
        saved = main_calibrate(kinds, model_path=cfg.model.path if _preset_config(cfg.model.path) is None else None,
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
    if P > 1 and rt.transport == "shm":
        need = 2 * (P - 1) * slots * (slot_bytes + 64)
        avail = _shm_free_bytes()
        if avail < need:
            raise ShmTooSmallError(f"npt_{job_id}_*", need, avail)

    os.makedirs(ckpt_root, exist_ok=True)
    remove_stale_staging(ckpt_root)
    ipc_dir = tempfile.mkdtemp(prefix=f"npt-{job_id}-")
    os.chmod(ipc_dir, 0o700)
    data_file = os.path.join(run_dir, "data.safetensors")
    save_packed(data, data_file)
    threads = rt.threads or max(1, (os.cpu_count() or 1) // max(1, sum(1 for c in prep["cards"] if c.kind == "cpu") or 1))
    if rt.transport == "shm":
        inbox = [f"ipc://{ipc_dir}/r{r}.sock" for r in range(P)]
        coord_addr = f"ipc://{ipc_dir}/coord.sock"
    else:
        inbox = [f"tcp://{host}:{Endpoint.free_tcp_port(host)}" for _ in range(P)]
        coord_addr = f"tcp://{host}:{Endpoint.free_tcp_port(host)}"
    train_d = {k: getattr(tr, k) for k in ("steps", "micro_batch", "accum", "lr", "min_lr_ratio", "warmup_steps",
                                           "weight_decay", "beta1", "beta2", "eps", "clip", "schedule",
                                           "recompute", "seed", "save_every", "save_on_interrupt", "stop_after")}
    train_d["dtype"] = prep["dtype"]
    train_d["eval_every"], train_d["eval_batches"] = cfg.data.eval_every, cfg.data.eval_batches
    specs = []
    for r, st in enumerate(plan.stages):
        card = prep["cards"][r]
        specs.append({
            "rank": r, "world_size": P, "job_id": job_id, "token": token, "parent_pid": os.getpid(),
            "card": {"kind": card.kind, "index": card.index, "name": card.name},
            "model_path": prep["model_path"], "model_cfg": mcfg.to_dict(),
            "stage": {"first": st.first_layer, "last": st.last_layer, "has_embed": st.has_embed,
                      "has_head": st.has_head, "label": st.layers_label},
            "resident_names": resident_param_names(mcfg, st),
            "data_file": data_file, "train": train_d, "start_step": start_step, "resume_dir": resume_dir,
            "ckpt_root": ckpt_root, "coord_addr": coord_addr, "inbox": inbox, "ipc_dir": ipc_dir,
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
    if coord.rejected:
        print(f"note: ignored {coord.rejected} unauthenticated message(s) on the coordinator socket "
              "(wrong or missing job token)", file=sys.stderr, flush=True)
    if coord.interrupted:
        where = (f"checkpoint {coord.last_ckpt} saved; resume by rerunning the same command with "
                 f"train.resume=latest checkpoint.dir={ckpt_root}") if coord.last_ckpt else "no checkpoint saved"
        raise Interrupted(coord.signum, where)
    print(f"done: {summ['steps_run']} steps, loss {summ['first_loss']:.4f} -> {summ['last_loss']:.4f}; "
          f"checkpoint {coord.last_ckpt}; metrics {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)
    return summ


def main(cfg, run_dir: str) -> int:
    """CLI body: run the job, map errors to exit codes (0 ok, 1 job failure, 2 bad input, 130/143 SIGINT/SIGTERM)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        run_job(cfg, run_dir)
        return 0
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C (130) or SIGTERM (143), see Interrupted
        signum = getattr(e, "signum", int(signal.SIGINT))
        extra = getattr(e, "message", "")
        print(f"interrupted by {signal.Signals(signum).name}: all card processes stopped"
              + (f"; {extra}" if extra else ""), file=sys.stderr, flush=True)
        return 128 + signum
    except user_error_types() as e:
        msg = str(e)
        if isinstance(e, FileNotFoundError) and e.filename and msg.startswith("[Errno"):
            msg = f"file not found: {e.filename}"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2
