"""Background load for the first-run calibration (:mod:`npu_train.planner.autocal`): the other
card processes of a job.

A job of ``c`` cpu card processes on one host runs them at once; they share the host's memory
bandwidth and caches, so one decoder layer timed in a process alone is faster than the same layer
in the job (measured on the 2-core machine: a 2-process job's per-card compute took 1.34x the
alone-time prediction, a bandwidth-bound host AdamW 1.65x; experiments/2026-11-30-first-run-
calibration.md). :class:`BackgroundLoad` therefore starts ``c - 1`` helper subprocesses
(``sys.executable -c``, torch at the job's thread count) that run the same kind of work as the
calibrating process while it measures: the job's decoder layer forward + backward, its
``lm_head`` + loss forward + backward, or a fused fp32 AdamW step, switched by
:meth:`BackgroundLoad.phase` to the figure being measured (the copy benchmark gets the layer).

The helpers are started and ready (their work built, one step run) before the measured window
and stopped after it: :meth:`BackgroundLoad.stop` (also on ``__exit__`` and on any error) asks
each to stop, kills it after :data:`STOP_TIMEOUT_S` and waits for it, so none is left running. A
helper whose parent dies sees end-of-file on its stdin and exits.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = ["PHASES", "READY_TIMEOUT_S", "STOP_TIMEOUT_S", "BackgroundLoad", "serve"]

#: the figure being measured -> the helpers' work (copies: the other card computes meanwhile)
PHASES = {"layer": "layer", "head": "head", "copies": "layer", "host_adamw": "adamw",
          "device_adamw": "adamw"}
#: seconds a helper may take to import torch and build its work before the calibration fails
READY_TIMEOUT_S = 120.0
#: seconds a helper may take to finish its current step after "stop" before it is killed
STOP_TIMEOUT_S = 10.0

_CODE = "import sys; from npu_train.planner.loadgen import serve; serve(sys.argv[1])"


def _work(spec: dict) -> dict:
    """The helper's work per kind, each a no-argument callable running one step (cpu, torch)."""
    import torch

    from npu_train.model.config import LlamaConfig
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
    head = torch.nn.Linear(Hh, V, bias=False).to(dtype=dt)
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
        causal_lm_loss_sum(head(norm(xh)).float(), labels)[0].backward()

    return {"layer": layer_step, "head": head_step, "adamw": opt.step}


def serve(spec_json: str) -> None:
    """A helper's main loop (run by :class:`BackgroundLoad` in a subprocess): build the work of
    ``spec_json`` (``{"threads", "dtype", "layer": [H, I, heads, kv_heads, b, S],
    "head": [V, H, tokens], "adamw_params"}``), run one step of each, print ``ready``, then run
    steps of the current work until stdin says ``stop`` or ends; a line naming a work
    (``layer``/``head``/``adamw``) switches to it between steps. Prints ``{"steps": {work: n}}``
    (steps per work after ``ready``) before it exits."""
    import torch

    spec = json.loads(spec_json)
    torch.set_num_threads(int(spec["threads"]))
    work = _work(spec)
    for fn in work.values():
        fn()
    print("ready", flush=True)
    steps = dict.fromkeys(work, 0)
    current, buf = "layer", b""
    while True:
        if select.select([0], [], [], 0)[0]:
            chunk = os.read(0, 4096)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            words = [ln.decode().strip() for ln in lines if ln.strip()]
            if "stop" in words:
                break
            current = next((w for w in reversed(words) if w in work), current)
        work[current]()
        steps[current] += 1
    print(json.dumps({"steps": steps}), flush=True)


class BackgroundLoad:
    """``n`` helper subprocesses running the calibration's kind of work (module docstring) while
    the calibrating process measures. A context manager: ``__enter__`` starts them and waits
    until each is ready, ``__exit__`` stops them (:meth:`stop`). ``n = 0``: does nothing.

    Args:
        n: helper processes (the job's card processes on this host minus the calibrating one).
        threads: torch threads of each helper (the job's threads per card process).
        dtype: ``"fp32"`` or ``"bf16"``. layer: ``(H, I, heads, kv_heads, micro_batch, seq)``.
        head: ``(vocab, hidden, tokens)``. adamw_params: fp32 parameters of the AdamW work.

    Attributes:
        pids: the helpers' process ids (set on start; tests check that none is left).
        steps: per helper, the steps it ran per work after it was ready (set by :meth:`stop`).
    """

    def __init__(self, n: int, *, threads: int, dtype: str, layer, head, adamw_params: int):
        self.n = max(0, int(n))
        self.spec = json.dumps({"threads": int(threads), "dtype": dtype, "layer": list(layer),
                                "head": list(head), "adamw_params": int(adamw_params)})
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []
        self.steps: list[Optional[dict]] = []
        self._errs: list = []

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start the helpers and wait until each printed ``ready``. Raises ``RuntimeError`` (the
        helpers stopped, with the failed one's stderr) when one exits or is not ready in time."""
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [env.get("PYTHONPATH")] if p])
        try:
            for _ in range(self.n):
                err = tempfile.TemporaryFile()
                self._errs.append(err)
                p = subprocess.Popen([sys.executable, "-c", _CODE, self.spec], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, env=env)
                self.procs.append(p)
                self.pids.append(p.pid)
            t_end = time.monotonic() + timeout
            for p, err in zip(self.procs, self._errs):
                ready = select.select([p.stdout], [], [], max(0.0, t_end - time.monotonic()))[0]
                line = p.stdout.readline() if ready else b""
                if line.strip() != b"ready":
                    err.seek(0)
                    tail = err.read().decode(errors="replace").strip()[-2000:]
                    raise RuntimeError(f"calibration load process {p.pid} not ready within {timeout:g} s"
                                       f" (exit {p.poll()}): {tail}")
        except BaseException:
            self.stop()
            raise

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
        records :attr:`steps`. Safe to call twice."""
        for p in self.procs:
            try:
                p.stdin.write(b"stop\n")
                p.stdin.flush()
            except OSError:
                pass
        steps = []
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=STOP_TIMEOUT_S)  # closes stdin, reads, waits
            except (subprocess.TimeoutExpired, OSError, ValueError):
                p.kill()
                p.wait()
                out = b""
            lines = [ln for ln in (out or b"").decode(errors="replace").splitlines() if ln.startswith("{")]
            steps.append(json.loads(lines[-1])["steps"] if lines else None)
        if self.procs:
            self.steps = steps
        self.procs = []
        for err in self._errs:
            err.close()
        self._errs = []

    def __enter__(self) -> "BackgroundLoad":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
