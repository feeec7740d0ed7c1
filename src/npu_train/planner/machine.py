"""What a calibration profile records about the machine it was measured on, and whether a cached
profile still describes this machine (:func:`machine_info`, :func:`fingerprint`,
:func:`same_machine`); how much CPU other processes used meanwhile (:func:`cpu_snapshot`,
:func:`others_cores`).

A profile's rates are this machine's only while the things that set them are the same: the CPU
(model name *and* instruction-set flags: two VMs both called "AMD EPYC" may differ by AVX-512,
which moves fp32/bf16 FLOP/s by 1.4x to 50x), the usable cores, the torch version, and for
accelerator kinds the device name. The hostname is recorded but not compared (a Kubernetes pod's
hostname changes on every restart while its hardware does not).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import socket
import time
from typing import Optional

from npu_train.planner.threads import usable_cores

__all__ = ["cpu_model", "cpu_flags_digest", "machine_info", "fingerprint", "same_machine",
           "FINGERPRINT_KEYS", "cpu_snapshot", "others_cores"]

#: machine-record keys that must match for a cached profile to be reused (``device``: cuda/furiosa)
FINGERPRINT_KEYS = ("cpu_model", "cpu_flags", "cores_usable", "torch", "device")


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo``'s ``model name``, else ``platform``'s), for machine records."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags_digest() -> str:
    """First 12 hex digits of the SHA-256 of the first CPU's sorted ``/proc/cpuinfo`` flags
    (``flags`` on x86, ``Features`` on ARM); ``""`` where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    return hashlib.sha256(flags.encode()).hexdigest()[:12]
    except OSError:
        pass
    return ""


def machine_info(kind: Optional[str] = None, backend=None) -> dict:
    """Facts recorded with a profile: cpu model and flags digest, cores, RAM, torch / python
    versions, date, load average, and the device name for cuda / furiosa."""
    import psutil
    import torch

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags_digest(),
        "cores_logical": os.cpu_count(),
        "cores_usable": usable_cores(),
        "cores_physical": psutil.cpu_count(logical=False),
        "ram_bytes": int(psutil.virtual_memory().total),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["npu_train"] = version("npu-train")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        pass
    if kind == "cuda":
        try:
            info["device"] = torch.cuda.get_device_name(backend.index if backend else 0)
        except Exception:  # noqa: BLE001
            pass
    if kind == "furiosa":
        try:
            info["device"] = str(backend.device()) if backend is not None else "furiosa"
        except Exception:  # noqa: BLE001
            pass
    return info


def fingerprint(info: dict) -> dict:
    """The :data:`FINGERPRINT_KEYS` entries of a machine record (those present)."""
    return {k: info[k] for k in FINGERPRINT_KEYS if k in info}


def same_machine(recorded: dict, here: dict) -> list[str]:
    """Differences between a profile's machine record and this machine's fingerprint, as
    ``"<key> <recorded> != <here>"`` strings (empty: same machine). A key missing from the record
    (profiles written before it was recorded) is not compared, except ``cpu_model`` and ``torch``,
    which every profile has; a ``device`` known here but missing there is a difference."""
    diff = []
    for k in FINGERPRINT_KEYS:
        if k not in here:
            continue
        if k not in recorded:
            if k in ("cpu_model", "torch", "device"):
                diff.append(f"{k} not recorded")
            continue
        if str(recorded[k]) != str(here[k]):
            diff.append(f"{k} {recorded[k]} != {here[k]}")
    return diff


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, CPU seconds of the whole machine, CPU seconds of this process, its waited-for
    children and its running ones (the calibration's helpers, started before the first
    snapshot)) now; two snapshots give :func:`others_cores`."""
    import psutil

    t = psutil.cpu_times()
    machine = sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = os.times()
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            ct = child.cpu_times()
            live += ct.user + ct.system
        except psutil.Error:
            pass
    return time.monotonic(), machine, own.user + own.system + own.children_user + own.children_system + live


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores other processes used on average between two :func:`cpu_snapshot` s: the machine's
    CPU time minus this process's (and its children's), divided by the wall time."""
    wall = max(after[0] - before[0], 1e-9)
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall
