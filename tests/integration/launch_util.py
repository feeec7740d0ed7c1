"""Run ``launch/run.py`` as a real subprocess and watch it (fault, bad-input and security tests).

The launcher is started exactly as a user would (``python launch/run.py key=value ...``) with
the tiny-model test settings of ``conftest.make_cfg``; stdout/stderr go to files in the run's
temporary directory so a test can poll them (and ``metrics.jsonl`` / ``job.json``) while the job
runs without ever blocking on a pipe.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import psutil

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(REPO, "launch", "run.py")

#: the same test-sized settings as ``conftest.make_cfg`` (so ``reference_for`` matches)
BASE = ["data.seq_len=32", "train.micro_batch=2", "train.accum=4", "train.lr=1e-3", "train.warmup_steps=1",
        "train.clip=0.5", "train.dtype=fp32", "train.weight_decay=0.01", "runtime.heartbeat_timeout_s=20",
        "runtime.startup_timeout_s=120", "runtime.threads=1"]


class Job:
    """One launcher subprocess. ``overrides`` come after the base settings (later ones win); ``env``
    entries are added to the launcher's environment; ``prefix`` runs it through another command;
    ``argv`` (e.g. a recorded resume command) replaces the launcher command and its settings."""

    def __init__(self, tmp_path, model: str, *overrides: str, name: str = "run", env: Optional[dict] = None,
                 backend: str = "cpu,cpu", prefix: Optional[list] = None, argv: Optional[list] = None):
        self.dir = os.path.join(str(tmp_path), name)
        self.run_dir = os.path.join(self.dir, "out")
        os.makedirs(self.dir, exist_ok=True)
        self.out_path = os.path.join(self.dir, "stdout.txt")
        self.err_path = os.path.join(self.dir, "stderr.txt")
        e = dict(os.environ)
        e.pop("NPT_FAULT", None)
        e.update(env or {})
        # prefix: e.g. ["ip", "netns", "exec", "<ns>"] (a "node" in a network namespace; it execs python)
        argv = argv or [sys.executable, LAUNCH, f"model.path={model}", f"backend={backend}", *BASE, *overrides]
        from npu_train.config import hydra_value

        self.cmd = [*(prefix or []), *argv, f"hydra.run.dir={hydra_value(self.run_dir)}"]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            # own session/process group, so a test can signal the whole group like `timeout` or Slurm do
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, env=e, cwd=REPO, start_new_session=True)
        self.t_start = time.monotonic()
        self.t_exit: Optional[float] = None
        self.family: list[psutil.Process] = []

    # ------------------------------------------------------------------ waiting
    def wait(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"launcher still running after {timeout} s\n{self.tail()}")
        if self.t_exit is None:
            self.t_exit = time.monotonic()
        return rc

    def finish(self, timeout: float = 240.0) -> int:
        """:meth:`wait`, then :meth:`kill_all` whatever happened (no card process outlives the test)."""
        try:
            return self.wait(timeout)
        finally:
            self.kill_all()

    def poll_exit(self) -> Optional[int]:
        rc = self.proc.poll()
        if rc is not None and self.t_exit is None:
            self.t_exit = time.monotonic()
        return rc

    def wait_for(self, cond, timeout: float, what: str, interval: float = 0.02):
        """Poll ``cond()`` until truthy (returned); fail if the launcher exits first or on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return v
            if self.poll_exit() is not None:
                v = cond()
                if v:
                    return v
                raise AssertionError(f"launcher exited ({self.proc.returncode}) before {what}\n{self.tail()}")
            time.sleep(interval)
        self.dump_stacks()
        self.kill_all()
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.tail(12000)}")

    def dump_stacks(self, settle_s: float = 2.0) -> None:
        """Ask the launcher and its card processes for every thread's Python stack (SIGUSR1, which
        both register with ``faulthandler``); the stacks land in :attr:`stderr` for a failure message."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += [c for c in procs[0].children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        except psutil.Error:
            return
        for p in procs:
            try:
                p.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
        time.sleep(settle_s)

    def job_info(self, timeout: float = 90.0) -> dict:
        """``job.json`` once the card processes are spawned; also records the launcher's process family."""
        path = os.path.join(self.run_dir, "job.json")

        def read():
            try:
                with open(path) as f:
                    return json.load(f)
            except (OSError, ValueError):
                return None

        info = self.wait_for(read, timeout, "job.json")
        try:
            self.family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        return info

    def wait_steps(self, n: int, timeout: float = 90.0) -> int:
        return self.wait_for(lambda: len(self.losses()) >= n and len(self.losses()), timeout, f"{n} steps")

    # ------------------------------------------------------------------ results
    def losses(self) -> list[float]:
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                return [json.loads(l)["loss"] for l in f if l.strip().endswith("}")]
        except OSError:
            return []

    def own_losses(self) -> list[float]:
        """:meth:`losses` of the steps this launch ran: a resumed launch's ``metrics.jsonl`` begins with the
        run's earlier steps, carried over up to the resumed step (its ``note: metrics.jsonl and eval.jsonl
        continue with the steps up to N of ...`` line)."""
        m = re.search(r"continue with the steps up to (\d+) of", self.flat_stdout)
        return self.losses()[int(m.group(1)) if m else 0:]

    @property
    def stderr(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()

    @property
    def stdout(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    @property
    def flat_stdout(self) -> str:
        """:attr:`stdout` with every run of whitespace as one space: what the lines say wherever the launcher
        folded them (lines over 100 columns are folded at words), for substring checks."""
        return " ".join(self.stdout.split())

    @property
    def flat_stderr(self) -> str:
        """:attr:`stderr` with every run of whitespace as one space (the interrupt line is folded at words)."""
        return " ".join(self.stderr.split())

    def stdout_line(self, head: str) -> str:
        """The first stdout line starting with ``head``, with the lines the launcher folded it into (those after
        it indented deeper) joined back by one space."""
        lines = self.stdout.splitlines()
        i = next(k for k, ln in enumerate(lines) if ln.startswith(head))
        out = [lines[i]]
        for ln in lines[i + 1:]:
            if not ln.startswith("  "):
                break
            out.append(ln.strip())
        return " ".join(out)

    def error_lines(self) -> list[str]:
        """The ``error:`` refusals of stderr, each with its folded lines joined back (one string a refusal)."""
        from npu_train.errors import error_lines

        return error_lines(self.stderr)

    def tail(self, n: int = 3000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"

    # ------------------------------------------------------------------ processes
    def card_pids(self, info: dict) -> list[int]:
        return [c["pid"] for c in info["cards"]]

    def survivors(self) -> list[psutil.Process]:
        """Processes of the job's family (launcher + its children seen at job.json) still alive."""
        out = []
        for p in self.family:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill_all(self) -> None:
        """Clean up after a failed test: SIGKILL the launcher and every child it had (by pid), also
        children it started after :meth:`job_info` (or before ``job.json`` was ever written)."""
        try:
            seen = {p.pid for p in self.family}
            self.family += [c for c in psutil.Process(self.proc.pid).children(recursive=True) if c.pid not in seen]
        except psutil.Error:
            pass
        for p in self.family:
            try:
                if p.is_running():
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def pid_gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def job_segments(job_id: str) -> list[str]:
    from npu_train.transport.shm import segment_names_for_job

    return segment_names_for_job(job_id)


def watched_job(tmp_path, model: str, *overrides: str, name: str, env: Optional[dict] = None,
                timeout: float = 600.0) -> tuple["Job", dict]:
    """Run a :class:`Job` to its end with every card process's memory sampled from outside every 0.1 s
    (``tests/memwatch.py``); asserts exit status 0. Returns the job and :meth:`MemWatch.card_peaks`."""
    from memwatch import MemWatch

    job = Job(tmp_path, model, *overrides, name=name, env=env)
    w = MemWatch(job.proc.pid, job.run_dir, interval=0.1).start()
    try:
        rc = job.finish(timeout)
    finally:
        w.stop()
    assert rc == 0, job.tail()
    return job, w.card_peaks()


def edit_model_copy(src: str, dst: str, edit_cfg=None, edit_tensors=None) -> str:
    """Copy the HF model directory ``src`` to ``dst``, then apply ``edit_cfg(config dict)`` to config.json and
    ``edit_tensors(name -> tensor dict)`` to model.safetensors (each in place, either optional); returns ``dst``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_cfg:
        with open(os.path.join(dst, "config.json")) as f:
            c = json.load(f)
        edit_cfg(c)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(c, f)
    if edit_tensors:
        p = os.path.join(dst, "model.safetensors")
        t = load_file(p)
        edit_tensors(t)
        save_file(t, p)
    return dst
