"""The cpu process baseline: RSS of a fresh card-like process before it holds model state.

A card process imports torch and the trainer's modules, sets up its backend, a ZeroMQ context and
a one-rank gloo process group and opens the model file before it allocates anything of the
model; that memory (``Rates.process_baseline_bytes``, ~0.5 GiB on cpu) is part of every card's
prediction. It is measured in a fresh interpreter that does exactly that
(:data:`PROCESS_BASELINE_SOURCE`, run by :func:`measure_process_baseline`) and reports its RSS; a
GGUF reader stays cached in the card process with its parsed metadata and memory-mapped file, so
its pages are touched too (an upper bound: a stage touches only its own tensors' pages).
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
    "npu_train.model", "npu_train.data.dataset", "npu_train.checkpoint.store",
    "npu_train.transport",
)

#: Python source defining ``process_baseline(argv) -> {"rss": bytes, "touched": bytes}``; argv:
#: threads, comma-separated modules, [model path] (:func:`baseline_argv`). Everything is imported
#: inside the function, so the process holds only what a card process holds when it measures. A
#: GGUF file's pages are touched through a memory map of the whole file, as the card process's
#: cached reader maps it (same RSS).
PROCESS_BASELINE_SOURCE = r'''
def process_baseline(argv):
    import gc, importlib, os, socket
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
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0)); port = so.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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
    """The arguments of ``process_baseline`` (:data:`PROCESS_BASELINE_SOURCE`): threads, the
    comma-joined ``modules``, and ``model_path`` when given. Raises ``ValueError`` when a module
    name contains a comma."""
    mods = [str(m) for m in modules]
    if any("," in m for m in mods):
        raise ValueError(f"module names must not contain commas: {mods}")
    return [str(int(threads)), ",".join(mods)] + ([str(model_path)] if model_path else [])


def subprocess_env() -> dict:
    """This process's environment with the package's ``src`` directory first on ``PYTHONPATH``
    (for ``sys.executable -c`` subprocesses that import ``npu_train``)."""
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
    """RSS (bytes) of a fresh card-like process before model state (module docstring).

    Args:
        model_path: the job's ``model.path`` (its file is opened and, for GGUF, its pages
            touched, as a card process does); ``None``: imports and runtime only.
        threads: torch threads of the process.
        timeout: seconds before the subprocess is killed.
        modules: the modules a card process imports (default :data:`CARD_PROCESS_MODULES`);
            the runtime passes its own list, which names its card-process module.

    Runs ``sys.executable`` with ``src`` on ``PYTHONPATH``.

    Raises:
        RuntimeError: the subprocess failed (with its stderr).
        ValueError: a module name contains a comma.
    """
    return _run_baseline(model_path, threads, modules, timeout)
