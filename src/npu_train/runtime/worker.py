"""Card process main: one pipeline stage on one card.

Started by the launcher with the ``spawn`` start method (``worker_main(spec)``). The worker

1. sets up its backend (device context, memory-type flag probe) before any device call,
2. connects to the coordinator's control socket (hello, heartbeats from a separate thread,
   per-step metrics, checkpoint reports, errors),
3. builds its :class:`StageModule` on the meta device and loads only its own tensors,
4. joins the gloo process group (global grad norm, loss, stop flag, tied-embedding gradients),
5. opens its stage-boundary links (shared-memory slot rings + ZeroMQ/msgpack headers),
6. runs ``train.steps`` optimizer steps with the chosen schedule, saving shards when asked.

Any exception is reported to the coordinator (type, message, traceback) before exiting with
status 1; the coordinator then brings the whole job down. If the launcher dies (even ``kill -9``),
the heartbeat thread notices that the parent process changed, removes the job's shared-memory
segments and IPC directory, and exits (status 3) instead of lingering as an orphan.

Test-only fault injection
=========================
``NPT_FAULT`` (environment variable, inherited by the spawned card processes) makes one card
process fail at a precise point, so the tests in ``tests/integration/test_faults.py`` can hit
every phase of a step. It is read once at start-up and does nothing when unset; it is not a
user feature. Format: comma-separated ``key=value`` pairs::

    NPT_FAULT="rank=1,phase=backward,step=2,action=kill"

- ``rank``: the stage/card process that fails (0-based);
- ``step``: the 1-based optimizer step (as printed: ``step 2/N``), default 1;
- ``phase``: ``forward`` (first stage forward of the step), ``backward`` (first gradient of
  the stage's first parameter), ``collective`` (just before the step's gloo all-reduce),
  ``optimizer`` (just before the AdamW update), ``checkpoint`` (after this stage wrote its
  shard into the staging directory, before reporting it);
- ``action``: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: a hung process), ``raise``
  (RuntimeError), ``sleep:S`` (sleep S seconds, then continue normally).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import msgpack
import torch
import zmq

log = logging.getLogger("npu_train.worker")


# ---------------------------------------------------------------------------- fault injection (tests)
_FAULT_PHASES = ("forward", "backward", "collective", "optimizer", "checkpoint")


class FaultHook:
    """Test-only: fires the ``NPT_FAULT`` action once at (rank, phase, step); see the module docstring."""

    def __init__(self, text: str, rank: int):
        kv = dict(p.split("=", 1) for p in text.replace(" ", "").split(",") if p)
        self.active = int(kv.get("rank", 0)) == rank
        self.phase = kv.get("phase", "forward")
        self.step = int(kv.get("step", 1))
        self.action = kv.get("action", "kill")
        if self.phase not in _FAULT_PHASES:
            raise ValueError(f"NPT_FAULT: phase={self.phase!r}, use one of {_FAULT_PHASES}")
        self.current_step = 0  # 1-based step being run, set by the training loop
        self.fired = False

    @classmethod
    def from_env(cls, rank: int) -> "FaultHook | None":
        text = os.environ.get("NPT_FAULT", "")
        return cls(text, rank) if text else None

    def __call__(self, phase: str) -> None:
        if not self.active or self.fired or phase != self.phase or self.current_step != self.step:
            return
        self.fired = True
        log.warning("NPT_FAULT: %s at step %d %s", self.action, self.step, phase)
        sys.stderr.flush()
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "raise":
            raise RuntimeError(f"NPT_FAULT: injected failure at step {self.step} {phase}")
        elif self.action.startswith("sleep:"):
            time.sleep(float(self.action.split(":", 1)[1]))
        else:
            raise ValueError(f"NPT_FAULT: unknown action {self.action!r}")

    def install(self, module) -> None:
        """Forward pre-hook on the stage module and a gradient hook on its first parameter."""
        if not self.active:
            return
        module.register_forward_pre_hook(lambda *_: self("forward"))
        first = next(iter(module.parameters()))

        def on_grad(g):
            self("backward")
            return g

        first.register_hook(on_grad)


# ---------------------------------------------------------------------------- control plane
class Control:
    """Worker side of the coordinator channel: DEALER socket, msgpack dicts carrying the job token."""

    def __init__(self, ctx: zmq.Context, addr: str, token: str, rank: int):
        self.token, self.rank = token, rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(addr)

    def send(self, type_: str, **kw) -> None:
        self.sock.send(msgpack.packb({"tok": self.token, "rank": self.rank, "type": type_, **kw}, use_bin_type=True))

    def poll_stop(self) -> bool:
        """Non-blocking: True if the coordinator asked this worker to stop after the current step."""
        stop = False
        while self.sock.poll(0):
            try:
                msg = msgpack.unpackb(self.sock.recv(), raw=False)
            except Exception:
                continue
            if isinstance(msg, dict) and msg.get("tok") == self.token and msg.get("type") == "stop":
                stop = True
        return stop


def _cleanup_orphaned_job(job_id: str, ipc_dir: str) -> None:
    """The launcher is gone (e.g. ``kill -9``): remove what it would have removed at teardown.

    Every card process does this (idempotent, races are harmless): the job's ``/dev/shm``
    segments (peers that still map one keep their mapping) and the private IPC socket directory.
    """
    import shutil

    from npu_train.transport.shm import unlink_job_segments

    try:
        unlink_job_segments(job_id)
    except Exception:
        pass
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _heartbeat_loop(ctx, addr, token, rank, interval, stop_evt, parent_pid, job_id, ipc_dir):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"hb{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    payload = msgpack.packb({"tok": token, "rank": rank, "type": "hb"}, use_bin_type=True)
    while not stop_evt.wait(interval):
        if os.getppid() != parent_pid:  # launcher died: do not linger as an orphan
            _cleanup_orphaned_job(job_id, ipc_dir)
            os._exit(3)
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


# ---------------------------------------------------------------------------- boundary comm
class LinkComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over the shared-memory/ZeroMQ transport.

    Links per boundary ``r|r+1``: ``act<r>`` (r -> r+1) and ``grad<r+1>`` (r+1 -> r); each is
    created (shared-memory ring owned) by its sender in the constructor; receivers attach on
    first use, after the start-up barrier.
    """

    def __init__(self, spec: dict, ctx: zmq.Context, backend):
        from npu_train.transport import Mailbox, Outbox, TensorLink

        self.rank, self.P = r, P = spec["rank"], spec["world_size"]
        rt = spec["runtime"]
        self.timeout = float(rt["recv_timeout_s"])
        self.backend = backend
        mode, job, nb, k = rt["transport"], spec["job_id"], spec["slot_bytes"], spec["slots"]
        self.mailbox = Mailbox(ctx, spec["inbox"][r], spec["token"], logger=log,
                               max_msg_bytes=nb + 65536 if mode == "inline" else None)
        self.out = {p: Outbox(ctx, spec["inbox"][p], spec["token"], r) for p in (r - 1, r + 1) if 0 <= p < P}
        self.act_out = TensorLink(mode, job, f"act{r}", nb, k).open_sender() if r < P - 1 else None
        self.grad_out = TensorLink(mode, job, f"grad{r}", nb, k).open_sender() if r > 0 else None
        self.act_in = TensorLink(mode, job, f"act{r - 1}", nb, k) if r > 0 else None
        self.grad_in = TensorLink(mode, job, f"grad{r + 1}", nb, k) if r < P - 1 else None

    def recv_act(self, step, micro):
        return self.act_in.recv("act", step, micro, self.mailbox, self.out[self.rank - 1], self.timeout,
                                device=self.backend.device())

    def send_act(self, step, micro, t):
        self.act_out.send(t, "act", step, micro, self.out[self.rank + 1], self.mailbox, self.timeout)

    def recv_grad(self, step, micro):
        return self.grad_in.recv("grad", step, micro, self.mailbox, self.out[self.rank + 1], self.timeout,
                                 device=self.backend.device())

    def send_grad(self, step, micro, t):
        self.grad_out.send(t, "grad", step, micro, self.out[self.rank - 1], self.mailbox, self.timeout)

    def close(self) -> None:
        for l in (self.act_out, self.grad_out, self.act_in, self.grad_in):
            if l is not None:
                l.close()
        self.mailbox.close()
        for o in self.out.values():
            o.close()


# ---------------------------------------------------------------------------- helpers
def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def build_stage(spec: dict, backend, dtype: torch.dtype):
    """Build this stage's module on the card and its fp32 masters from the model file (own tensors only).

    Returns ``(module, masters)`` where masters maps HF names to fp32 CPU tensors.
    """
    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import StageModule
    from npu_train.model.loading import load_tensors

    cfg = LlamaConfig.from_dict(spec["model_cfg"])
    st = spec["stage"]
    with torch.device("meta"):
        module = StageModule(cfg, st["first"], st["last"], st["has_embed"], st["has_head"],
                             recompute=spec["train"]["recompute"])
    module = module.to(dtype)
    with backend.alloc_lock():
        module = module.to_empty(device=backend.device())
    if st["has_embed"] and st["has_head"] and cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight  # to_empty breaks parameter sharing
    track = getattr(backend, "track", None)  # furiosa: no allocator stats, count our own tensors
    if track is not None:
        for p in module.parameters():
            track(p)
    names = module.param_names()
    masters = load_tensors(spec["model_path"], cfg, names)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(backend.upload(masters[n].to(dtype)))
    return module, masters


def worker_main(spec: dict) -> None:
    """Entry point of a card process (``multiprocessing`` spawn target). Never returns normally on error."""
    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, format=f"[card {spec['card']['name']} stage {rank}] %(message)s")
    # The launcher decides what Ctrl-C / SIGTERM mean (finish the step, checkpoint, stop). A signal
    # sent to the whole process group (timeout, Slurm, a terminal) must not kill the card processes
    # first; the coordinator stops them with SIGKILL at teardown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(1, int(spec["runtime"]["threads"])))
    ctx = zmq.Context()
    ctrl = Control(ctx, spec["coord_addr"], spec["token"], rank)
    hb_stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, daemon=True,
                          args=(ctx, spec["coord_addr"], spec["token"], rank,
                                float(spec["runtime"]["heartbeat_interval_s"]), hb_stop, spec["parent_pid"],
                                spec["job_id"], spec.get("ipc_dir")))
    hb.start()
    phase = ["start"]
    try:
        ctrl.send("hello", pid=os.getpid())
        _train(spec, ctx, ctrl, phase)
        ctrl.send("done")
        code = 0
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
        try:
            ctrl.send("error", phase=phase[0], etype=type(e).__name__, message=str(e)[:2000],
                      traceback=traceback.format_exc()[-8000:], user=bool(getattr(e, "user_error", False)))
        except Exception:
            pass
        code = 1
    hb_stop.set()
    hb.join(timeout=5)
    try:
        # deliver queued messages (the final "done"/"error") before exiting: up to 2 s
        ctx.destroy(linger=2000)
    finally:
        # Skip interpreter teardown (gloo/zmq destructors can block on dead peers).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _train(spec: dict, ctx, ctrl: Control, phase: list) -> None:
    import torch.distributed as dist

    from npu_train.backends import make_backend
    from npu_train.backends.spec import CardRequest
    from npu_train.checkpoint.store import CheckpointReader, save_shard, tmp_dir
    from npu_train.data.dataset import load_packed, micro_batch_tensors
    from npu_train.data.sampler import StepSampler
    from npu_train.optim.adamw import StageOptimizer
    from npu_train.optim.lr import lr_at
    from npu_train.pipeline.stage import StageRunner

    rank, P = spec["rank"], spec["world_size"]
    tr = spec["train"]
    st = spec["stage"]
    fault = FaultHook.from_env(rank)  # test-only (NPT_FAULT); None in normal runs
    phase[0] = "device setup"
    card = spec["card"]
    backend = make_backend(CardRequest(card["kind"], card["index"], card["name"]))
    backend.setup()
    dtype = _dtype(tr["dtype"])

    phase[0] = "model load"
    module, masters = build_stage(spec, backend, dtype)
    params = dict(module.named_parameters())
    if fault is not None:
        fault.install(module)
    opt = StageOptimizer(params, masters, spec["resident_names"], backend, lr=tr["lr"],
                         betas=(tr["beta1"], tr["beta2"]), eps=tr["eps"], weight_decay=tr["weight_decay"])
    del masters

    phase[0] = "rendezvous"
    dist.init_process_group("gloo", init_method=spec["dist_init"], rank=rank, world_size=P,
                            timeout=timedelta(seconds=float(spec["runtime"]["collective_timeout_s"])))
    tied_pair = spec["model_cfg"]["tie_word_embeddings"] and P > 1
    tied_group = dist.new_group([0, P - 1]) if tied_pair else None
    comm = None
    if P > 1:
        comm = LinkComm(spec, ctx, backend)
        dist.barrier()  # every ring exists before anyone receives

    start = int(spec["start_step"])
    if spec.get("resume_dir"):
        phase[0] = "resume"
        reader = CheckpointReader(spec["resume_dir"])
        want = {}
        for n in params:
            for k in ("master", "exp_avg", "exp_avg_sq"):
                want[f"{k}.{n}"] = reader.get(f"{k}.{n}")
        opt.load_state_tensors(want, reader.step)
        rng_key = f"rng.{rank}"
        if reader.has(rng_key):
            torch.set_rng_state(reader.get(rng_key))
    else:
        torch.manual_seed(tr["seed"] + rank)

    data = load_packed(spec["data_file"])
    sampler = StepSampler(data.train.shape[0], tr["micro_batch"], tr["accum"], tr["seed"])
    runner = StageRunner(module, backend, P, rank, tr["schedule"], comm)
    first, last = rank == 0, rank == P - 1
    tied_name = "model.embed_tokens.weight" if first else "lm_head.weight"
    ckpt_root = spec["ckpt_root"]
    ctrl.send("ready", params=sum(p.numel() for p in params.values()))

    # held-out evaluation: the first eval_batches micro-batches of the validation split
    n_eval = min(int(tr.get("eval_batches") or 0), data.val.shape[0] // tr["micro_batch"])
    ev = [micro_batch_tensors(data, torch.arange(m * tr["micro_batch"], (m + 1) * tr["micro_batch"]), split="val")
          for m in range(n_eval)]

    def evaluate(after_step: int) -> None:
        """Forward-only pass over the held-out micro-batches; the last stage reports the mean loss."""
        phase[0] = f"evaluation after step {after_step}"
        module.eval()
        er = runner.run_eval(after_step, n_eval, [x for x, _ in ev] if first else None,
                             [y for _, y in ev] if last else None)
        module.train()
        red_e = torch.tensor([er["loss_sum"], float(er["n_tokens"])], dtype=torch.float64)
        dist.all_reduce(red_e)
        if last:
            ctrl.send("eval", step=after_step, val_loss=float(red_e[0] / max(float(red_e[1]), 1.0)),
                      tokens=int(red_e[1]))

    if n_eval and start == 0:
        evaluate(0)
    stop_after = int(tr.get("stop_after") or 0)
    for step in range(start, tr["steps"]):
        # phases are named with the 1-based step number, as printed by the coordinator
        if fault is not None:
            fault.current_step = step + 1
        t0 = time.perf_counter()
        backend.reset_peak_memory()
        phase[0] = f"step {step + 1} forward/backward"
        idx = sampler.micro_batches_for_step(step)
        mbs = [micro_batch_tensors(data, i) for i in idx]
        inputs = [x for x, _ in mbs] if first else None
        labels = [y for _, y in mbs] if last else None
        opt.zero_grad()
        if first or last:
            res = runner.run_step(step, inputs, labels)
        else:
            res = runner.run_middle(step, tr["accum"])
        t1 = time.perf_counter()
        phase[0] = f"step {step + 1} collectives"
        if fault is not None:
            fault("collective")
        if tied_pair and rank in (0, P - 1):
            g = params[tied_name].grad
            gh = backend.download(g).float()
            dist.all_reduce(gh, group=tied_group)
            with torch.no_grad():
                g.copy_(backend.upload(gh.to(g.dtype)))
        stop_req = 1.0 if ctrl.poll_stop() else 0.0
        red = torch.tensor([float(opt.grad_sq_sum(exclude=["lm_head.weight"] if (tied_pair and last) else [])),
                            res["loss_sum"], float(res["n_tokens"]), stop_req], dtype=torch.float64)
        dist.all_reduce(red)
        grad_norm = float(red[0]) ** 0.5
        loss = float(red[1] / max(red[2], 1.0))
        clip_coef = 1.0
        if tr["clip"] > 0:
            clip_coef = min(1.0, tr["clip"] / (grad_norm + 1e-6))
        t2 = time.perf_counter()
        phase[0] = f"step {step + 1} optimizer"
        lr = lr_at(step, lr=tr["lr"], warmup_steps=tr["warmup_steps"], total_steps=tr["steps"],
                   min_lr_ratio=tr["min_lr_ratio"])
        if fault is not None:
            fault("optimizer")
        ot = opt.step(lr, clip_coef)
        t3 = time.perf_counter()
        done = step + 1
        ctrl.send("step", step=done, loss=loss, lr=lr, grad_norm=grad_norm, tokens=int(red[2]),
                  time_s=t3 - t0, compute_s=res["compute_s"], wait_s=res["wait_s"] + (t2 - t1),
                  send_s=res["send_s"], optimizer_s=ot["device_optimizer"] + ot["host_optimizer"],
                  host_optimizer_s=ot["host_optimizer"], transfer_s=ot["transfer"],
                  mem_peak=backend.max_memory_allocated(), mem_now=backend.memory_allocated())
        interrupted = bool(red[3] > 0)
        # train.stop_after=K: stop after K steps of this launch (same on every rank, no vote needed)
        stop = interrupted or bool(stop_after and done - start >= stop_after)
        if n_eval and not interrupted and ((tr["eval_every"] and done % tr["eval_every"] == 0) or done == tr["steps"]):
            evaluate(done)
        want_save = (tr["save_every"] and done % tr["save_every"] == 0) or done == tr["steps"] or \
            (interrupted and tr["save_on_interrupt"]) or (stop and not interrupted)
        if want_save:
            phase[0] = f"checkpoint save of step {done}"
            ctrl.send("phase", phase=phase[0])
            tensors = opt.state_tensors()
            tensors[f"rng.{rank}"] = torch.get_rng_state()
            staging = tmp_dir(ckpt_root, done, spec["job_id"])
            save_shard(staging, rank, tensors, {"rank": rank, "card": spec["card"], "stage": st,
                                                "resident": sorted(spec["resident_names"]), "step": done})
            if fault is not None:
                fault("checkpoint")
            ctrl.send("ckpt", step=done, staging=staging)
        if stop:
            ctrl.send("stopped", step=done)
            break
    phase[0] = "shutdown"
    dist.barrier()
    if comm is not None:
        comm.close()
    dist.destroy_process_group()
