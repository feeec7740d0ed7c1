"""CPU backend: the host as a "card". Memory figures are the process's anonymous + shared RSS, the peak
sampled at every backend call (a spike between calls can be missed)."""

from __future__ import annotations

import threading

import psutil
import torch

from npu_train.backends.base import Backend


class CPUBackend(Backend):
    kind = "cpu"
    memory_accounting = "rss"

    def __init__(self) -> None:
        super().__init__(None)
        self.memory_flag_thread_local = True  # no device-memory-type flag at all
        self._proc = psutil.Process()
        self._peak = 0
        self._peak_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_proc"] = None
        state["_peak_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._proc = psutil.Process()
        self._peak_lock = threading.Lock()

    def _resident(self) -> int:
        """Anonymous + shared resident bytes (``RssAnon + RssShmem`` of ``/proc/self/status``): what the plan
        bounds; file pages (libraries, mapped model files) are not counted. Elsewhere: ``psutil`` RSS."""
        try:
            with open("/proc/self/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if line.startswith((b"RssAnon", b"RssShmem")))
            return sum(int(v.split()[0]) for v in fields.values()) * 1024
        except (OSError, ValueError):
            return int(self._proc.memory_info().rss)

    def _sample(self) -> int:
        rss = self._resident()
        if rss > self._peak:
            with self._peak_lock:
                if rss > self._peak:
                    self._peak = rss
        return rss

    def device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        self._sample()

    def capacity_bytes(self) -> int:
        """Total host RAM (``psutil.virtual_memory().total``)."""
        return int(psutil.virtual_memory().total)

    def memory_allocated(self) -> int:
        """Anonymous + shared resident memory of this process (bytes, :meth:`_resident`)."""
        return self._sample()

    def max_memory_allocated(self) -> int:
        """Largest RSS sampled since the last :meth:`reset_peak_memory`."""
        return max(self._peak, self._sample())

    def reset_peak_memory(self) -> None:
        rss = self._resident()
        with self._peak_lock:
            self._peak = rss

    def _upload(self, t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        # .to("cpu") would alias a host tensor; clone so that upload never shares memory.
        out = t.clone() if t.device.type == "cpu" else t.to("cpu")
        self._sample()
        return out

    def _download(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone() if t.device.type == "cpu" else t.to("cpu")
        self._sample()
        return out
