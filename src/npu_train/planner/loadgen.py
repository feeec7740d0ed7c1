"""Background load for the first-run calibration (:mod:`npu_train.planner.autocal`): the other
card processes of a job.

A job of ``c`` cpu card processes on one host runs them at once; they share the host's memory
bandwidth and caches, so one decoder layer timed in a process alone is faster than the same layer
in the job (measured on the 2-core machine: a 2-process job's per-card compute took 1.34x the
alone-time prediction, a bandwidth-bound host AdamW 1.65x; experiments/2026-11-30-first-run-
calibration.md). :class:`BackgroundLoad` therefore runs ``c - 1`` helper subprocesses
(``sys.executable -c``, torch at the job's thread count) that do the same kind of work as the
calibrating process while it measures: the job's decoder layer forward + backward, its
``lm_head`` + loss forward + backward, or a fused fp32 AdamW step, switched by
:meth:`BackgroundLoad.phase` to the figure being measured (the copy benchmark gets the layer).

Started early: :meth:`BackgroundLoad.spawn` starts the interpreters without waiting (the
launcher calls it before it reads the model: their torch import overlaps that work);
:meth:`BackgroundLoad.start` sends them the work (the shapes are known once the model is read)
and waits until each has built it and run one step. The first helper first measures the process
baseline (:data:`~npu_train.planner.baseline.PROCESS_BASELINE_SOURCE`, as the stand-alone
baseline subprocess does) when asked to, so the baseline costs no interpreter of its own and is
done before the measured window opens. Without helpers (``n = 0``) the baseline runs in its own
subprocess (:func:`~npu_train.planner.baseline.start_process_baseline`), started by ``spawn``.

No helper outlives the calibration: :meth:`BackgroundLoad.stop` (and :meth:`close`, also on
``__exit__`` and on any error of ``start``) asks each to stop, kills it after
:data:`STOP_TIMEOUT_S` and waits for it. A helper whose parent dies sees end-of-file on its stdin
and exits (a helper still importing exits when it next reads stdin, after its imports).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from npu_train.planner.baseline import (
    CARD_PROCESS_MODULES,
    PROCESS_BASELINE_SOURCE,
    baseline_argv,
    finish_process_baseline,
    start_process_baseline,
    subprocess_env,
)

__all__ = ["PHASES", "READY_TIMEOUT_S", "STOP_TIMEOUT_S", "BackgroundLoad", "serve"]

#: the figure being measured -> the helpers' work (copies: the other card computes meanwhile)
PHASES = {"layer": "layer", "head": "head", "copies": "layer", "host_adamw": "adamw",
          "device_adamw": "adamw"}
#: seconds a helper may take, from :meth:`BackgroundLoad.start`, to import torch, measure the
#: baseline and build its work before the calibration fails
READY_TIMEOUT_S = 120.0
#: seconds a helper may take to finish its current step after "stop" before it is killed
STOP_TIMEOUT_S = 10.0
#: seconds the stand-alone baseline subprocess may take (as measure_process_baseline's default)
BASELINE_TIMEOUT_S = 120.0

_SERVE = "from npu_train.planner.loadgen import serve; serve()\n"
# the first helper: the process baseline first (its failure leaves the load running), then serve
_BASELINE_THEN_SERVE = PROCESS_BASELINE_SOURCE + r'''
import json, sys, traceback
try:
    _r = process_baseline(sys.argv[1:])
except Exception:
    _r = {"error": traceback.format_exc()[-2000:]}
print(json.dumps(_r), flush=True)
''' + _SERVE


def _work(spec: dict) -> dict:
    """The helper's work per kind, each a no-argument callable running one step (cpu, torch)."""
    import torch

    from npu_train.model.config import LlamaConfig
    from npu_train.model.headops import HeadLinear
    from npu_train.model.llama import DecoderLayer, RMSNorm, causal_lm_loss_sum, rope_cos_sin

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    H, I, heads, kv, b, S = (int(v) for v in spec["layer"])
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=I, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, name="calibration-load")
    layer = DecoderLayer(cfg, 0).to(dtype=dt)
    cos, sin = rope_cos_sin(cfg, S, torch.device("cpu"), dt)
    x = torch.randn(b, S, H, dtype=dt, requires_grad=True)
    g = torch.randn(b, S, H, dtype=dt)
    V, Hh, tok = (int(v) for v in spec["head"])
    norm = RMSNorm(Hh).to(dtype=dt)
    head = HeadLinear(Hh, V).to(dtype=dt)
    head.fused_grad = True  # the trainer's head on a cpu card (hardware.FUSED_HEAD_KINDS)
    xh = torch.randn(1, tok, Hh, dtype=dt, requires_grad=True)
    labels = torch.randint(0, V, (1, tok))
    per = max(1, int(spec["adamw_params"]) // 8)
    params = [torch.nn.Parameter(torch.randn(per)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn(per) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)

    def layer_step() -> None:
        layer(x, cos, sin).backward(g)

    def head_step() -> None:
        causal_lm_loss_sum(head(norm(xh)).float(), labels, fused=True)[0].backward()

    return {"layer": layer_step, "head": head_step, "adamw": opt.step}


class _Stdin:
    """Lines from fd 0 without Python's buffering (``select`` must see what is unread)."""

    def __init__(self):
        self.buf, self.eof = b"", False

    def lines(self, timeout: Optional[float]) -> list[str]:
        """Complete lines that arrive within ``timeout`` seconds (``None``: wait for one or EOF)."""
        while True:
            if not self.eof and select.select([0], [], [], timeout)[0]:
                chunk = os.read(0, 65536)
                self.eof = not chunk
                self.buf += chunk
            *done, self.buf = self.buf.split(b"\n")
            out = [ln.decode().strip() for ln in done if ln.strip()]
            if out or timeout is not None or self.eof:
                return out


def serve() -> None:
    """A helper's main loop (run by :class:`BackgroundLoad` in a subprocess): import torch, then
    read the work spec from stdin (one JSON line ``{"threads", "dtype", "layer": [H, I, heads,
    kv_heads, b, S], "head": [V, H, tokens], "adamw_params"}``), build the work, run one step of
    each, print ``ready``, then run steps of the current work until stdin says ``stop`` or ends;
    a line naming a work (``layer``/``head``/``adamw``) switches to it between steps. Prints
    ``{"steps": {work: n}}`` (steps per work after ``ready``) before it exits; exits without
    output when stdin ends or says ``stop`` before the spec."""
    import importlib

    import torch

    from npu_train.hostmem import keep_freed_memory

    keep_freed_memory()  # the card processes' malloc settings (npu_train.hostmem)
    importlib.import_module("npu_train.model.llama")  # while the launcher reads the model
    # a fused AdamW imports torch._dynamo on construction (~1.5 s): before the spec, not after it
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)

    stdin = _Stdin()
    first: list[str] = []
    while not first and not stdin.eof:
        first = stdin.lines(None)
    if not first or not first[0].startswith("{"):
        return
    spec = json.loads(first[0])
    torch.set_num_threads(int(spec["threads"]))
    work = _work(spec)
    for fn in work.values():
        fn()
    print("ready", flush=True)
    steps = dict.fromkeys(work, 0)
    current, words = "layer", first[1:]
    while True:
        words += stdin.lines(0)
        if "stop" in words or (stdin.eof and not words):
            break
        current = next((w for w in reversed(words) if w in work), current)
        words = []
        work[current]()
        steps[current] += 1
    print(json.dumps({"steps": steps}), flush=True)


class BackgroundLoad:
    """``n`` helper subprocesses running the calibration's kind of work (module docstring) while
    the calibrating process measures, and (``baseline``) the process-baseline measurement. A
    context manager: ``__exit__`` calls :meth:`close`. ``n = 0`` and no baseline: does nothing.

    Args:
        n: helper processes (the job's card processes on this host minus the calibrating one).
        threads: torch threads of each helper and of the baseline process (the job's threads
            per card process).
        baseline: ``(model_path, modules)``: also measure the process baseline
            (:func:`~npu_train.planner.baseline.baseline_argv`; ``modules`` ``None``: the
            default list); ``None``: not measured.

    Attributes:
        pids: the helpers' process ids (set on spawn; tests check that none is left).
        steps: per helper, the steps it ran per work after it was ready (set by :meth:`stop`).
        returncodes: per helper, its exit status (set by :meth:`stop`; ``-9``: killed).
        baseline_pid: the stand-alone baseline subprocess's id (``n = 0`` with a baseline).
        spawned_at: ``time.monotonic()`` when :meth:`spawn` started the processes (``None``
            before).
    """

    def __init__(self, n: int, *, threads: int,
                 baseline: Optional[tuple[Optional[str], Optional[Sequence[str]]]] = None):
        self.n = max(0, int(n))
        self.threads = int(threads)
        self.baseline = None if baseline is None else (baseline[0], tuple(baseline[1] or CARD_PROCESS_MODULES))
        if self.baseline is not None:
            baseline_argv(self.baseline[0], self.threads, self.baseline[1])  # ValueError (a comma) now
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []
        self.steps: list[Optional[dict]] = []
        self.returncodes: list[Optional[int]] = []
        self.baseline_pid: Optional[int] = None
        self.spawned_at: Optional[float] = None
        self._errs: list = []
        self._spawned = self._ready = False
        self._base_proc: Optional[subprocess.Popen] = None
        self._base: Optional[dict] = None  # {"rss": bytes} or {"error": text}

    def fits(self, n: int, threads: int, baseline: bool) -> bool:
        """Whether this load serves a measurement of ``n`` helpers at ``threads`` threads that
        needs (``baseline``) a process baseline."""
        return self.n == max(0, int(n)) and self.threads == int(threads) and (
            self.baseline is not None or not baseline)

    def spawn(self) -> None:
        """Start the helpers' interpreters (and the baseline) without waiting; safe to call
        twice. Raises ``OSError`` when a process cannot be started (the others are closed)."""
        if self._spawned:
            return
        self._spawned, self.spawned_at = True, time.monotonic()
        env = subprocess_env()
        try:
            for i in range(self.n):
                err = tempfile.TemporaryFile()
                self._errs.append(err)
                argv = ([_BASELINE_THEN_SERVE, *baseline_argv(self.baseline[0], self.threads, self.baseline[1])]
                        if i == 0 and self.baseline is not None else [_SERVE])
                # unbuffered: select() on the pipe must see every line not yet read
                p = subprocess.Popen([sys.executable, "-c", *argv], stdin=subprocess.PIPE, bufsize=0,
                                     stdout=subprocess.PIPE, stderr=err, env=env)
                self.procs.append(p)
                self.pids.append(p.pid)
            if self.n == 0 and self.baseline is not None:
                self._base_proc = start_process_baseline(self.baseline[0], self.threads, self.baseline[1])
                self.baseline_pid = self._base_proc.pid
        except BaseException:
            self.close()
            raise

    def start(self, *, dtype: str, layer, head, adamw_params: int, baseline_first: bool = False,
              timeout: float = READY_TIMEOUT_S) -> None:
        """:meth:`give_work` and :meth:`wait_ready`."""
        self.give_work(dtype=dtype, layer=layer, head=head, adamw_params=adamw_params)
        self.wait_ready(baseline_first=baseline_first, timeout=timeout)

    def give_work(self, *, dtype: str, layer, head, adamw_params: int) -> None:
        """Send the helpers their work without waiting (spawning them first when :meth:`spawn`
        was not called). ``dtype``: ``"fp32"`` or ``"bf16"``; ``layer``: ``(H, I, heads,
        kv_heads, micro_batch, seq)``; ``head``: ``(vocab, hidden, tokens)``; ``adamw_params``:
        fp32 parameters of the AdamW work. A helper that already exited is reported by
        :meth:`wait_ready`."""
        self.spawn()
        spec = json.dumps({"threads": self.threads, "dtype": dtype, "layer": list(layer),
                           "head": list(head), "adamw_params": int(adamw_params)}).encode() + b"\n"
        for p in self.procs:
            try:
                p.stdin.write(spec)
                p.stdin.flush()
            except OSError:
                pass

    def wait_ready(self, *, baseline_first: bool = False, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until each helper printed ``ready`` (after :meth:`give_work`). ``baseline_first``:
        also wait for a stand-alone baseline subprocess (when no core is left for it beside the
        measurement).

        Raises ``RuntimeError`` (everything closed, with the failed helper's stderr) when a helper
        exits or is not ready within ``timeout`` seconds."""
        try:
            t_end = time.monotonic() + timeout
            for i, (p, err) in enumerate(zip(self.procs, self._errs)):
                line = self._line(p, t_end)
                if i == 0 and self.baseline is not None and line.startswith(b"{"):
                    self._base = json.loads(line)
                    line = self._line(p, t_end)
                if line.strip() != b"ready":
                    err.seek(0)
                    tail = err.read().decode(errors="replace").strip()[-2000:]
                    raise RuntimeError(f"calibration load process {p.pid} not ready within {timeout:g} s"
                                       f" (exit {p.poll()}): {tail}")
        except BaseException:
            self.close()
            raise
        self._ready = True
        if baseline_first and self._base_proc is not None:
            self._collect_baseline()

    @staticmethod
    def _line(p: subprocess.Popen, t_end: float) -> bytes:
        ready = select.select([p.stdout], [], [], max(0.0, t_end - time.monotonic()))[0]
        return p.stdout.readline() if ready else b""

    def _collect_baseline(self) -> None:
        try:
            self._base = {"rss": finish_process_baseline(self._base_proc, BASELINE_TIMEOUT_S)}
        except Exception as exc:  # noqa: BLE001 - reported by baseline_bytes
            self._base = {"error": str(exc)[:2000]}
        self._base_proc = None

    def baseline_bytes(self) -> int:
        """The measured process baseline, bytes (RSS); waits for a stand-alone baseline
        subprocess. Raises ``RuntimeError`` when it was not asked for or failed (its error)."""
        if self._base_proc is not None:
            self._collect_baseline()
        if self._base is None:
            raise RuntimeError("the process baseline was not measured")
        if "error" in self._base:
            raise RuntimeError(f"process-baseline measurement failed: {self._base['error']}")
        return int(self._base["rss"])

    def phase(self, name: str) -> None:
        """Switch every helper to the work of figure ``name`` (:data:`PHASES`; others: ignored)."""
        work = PHASES.get(name)
        if work is None:
            return
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(work.encode() + b"\n")
                    p.stdin.flush()
                except OSError:
                    pass

    def stop(self) -> None:
        """Stop every helper (``stop``, then killed after :data:`STOP_TIMEOUT_S`) and wait for it;
        records :attr:`steps`. A stand-alone baseline subprocess keeps running (collected by
        :meth:`baseline_bytes`, killed by :meth:`close`). Helpers not yet ready (still importing
        or measuring the baseline: an error before the measurement) are killed at once. Safe to
        call twice."""
        if not self._ready:
            for p in self.procs:
                p.kill()
        for p in self.procs:
            try:
                p.stdin.write(b"stop\n")
                p.stdin.flush()
            except (OSError, ValueError):
                pass
        steps = []
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=STOP_TIMEOUT_S)  # closes stdin, reads, waits
            except (subprocess.TimeoutExpired, OSError, ValueError):
                p.kill()
                p.wait()
                out = b""
            lines = [ln for ln in (out or b"").decode(errors="replace").splitlines()
                     if ln.startswith('{"steps"')]
            steps.append(json.loads(lines[-1])["steps"] if lines else None)
        if self.procs:
            self.steps, self.returncodes = steps, [p.returncode for p in self.procs]
        self.procs = []
        for err in self._errs:
            err.close()
        self._errs = []

    def close(self) -> None:
        """:meth:`stop`, and kill and reap a stand-alone baseline subprocess still running.
        Safe to call twice."""
        self.stop()
        if self._base_proc is not None:
            self._base_proc.kill()
            self._base_proc.communicate()
            self._base_proc = None

    def __enter__(self) -> "BackgroundLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
