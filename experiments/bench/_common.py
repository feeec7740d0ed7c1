"""Helpers shared by the side-by-side benchmarks in ``experiments/bench/`` (not part of the package).

- :func:`machine_info`: CPU model, usable cores, torch version, load average, GPU name.
- :func:`pin_self` / :func:`pin_pid_tree`: pin a process (all its threads) to one core with
  ``os.sched_setaffinity``. Linux applies an affinity mask per *thread*; a thread inherits the mask
  of the thread that creates it, so pinning a process before it starts threads (``pin_self`` at
  the top of a worker, before ``import torch``) pins every later thread, while pinning a running
  process from outside (``pin_pid_tree``) must visit every ``/proc/PID/task/TID`` and be repeated
  while the process still creates threads.
- :func:`core_for`: the core of process ``rank`` (round-robin over the usable cores, so with
  more processes than cores two processes share a core; the scripts print when that happens).
- :func:`spread`: median, min and max of a list of numbers.
"""
from __future__ import annotations

import json
import os
import platform
import socket
from statistics import median
from pathlib import Path
from typing import Optional



def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def core_for(rank: int, cores: Optional[list[int]] = None) -> int:
    """Core for process ``rank``: ``cores[rank % len(cores)]`` (round-robin)."""
    cores = cores or usable_cores()
    return cores[rank % len(cores)]


def pin_self(core: int) -> None:
    """Pin the calling thread (call it first thing in a new process, before threads exist)."""
    os.sched_setaffinity(0, {int(core)})


def pin_pid_tree(pid: int, core: int) -> int:
    """Pin every thread of process ``pid`` to ``core``; returns the number of threads pinned
    (0 when the process is gone). Idempotent: call it repeatedly while the process starts threads."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {int(core)})
            n += 1
        except OSError:  # thread exited meanwhile
            pass
    return n


def machine_info(device: str = "cpu") -> dict:
    """What the figures were measured on: CPU model, logical CPUs, usable cores (affinity), torch
    version, 1-minute load average at the start, and the GPU's name when ``device`` is cuda."""
    import torch

    from npu_train.calibrate.profile import cpu_model  # the calibration profile's record of the CPU

    info = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cores": usable_cores(),
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "host": platform.node()}
    if device.startswith("cuda"):
        try:
            info["gpu"] = torch.cuda.get_device_name(0)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            info["gpu"] = f"unavailable: {e}"
    return info


def print_machine(info: dict) -> None:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    print(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, usable cores {info['usable_cores']}, "
          f"torch {info['torch']}, python {info['python']}, load {info['loadavg_1m']}{gpu}", flush=True)


def spread(xs: list[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of ``xs`` (None entries dropped; all None -> n = 0)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_json(path: Optional[str], obj, quiet: bool = False) -> None:
    """Write ``obj`` to ``path`` (nothing when ``path`` is None) through a temporary file and a rename,
    so a reader (or a bench killed by its time limit) never sees half a file."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        os.replace(tmp, path)
        if not quiet:
            print(f"results written to {path}", flush=True)


def linked_cache(root) -> Path:
    """``root`` (created) with the user's npu-train cache entries linked in, except ``calibration``:
    a cache where the data is ready and the first-run calibration happens again."""
    from npu_train.env import cache_root

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    user = cache_root()
    if user.is_dir():
        for entry in user.iterdir():
            if entry.name != "calibration" and not (root / entry.name).exists():
                (root / entry.name).symlink_to(entry)
    return root


def wait_idle(max_pct: float, max_wait_s: float, interval_s: float = 3.0) -> float:
    """Wait (at most ``max_wait_s`` seconds) until the machine's CPU use over ``interval_s`` seconds
    is at most ``max_pct`` percent; returns the last reading (percent)."""
    import time

    import psutil

    t_end = time.time() + max_wait_s
    while True:
        pct = psutil.cpu_percent(interval=interval_s)
        if pct <= max_pct or time.time() > t_end:
            return pct
        print(f"   machine busy ({pct:.0f}% CPU), waiting ...", flush=True)
