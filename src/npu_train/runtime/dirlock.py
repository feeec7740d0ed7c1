"""One live job per run directory and per checkpoint root: :func:`lock_dir` takes ``<dir>/.npt-<what>.lock``
with ``fcntl.flock`` (atomic; the kernel drops it when the launcher dies, ``kill -9`` included, so a dead
job's lock is taken over) and writes an owner record (pid, host, start time, command, job id) into it; a
second launch while the owner lives is refused with :class:`DirInUseError` naming the job and its pid.
:meth:`DirLock.release` removes the file (every exit path of ``run_job``). Where ``flock`` is not supported
(some network filesystems) the record alone decides: a live owner on this host refuses, a dead one is
taken over. docs/design.md §17.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from npu_train.errors import UserError
from npu_train.ownership import owner_alive, process_identity


class DirInUseError(UserError):
    """The run directory or checkpoint root is used by a live job (exit 2)."""


def lock_path(directory: str, what: str) -> str:
    """``<directory>/.npt-<what>.lock`` (``what``: ``run``, ``run-n<k>`` for node k, ``checkpoint``)."""
    return os.path.join(directory, f".npt-{what}.lock")


def _read_record(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def describe_owner(rec: Optional[dict]) -> str:
    """``job <id> (pid N on host H, started <UTC time>: <command>)`` of an owner record."""
    if not rec:
        return "another launch (its owner record is not written yet)"
    job = f"job {rec['job_id']}" if rec.get("job_id") else "a launch that has not started its job yet"
    when = ""
    if isinstance(rec.get("start"), (int, float)):
        when = ", started " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec["start"]))
    cmd = f": {rec['command']}" if rec.get("command") else ""
    return f"{job} (pid {rec.get('pid')} on host {rec.get('host')}{when}{cmd})"


class DirLock:
    """A held lock on ``path``; ``took_over``: the record of a dead owner whose lock this replaced, or None."""

    def __init__(self, path: str, fd: int, record: dict, took_over: Optional[dict]):
        self.path, self.fd, self.record, self.took_over = path, fd, record, took_over

    def set_job(self, job_id: str) -> None:
        """Add the job id to the owner record (known once the launch has its identity)."""
        self.record = dict(self.record, job_id=job_id)
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent, never raises)."""
        if self.fd < 0:
            return
        try:
            if _same_file(self.fd, self.path):
                os.remove(self.path)
        except OSError:
            pass
        try:
            os.close(self.fd)  # drops the flock
        except OSError:
            pass
        self.fd = -1


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a releasing owner may have removed it)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_dir(directory: str, what: str, setting: str, fix: str) -> DirLock:
    """Take ``directory``'s ``what`` lock for this launcher. Raises :class:`DirInUseError` (naming
    ``setting``, the owner and ``fix``) when a live job holds it."""
    path = lock_path(directory, what)
    record = dict(process_identity(os.getpid()) or {"pid": os.getpid(), "host": socket.gethostname()},
                  command=" ".join([os.path.basename(sys.executable), *sys.argv]), directory=directory)
    for _ in range(20):  # retried only when the owner removed the file between our open and our flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                _refuse(path, _read_record(path), setting, fix)
            flocked = False  # ENOLCK / EOPNOTSUPP: no flock here, the record decides
        if flocked and not _same_file(fd, path):
            os.close(fd)
            continue
        prev = _read_record(path)
        if prev and not flocked and prev.get("pid") != os.getpid() and owner_alive(prev) is not False:
            os.close(fd)
            _refuse(path, prev, setting, fix)
        lock = DirLock(path, fd, record, prev if prev and prev.get("pid") else None)
        lock._write()
        return lock
    raise DirInUseError(f"{setting}={directory}: cannot take its lock {path} (it keeps changing): {fix}")


def _refuse(path: str, rec: Optional[dict], setting: str, fix: str) -> None:
    directory = os.path.dirname(path)
    raise DirInUseError(f"{setting}={directory} is in use by {describe_owner(rec)}: wait for that job to end or "
                        f"stop it (kill {rec.get('pid') if rec else '<pid>'}), or {fix}")


class JobLocks:
    """The locks of one launch: its run directory (``run``; node k > 0: ``run-n<k>``, so the nodes of one job
    may share a run directory) and, on the node that owns it, the checkpoint root (``checkpoint``)."""

    def __init__(self) -> None:
        self.held: list[DirLock] = []
        self.job_id: Optional[str] = None

    def run_dir(self, run_dir: str, node: int) -> None:
        self._take(run_dir, "run" if not node else f"run-n{node}", "hydra.run.dir",
                   "use another hydra.run.dir (to continue that run after it ended: train.resume=latest)")

    def checkpoint_root(self, root: str) -> None:
        """Lock ``root`` (an existing directory) unless this launch holds its lock already."""
        if any(lk.path == lock_path(root, "checkpoint") for lk in self.held):
            return
        self._take(root, "checkpoint", "checkpoint.dir",
                   "use another checkpoint.dir (default: <run dir>/checkpoints)")

    def _take(self, directory: str, what: str, setting: str, fix: str) -> None:
        lk = lock_dir(directory, what, setting, fix)
        self.held.append(lk)
        if self.job_id:
            lk.set_job(self.job_id)
        if lk.took_over:
            print(f"note: took over {lk.path} of {describe_owner(lk.took_over)}, which is no longer running",
                  flush=True)

    def set_job(self, job_id: str) -> None:
        """Name ``job_id`` in every owner record, also of locks taken later."""
        self.job_id = job_id
        for lk in self.held:
            lk.set_job(job_id)

    def release(self) -> None:
        """Drop every lock (in reverse order); never raises."""
        while self.held:
            self.held.pop().release()
