"""Card process main (``worker_main(spec)``, spawned): backend, control socket with a heartbeat thread,
then :class:`npu_train.runtime.trainer.StageTrainer`. An exception is reported to the coordinator, exit
1; a launcher that vanished is noticed by the heartbeat thread, which cleans up and exits 3.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

import msgpack
import torch
import zmq

from npu_train.hostmem import card_mmap_threshold, keep_freed_memory
from npu_train.stackdump import install_stack_dump
from npu_train.runtime.faults import FaultHook
from npu_train.runtime.spec import WorkerSpec

log = logging.getLogger("npu_train.worker")


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
    """The launcher is gone: remove the job's /dev/shm segments and IPC directory (idempotent)."""
    import shutil

    from npu_train.transport.shm import unlink_job_segments

    try:
        unlink_job_segments(job_id)
    except Exception:
        pass
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)


#: the signals a card process starts with blocked (the launcher's mask while it starts the card, inherited)
CARD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

#: SIGTERM / SIGHUP numbers this card process received, reported to the coordinator by the heartbeat thread
SIGNALLED: list = []


def _note_signal(signum, frame) -> None:
    """SIGTERM / SIGHUP to this card process: noted here (a signal handler must not use the main thread's
    sockets); the heartbeat thread tells the coordinator, which stops the whole job as for that signal to the
    launcher (finish the step, checkpoint). Sent to the whole process group, the launcher already acts on it."""
    SIGNALLED.append(int(signum))


def _heartbeat_loop(ctx, addr, token, rank, interval, stop_evt, parent_pid, job_id, ipc_dir):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"hb{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    payload = msgpack.packb({"tok": token, "rank": rank, "type": "hb"}, use_bin_type=True)
    while not stop_evt.wait(min(interval, 0.2) if SIGNALLED else interval):
        if os.getppid() != parent_pid:  # launcher died: do not linger as an orphan
            _cleanup_orphaned_job(job_id, ipc_dir)
            os._exit(3)
        try:
            while SIGNALLED:
                sock.send(msgpack.packb({"tok": token, "rank": rank, "type": "sig", "signum": SIGNALLED[0],
                                         "pid": os.getpid()}, use_bin_type=True), zmq.NOBLOCK)
                SIGNALLED.pop(0)
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a card process (``multiprocessing`` spawn target). Never returns normally on error."""
    rank = spec.rank
    logging.basicConfig(level=logging.INFO, format=f"[card {spec.card.name} {spec.layout.where(rank)}] %(message)s")
    # The launcher decides what Ctrl-C / SIGTERM / SIGHUP mean (finish the step, checkpoint, stop). A signal
    # sent to the whole process group (timeout, Slurm, a closed terminal) must not kill the card processes
    # first; the coordinator stops them with SIGKILL at teardown. SIGTERM / SIGHUP sent to this card alone are
    # reported to the coordinator (``_note_signal``), which stops the job the same way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _note_signal)
    signal.signal(signal.SIGHUP, _note_signal)
    install_stack_dump(f"card {spec.card.name} ({spec.layout.where(rank)}, layers {spec.stage.label})")  # kill -USR1
    # started with them blocked (Coordinator._spawn: a Ctrl-C during the start-up and imports is the launcher's):
    # a SIGINT pending meanwhile was discarded by SIG_IGN above, a SIGTERM / SIGHUP / SIGUSR1 is handled now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, CARD_SIGNALS)
    threshold = card_mmap_threshold(spec.card.kind, keep=spec.runtime.keep_host_memory, recompute=spec.train.recompute)
    if threshold is not None and not keep_freed_memory(mmap_threshold=threshold):  # before tensors exist
        log.debug("host memory: malloc settings not changed (not glibc, or the user's MALLOC_* / GLIBC_TUNABLES)")
    torch.set_num_threads(max(1, int(spec.runtime.threads)))
    ctx = zmq.Context()
    ctrl = Control(ctx, spec.coord_addr, spec.token, rank)
    hb_stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, daemon=True,
                          args=(ctx, spec.coord_addr, spec.token, rank, float(spec.runtime.heartbeat_interval_s),
                                hb_stop, spec.parent_pid, spec.job_id, spec.ipc_dir))
    hb.start()
    from npu_train.runtime.trainer import StageTrainer

    trainer = None
    try:
        ctrl.send("hello", pid=os.getpid())
        trainer = StageTrainer(spec, ctx, ctrl, FaultHook.from_env(rank))
        trainer.setup()
        trainer.run()
        trainer.close()
        ctrl.send("done", mem_phases=trainer.mem_phases)
        code = 0
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
        try:
            phase = trainer.phase if trainer is not None else "start"
            ctrl.send("error", phase=phase, etype=type(e).__name__, message=str(e)[:2000],
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
