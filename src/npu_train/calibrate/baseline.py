"""The cpu process baseline (``Rates.process_baseline_bytes``, ~0.5 GiB): RSS of a fresh card-like process
(torch and the trainer's modules imported, backend, ZeroMQ, one-rank gloo group, model file opened and,
for GGUF, its pages touched: an upper bound) before it holds model state.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["CARD_PROCESS_MODULES", "measure_process_baseline"]

#: Modules a card process imports before it allocates model state, all below the planner's
#: layer (the runtime passes its own list, which adds its card-process module).
CARD_PROCESS_MODULES: tuple[str, ...] = (
    "npu_train.backends", "npu_train.optim.adamw", "npu_train.optim.lr",
    "npu_train.pipeline.schedule", "npu_train.pipeline.stage", "npu_train.model.llama",
    "npu_train.model", "npu_train.data.packfile", "npu_train.data.batches", "npu_train.checkpoint.store",
    "npu_train.transport",
)

#: Python source defining ``process_baseline(argv) -> {"rss": bytes, "touched": bytes}``; argv:
#: threads, comma-separated modules, [model path] (:func:`baseline_argv`). Everything is imported
#: inside the function, so the process holds only what a card process holds when it measures. A
#: GGUF file's pages are touched through a memory map of the whole file, as the card process's
#: cached reader maps it (same RSS).
PROCESS_BASELINE_SOURCE = r'''
def process_baseline(argv):
    import gc, importlib, os
    import psutil
    import torch
    torch.set_num_threads(int(argv[0]))
    import msgpack, zmq
    import torch.distributed as dist
    for name in filter(None, argv[1].split(",")):
        importlib.import_module(name)
    from npu_train.backends import make_backend
    be = make_backend("cpu"); be.setup()
    x = torch.ones(64, 64); (x @ x).sum()             # first op: thread pools, kernels
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)  # a port picked at the bind: no race
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    t = torch.ones(4); dist.all_reduce(t)
    path = argv[2] if len(argv) > 2 else ""
    touched = 0
    if path:
        from npu_train.model import load_config, resolve_model_path
        p = resolve_model_path(path)
        load_config(p)                                  # a GGUF reader stays cached with its metadata
        if os.path.isfile(p):
            with open(p, "rb") as f:
                gguf = f.read(4) == b"GGUF"
            if gguf:
                import numpy as np
                data = np.memmap(p, dtype=np.uint8, mode="r")
                step = data[::4096]
                touched = int(step.size) * 4096 if int(np.add.reduce(step, dtype=np.uint64)) >= 0 else 0
    gc.collect()
    rss = psutil.Process().memory_info().rss
    dist.destroy_process_group()
    s.close(0); ctx.term()
    return {"rss": rss, "touched": touched}
'''

_STANDALONE = PROCESS_BASELINE_SOURCE + "\nimport json, sys\nprint(json.dumps(process_baseline(sys.argv[1:])))\n"


def baseline_argv(model_path: Optional[str] = None, threads: int = 1,
                  modules: Sequence[str] = CARD_PROCESS_MODULES) -> list[str]:
    """Arguments of :data:`PROCESS_BASELINE_SOURCE`. Raises ValueError for a module name with a comma."""
    mods = [str(m) for m in modules]
    if any("," in m for m in mods):
        raise ValueError(f"module names must not contain commas: {mods}")
    return [str(int(threads)), ",".join(mods)] + ([str(model_path)] if model_path else [])


def subprocess_env() -> dict:
    """This environment with the package's ``src`` first on ``PYTHONPATH`` (for ``-c`` subprocesses)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_baseline(model_path: Optional[str], threads: int, modules: Sequence[str], timeout: float) -> int:
    """RSS bytes the process-baseline subprocess reports (killed after ``timeout`` seconds)."""
    args = [sys.executable, "-c", _STANDALONE, *baseline_argv(model_path, threads, modules)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"process-baseline measurement took more than {timeout:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"process-baseline measurement failed (exit {proc.returncode}): "
                           f"{err.strip()[-2000:]}")
    line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
    return int(json.loads(line)["rss"])


def measure_process_baseline(model_path: Optional[str] = None, threads: int = 1,
                             timeout: float = 120.0,
                             modules: Sequence[str] = CARD_PROCESS_MODULES) -> int:
    """RSS (bytes) of a fresh card-like process before model state, run as ``sys.executable`` with ``threads``
    torch threads, importing ``modules`` (default :data:`CARD_PROCESS_MODULES`) and opening ``model_path``
    (None: imports only). Raises RuntimeError (subprocess failed, with stderr; or ``timeout`` s passed)
    and ValueError (a module name with a comma)."""
    return _run_baseline(model_path, threads, modules, timeout)
