"""Coordinator: spawn one process per card, supervise them by heartbeat, tear the job down on any failure.

Off the data path: card processes send hellos, heartbeats, metrics, checkpoint reports and errors over a
ZeroMQ ROUTER socket. A failure is named (card, stage, layers, phase, cause), the other processes are
ended and the job's shared memory, sockets and staging directories removed; exit 1. Start at
:class:`Coordinator`; preparation is :mod:`npu_train.runtime.job`, the rules (root cause, signals,
orphans, multi-node) are in docs/design.md §17. ``<run_dir>/job.json`` describes a running job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import msgpack
import zmq

from npu_train.errors import Interrupted, JobFailed
from npu_train.hostmem import card_wait_env
from npu_train.runtime.jobstore import picks_port
from npu_train.runtime.oom import OomWatch
from npu_train.runtime.spec import WorkerSpec

log = logging.getLogger("npu_train")


@dataclass
class RankState:
    rank: int
    card: str
    layers: str
    where: str = ""                   # "stage 1" or "replica 1, stage 0" (ParallelLayout)
    proc: Optional[mp.Process] = None
    last_seen: float = 0.0
    ready: bool = False
    done: bool = False
    phase: str = "start"
    steps: dict = field(default_factory=dict)
    error: Optional[str] = None       # cause reported by the card process itself
    error_at: float = 0.0             # when the report arrived (monotonic)
    heard: bool = False               # any authenticated message received (the process is up)
    started_at: float = 0.0           # spawn time (monotonic)
    mem_phases: dict = field(default_factory=dict)  # phase family -> peak bytes, from the "done" message
    inbox: Optional[str] = None       # the mailbox's bound address, reported when its port was picked at the bind



class SignalWake:
    """Wakes the supervision loop's poll when a signal arrives (``signal.set_wakeup_fd`` on a socket pair): pyzmq
    runs the Python handler on EINTR and then polls again for the rest of the timeout, so a Ctrl-C reached the
    cards up to one poll timeout (200 ms) late, and with short steps they had passed that step's stop check
    (fresh-clone review: the line after step 18, steps 19 and 20 ran, step 20 was saved). Main thread only;
    elsewhere it does nothing. ``fd``: the read end to register in a poller (None when inactive)."""

    def __init__(self):
        import socket
        import threading

        self.fd: Optional[int] = None
        self._pair = None
        self._old = -1
        if threading.current_thread() is not threading.main_thread():
            return
        self._pair = socket.socketpair()
        for sk in self._pair:
            sk.setblocking(False)
        self._old = signal.set_wakeup_fd(self._pair[1].fileno(), warn_on_full_buffer=False)
        self.fd = self._pair[0].fileno()

    def drain(self) -> None:
        """Empty the read end (the signal numbers; the handlers have run already), passing them on to the wakeup
        fd set before (a test harness watching for Ctrl-C)."""
        if self._pair is None:
            return
        try:
            while True:
                got = self._pair[0].recv(4096)
                if not got:
                    break
                if self._old >= 0:
                    try:
                        os.write(self._old, got)
                    except OSError:
                        pass
        except OSError:  # BlockingIOError: empty
            pass

    def close(self) -> None:
        if self._pair is None:
            return
        self.drain()
        signal.set_wakeup_fd(self._old, warn_on_full_buffer=False)
        for sk in self._pair:
            sk.close()
        self._pair, self.fd = None, None


class Coordinator:
    """Spawns the card processes for ``specs`` and supervises them until done or failed."""

    def __init__(self, specs: list[WorkerSpec], *, run_dir: str, ipc_dir: str, job_id: str, token: str,
                 heartbeat_timeout_s: float, startup_timeout_s: float, steps: int, start_step: int,
                 ckpt_root: str, ckpt_keep: int, manifest_base: dict, save_on_interrupt: bool,
                 reporter, coord_addr: str, node_link=None, node: int = 0, nnodes: int = 1):
        self.specs = specs
        self.P = specs[0].world_size   # stages of the whole job (all nodes)
        self.link, self.node, self.nnodes = node_link, node, nnodes
        self.run_dir, self.ipc_dir, self.job_id, self.token = run_dir, ipc_dir, job_id, token
        self.hb_timeout, self.startup_timeout = heartbeat_timeout_s, startup_timeout_s
        self.steps, self.start_step = steps, start_step
        self.ckpt_root, self.ckpt_keep, self.manifest_base = ckpt_root, ckpt_keep, manifest_base
        self.save_on_interrupt = save_on_interrupt
        self.reporter = reporter
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(coord_addr)  # tcp://host:* : a port picked at the bind, handed to the card processes
        bound = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if bound != coord_addr and coord_addr.startswith("tcp://"):
            self.specs = specs = [dataclasses.replace(s, coord_addr=bound) for s in specs]
        self.ranks = [RankState(s.rank, s.card.name, s.stage.label, s.layout.where(s.rank)) for s in specs]
        self.by_rank = {rs.rank: rs for rs in self.ranks}
        self.ckpt_reports: dict[int, dict[int, str]] = {}
        self.interrupted = 0
        self.signal_at = 0.0  # time.monotonic() of the last counted signal
        self.signum = int(signal.SIGINT)  # the last signal received (exit status 128 + signum)
        self.oom = OomWatch()  # the cgroup's OOM-kill count at start (a card's SIGKILL is then classified)
        self.stop_sent_at: Optional[float] = None
        self.loop_at = time.monotonic()  # the supervision loop's last pass (a long gap: this launcher was paused)
        self.last_ckpt: Optional[str] = None
        self.rejected = 0

    # ------------------------------------------------------------------ lifecycle
    #: blocked in the launcher while it starts a card process (:meth:`_spawn`); the card inherits the mask and
    #: unblocks them in ``worker_main`` once its own dispositions are set (:data:`CARD_SIGNALS` there too)
    SPAWN_BLOCKED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def run(self) -> None:
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for s in old:
            signal.signal(s, self._on_signal)
        try:
            try:
                self._spawn()
                self._write_job_file()
                self._loop()
            except BaseException as e:
                if self.link is not None:  # every other node goes down with the same message
                    self.link.fail(str(e) if isinstance(e, JobFailed) else
                                   f"node {self.node}: the launcher stopped ({type(e).__name__}: {e})")
                raise
        finally:
            try:
                self.teardown()  # a further signal meanwhile is only counted: teardown always completes
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    def _spawn(self) -> None:
        """Start one card process per spec (``spawn``: fork and exec of a fresh interpreter). A Ctrl-C during
        start-up belongs to the launcher: SIGINT/SIGTERM/SIGHUP (and SIGUSR1, the stack dump, which would kill a
        starting card) are blocked around each ``start()``, and the card inherits the blocked mask through the
        exec, so its imports are not interrupted with a KeyboardInterrupt traceback; ``worker_main`` unblocks
        them after setting its own dispositions. Blocked, not ignored: a signal to the launcher in that window
        stays pending and is handled (:meth:`_on_signal`) when the mask is restored; set to SIG_IGN it was
        discarded, and a Ctrl-C while 8 cards started did nothing. Once a signal was counted no further card
        is started: :class:`Interrupted` (the job then stops as for a Ctrl-C during start-up)."""
        ctx = mp.get_context("spawn")
        now = time.monotonic()
        for spec, rs in zip(self.specs, self.ranks):
            if self.interrupted:
                raise Interrupted(self.signum)
            rs.proc = ctx.Process(target=_worker_entry, args=(spec,), name=f"npu-train-{rs.card}", daemon=False)
            extra = card_wait_env(spec.card.kind, spec.runtime.threads)  # read when the card loads torch
            saved = {k: os.environ.get(k) for k in extra}
            os.environ.update(extra)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.SPAWN_BLOCKED)
            try:
                rs.proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending signal runs _on_signal now
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            rs.last_seen = rs.started_at = now
        if self.interrupted:
            raise Interrupted(self.signum)

    #: after the first error report, wait this long for a peer's death to show (root cause)
    ERROR_GRACE_S = 0.5
    #: multi-node: after a local error report, wait this long for another node's failure notice
    REMOTE_GRACE_S = 3.0

    #: the same signal again within this many seconds is one interrupt delivered twice, not a second
    #: Ctrl-C: GNU ``timeout`` signals the command and then its whole process group, the launcher included
    DUPLICATE_SIGNAL_S = 0.2

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.interrupted and int(signum) == self.signum and now - self.signal_at < self.DUPLICATE_SIGNAL_S:
            return
        self.signal_at = now
        self.interrupted += 1
        self.signum = int(signum)

    def _write_job_file(self) -> None:
        """``<run_dir>/job.json``: ids, pids and addresses of this job (no token), written atomically; a TCP
        mailbox is ``tcp://host:*`` until every card reported the port its bind picked (then written again)."""
        info = {
            "job_id": self.job_id, "launcher_pid": os.getpid(), "run_dir": self.run_dir,
            "ipc_dir": self.ipc_dir, "coord_addr": self.specs[0].coord_addr,
            "transport": self.specs[0].runtime.transport, "shm_prefix": f"npt_{self.job_id}_",
            "ckpt_root": self.ckpt_root, "node": self.node, "nnodes": self.nnodes,
            "boundaries": [self.specs[0].boundary_mode(b) for b in range(self.P - 1)],
            "cards": [{"rank": rs.rank, "card": rs.card, "layers": rs.layers, "where": rs.where, "pid": rs.proc.pid,
                       "inbox": (rs.inbox or spec.inbox[rs.rank]) if self.P > 1 else None}
                      for rs, spec in zip(self.ranks, self.specs)],
        }
        path = os.path.join(self.run_dir, "job.json")
        try:
            with open(path + ".part", "w") as f:
                json.dump(info, f, indent=1)
            os.replace(path + ".part", path)
        except OSError as e:  # a full run dir: the job's record is lost, not the job (no partial file stays)
            with contextlib.suppress(OSError):
                os.remove(path + ".part")
            print(f"warning: cannot write {path} ({e}); the job goes on without it", file=sys.stderr, flush=True)

    def _describe(self, rs: RankState) -> str:
        return f"card {rs.card} ({rs.where or f'stage {rs.rank}'}, layers {rs.layers})"

    def _fail(self, rs: RankState, cause: str) -> None:
        raise JobFailed(f"{self._describe(rs)} failed during {rs.phase}: {cause}")

    def _loop(self) -> None:
        wake = SignalWake()  # a signal ends the poll at once: the stop reaches the cards within the step
        try:
            self._supervise(wake)
        finally:
            wake.close()

    def _supervise(self, wake: SignalWake) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if wake.fd is not None:
            poller.register(wake.fd, zmq.POLLIN)
        self.loop_at = time.monotonic()
        while True:
            for _ in range(256):
                events = dict(poller.poll(0 if _ else 200))
                if wake.fd is not None and wake.fd in events:
                    wake.drain()
                    if self.sock not in events:
                        break
                if self.sock not in events:
                    break
                self._handle(self.sock.recv_multipart())
            now = time.monotonic()
            self._forgive_pause(now)
            if self.reporter is not None:  # plain output: a line when the start-up is silent for long
                self.reporter.quiet_startup([(rs.card, rs.phase) for rs in self.ranks])
            if self.link is not None:
                self.link.pump(now, lambda step: self._publish(step, self.ckpt_reports.pop(step)[min(self.by_rank)]))
            if all(rs.done for rs in self.ranks):
                if self.link is not None and not self.link.all_done(self.last_ckpt):
                    if self.interrupted:  # a second Ctrl-C still aborts the wait
                        self._handle_interrupt(now)
                    continue  # wait for the other nodes (their failures still bring this one down)
                if self.link is not None and self.link.last_ckpt:
                    self.last_ckpt = self.link.last_ckpt
                for rs in self.ranks:
                    rs.proc.join(timeout=30)
                return
            if self.interrupted:
                self._handle_interrupt(now)
            self._check_failures(poller, now)

    def _death(self, rs: RankState, code: Optional[int], now: float) -> Optional[str]:
        """Why ``rs`` died without a report (exit, signal, OOM kill) or hung; None if it did not."""
        if code is not None:
            if rs.done and code == 0 or rs.error is not None:
                return None
            oom = self.oom.cause(rs.proc.pid) if code == -signal.SIGKILL else None
            return f"process {oom}; free host memory or lower the plan's memory (train.resident_layers)" if oom \
                else _exit_cause(code)
        if not rs.heard and now - rs.started_at > max(self.hb_timeout, self.startup_timeout):
            return (f"no message {now - rs.started_at:.0f} s after the process was started "
                    f"(runtime.startup_timeout_s={self.startup_timeout:g}: process {rs.proc.pid} "
                    "hung in interpreter start-up or imports; raise runtime.startup_timeout_s "
                    "on a slow file system)")
        if rs.heard and now - rs.last_seen > self.hb_timeout:
            return (f"stopped responding: no heartbeat for {now - rs.last_seen:.0f} s "
                    f"(runtime.heartbeat_timeout_s={self.hb_timeout:g}; process {rs.proc.pid} hung or stopped)")
        return None

    #: a gap this long between two passes of the supervision loop (each waits at most 0.2 s for a message) means
    #: that this launcher did not run: the whole job paused (Ctrl-Z / SIGSTOP, docker pause, a suspended VM or
    #: laptop), or the loop was held up; the cards' silence meanwhile says nothing about them
    PAUSE_GAP_S = 3.0
    #: the note is printed only from this gap on: a loop held up 3-8 s is what a host loaded 8x over its cores
    #: does (seen four times in a row on a 2-core VM at load 17), and a note each time is noise
    NOTE_GAP_S = 8.0

    def _forgive_pause(self, now: float) -> None:
        """Liveness tells "my peers are silent" from "I was not running": after a gap of :data:`PAUSE_GAP_S` or
        more in this process's own progress, every card's (and node's) heartbeat and start-up deadline is moved on
        by the gap (to ``now`` at most), so a paused and continued job goes on; a card that stays silent after it
        is still reported after ``runtime.heartbeat_timeout_s``."""
        gap, self.loop_at = now - self.loop_at, now
        if gap < self.PAUSE_GAP_S:
            return
        for rs in self.ranks:
            rs.last_seen = min(rs.last_seen + gap, now)
            rs.started_at = min(rs.started_at + gap, now)
        if self.link is not None:
            self.link.forgive(gap, now)
        if gap >= self.NOTE_GAP_S:
            self.reporter.note(f"note: the launcher did not run for {gap:.0f} s (the job was paused or "
                               "suspended?): the card processes' heartbeat deadlines start again")

    def _check_failures(self, poller, now: float) -> None:
        """Raise :class:`JobFailed` naming the root cause if any card process failed."""
        codes = {rs.rank: rs.proc.exitcode for rs in self.ranks}
        if any(c is not None and not (self.by_rank[r].done and c == 0) for r, c in codes.items()):
            # drain pending messages first: an error report explains an exit better than its status
            while poller.poll(50):
                self._handle(self.sock.recv_multipart())
        for rs in self.ranks:  # died without a report (signal, silent exit) or hung: a root cause
            cause = self._death(rs, codes[rs.rank], now)
            if cause:
                self._fail(rs, cause)
        reported = sorted((rs for rs in self.ranks if rs.error is not None), key=lambda r: r.error_at)
        if reported:
            settled = all(rs.error is not None or codes[rs.rank] is not None for rs in self.ranks)
            if self.link is None:
                due = settled or now - reported[0].error_at >= self.ERROR_GRACE_S
            else:  # another node may know the root cause (a card killed there breaks our collectives)
                due = now - reported[0].error_at >= self.REMOTE_GRACE_S and not self.link.quiet_peers(now)
            if due:
                self._fail(reported[0], reported[0].error)

    def _handle_interrupt(self, now: float) -> None:
        started = all(rs.ready for rs in self.ranks)
        if self.interrupted >= 2 and started and self.save_on_interrupt:
            raise self._aborted()
        if self.interrupted >= 2 or not started or not self.save_on_interrupt:
            raise Interrupted(self.signum)
        if self.stop_sent_at is None:
            again = "Ctrl-C" if self.signum == signal.SIGINT else "the signal"
            print(f"\ninterrupt ({signal.Signals(self.signum).name}): finishing the step in progress, then saving a "
                  f"checkpoint ({again} again to abort)", file=sys.stderr, flush=True)
            for rs in self.ranks:
                self._send(rs.rank, {"type": "stop"})
            self.stop_sent_at = now
        # no fixed limit on finishing the step and saving: the heartbeat check ends a hung job,
        # and a second signal aborts at once

    def _aborted(self) -> Interrupted:
        """A second signal aborted the interrupt save: name the last complete checkpoint and how to resume."""
        from npu_train.checkpoint.store import complete_checkpoints
        from npu_train.runtime.saving import NO_CHECKPOINT_YET, continue_note

        done = complete_checkpoints(self.ckpt_root) if self.ckpt_root else []
        ck = self.last_ckpt or (done[-1] if done else None)
        msg = "the interrupt save was aborted; " + (
            f"last complete checkpoint {ck}; {continue_note(self.ckpt_root, self.specs[0].train.offload_update)}"
            if ck else NO_CHECKPOINT_YET)
        return Interrupted(self.signum, msg, checkpoint=ck, checkpoint_dir=self.ckpt_root)

    def _send(self, rank: int, msg: dict) -> None:
        self.sock.send_multipart([f"w{rank}".encode(), msgpack.packb(dict(msg, tok=self.token), use_bin_type=True)])

    def _authentic(self, frames: list[bytes]) -> Optional[dict]:
        """The message in ``frames`` if it is msgpack with this job's token and a known rank, else None (counted)."""
        try:
            # never unpickled: msgpack only, and a size limit keeps strangers from exhausting memory
            if len(frames) != 2 or len(frames[-1]) > 1 << 20:
                raise ValueError("unexpected frames")
            msg = msgpack.unpackb(frames[-1], raw=False)
            tok = msg.get("tok") if isinstance(msg, dict) else None
            ok = (isinstance(tok, str) and hmac.compare_digest(tok.encode(), self.token.encode())
                  and int(msg.get("rank", -1)) in self.by_rank)
        except Exception:
            ok = False
        if ok:
            return msg
        self.rejected += 1
        if self.rejected <= 20 or self.rejected % 1000 == 0:
            log.warning("coordinator: ignored a message from an unauthenticated peer "
                        "(%d so far; wrong or missing job token, or not msgpack)", self.rejected)
        return None

    def _handle(self, frames: list[bytes]) -> None:
        msg = self._authentic(frames)
        if msg is None:
            return
        rs = self.by_rank[int(msg["rank"])]
        rs.last_seen = time.monotonic()
        rs.heard = True
        t = msg.get("type")
        if t == "hb":
            return
        if t == "hello":
            rs.phase = "device setup"
        elif t == "ready":
            rs.ready = True
            rs.phase = f"step {self.start_step + 1}"
            if all(r.ready for r in self.ranks):  # the end of the load phase, in run.log (outside memory samplers)
                since = time.monotonic() - min(r.started_at for r in self.ranks)
                self.reporter.note(f"cards ready: {len(self.ranks)} card process(es) loaded their layers "
                                   f"({since:.1f} s after the start)")
        elif t == "phase":
            rs.phase = str(msg.get("phase", rs.phase))
            self.reporter.phase(int(msg["rank"]), rs.phase)
        elif t == "step":
            s = int(msg["step"])
            rs.phase = f"step {s + 1}"
            rs.steps[s] = msg
            if all(s in r.steps for r in self.ranks):
                self.reporter.step([r.steps.pop(s) for r in self.ranks])
        elif t == "eval":
            self.reporter.eval(int(msg["step"]), float(msg["val_loss"]), int(msg["tokens"]), msg.get("objective"))
        elif t == "note":
            self.reporter.note(str(msg.get("text", "")))
        elif t == "inbox":  # a mailbox bound on a port picked at the bind: job.json names it once all are known
            self._on_inbox(rs, str(msg.get("addr", "")))
        elif t == "ckpt":
            self._on_ckpt(rs, msg)
        elif t in ("done", "stopped"):
            rs.done = rs.done or t == "done"
            rs.mem_phases = dict(msg.get("mem_phases") or rs.mem_phases)
            rs.phase = "shutdown"
        elif t == "error":
            self._on_error(rs, msg)
        elif t == "sig":
            self._card_signal(rs, int(msg.get("signum", signal.SIGTERM)), msg.get("pid"))

    def _card_signal(self, rs: RankState, signum: int, pid) -> None:
        """SIGTERM / SIGHUP received by one card process: the job stops as for that signal to the launcher (finish
        the step, checkpoint, exit 128 + signum). The same signal to the whole process group reached the launcher
        too: then it is already stopping and the card's report does not count as a second signal."""
        if self.interrupted:
            return
        name = signal.Signals(signum).name
        print(f"note: {self._describe(rs)} (pid {pid}) received {name}: stopping the job as for a {name} to the "
              "launcher", file=sys.stderr, flush=True)
        self._on_signal(signum, None)

    def _on_inbox(self, rs: RankState, addr: str) -> None:
        rs.inbox = addr
        if all(r.inbox or not picks_port(s.inbox[r.rank]) for r, s in zip(self.ranks, self.specs)):
            self._write_job_file()

    def _on_ckpt(self, rs: RankState, msg: dict) -> None:
        s = int(msg["step"])
        rs.phase = f"step {s + 1}"  # the shard is written: the card process goes on with the next step
        rep = self.ckpt_reports.setdefault(s, {})
        rep[rs.rank] = msg["staging"]
        if len(rep) == len(self.ranks):
            if self.link is None:
                self._publish(s, rep[0])
            else:  # node 0 publishes once every node's shards are written (NodeLink.pump)
                self.link.shards_written(s)

    def _on_error(self, rs: RankState, msg: dict) -> None:
        rs.phase = msg.get("phase", rs.phase)
        with open(os.path.join(self.run_dir, f"card{rs.rank}.traceback.txt"), "w") as f:
            f.write(msg.get("traceback", ""))
        if rs.error is None:  # decided in _check_failures: a peer's death may be the root cause
            rs.error = (f"{msg.get('etype')}: {msg.get('message')} "
                        f"(traceback: {os.path.join(self.run_dir, f'card{rs.rank}.traceback.txt')})")
            rs.error_at = time.monotonic()

    def _publish(self, step: int, staging: str) -> None:
        from npu_train.checkpoint.store import finalize, missing_shards, space_warning

        t0 = time.perf_counter()
        missing = missing_shards(staging, self.specs[0].num_stages)  # replica 0 writes one shard per stage
        if missing:  # multi-node: a node wrote its shards elsewhere (checkpoint.dir not shared)
            raise JobFailed(f"checkpoint of step {step}: the shards of stage(s) {missing} are missing from {staging}; "
                            "every node must write into one shared checkpoint.dir (a shared filesystem / RWX "
                            "volume mounted at the same path on every node)")
        final = finalize(self.ckpt_root, staging, step, self.manifest_base, keep=self.ckpt_keep)
        self.last_ckpt = final
        self.reporter.note(f"checkpoint step {step} saved to {final} ({time.perf_counter() - t0:.1f} s to publish)")
        warning = space_warning(self.ckpt_root, final) if step < self.steps else None
        if warning:
            self.reporter.note(warning)

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
        if self.link is not None:
            self.link.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        # multi-node: the staging dirs are shared; only node 0 (which publishes) removes them
        if self.node == 0 and os.path.isdir(self.ckpt_root):
            for fn in os.listdir(self.ckpt_root):
                if fn.startswith((".tmp-", ".new-")) and fn.endswith(self.job_id):
                    shutil.rmtree(os.path.join(self.ckpt_root, fn), ignore_errors=True)


def _worker_entry(spec: WorkerSpec) -> None:
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
