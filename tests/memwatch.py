"""Sample a process tree's memory from outside: per process peak anonymous + shared RSS and VmHWM.

:class:`MemWatch` polls ``/proc/<pid>/status`` of a root pid and its descendants every ``interval`` s
in a thread. A process is tagged with its card (``<run dir>/job.json``'s ``cards[].pid``) and every
sample with the job's phase, the last phase line of ``<run dir>/run.log`` (:data:`PHASES`).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil

#: run.log line pattern -> phase name (the last match seen tags a sample; after the line ``step N/M`` the
#: phase is ``after step N``: the next step, or the save that follows step N)
PHASES = ((re.compile(r"^step\s+(\d+)/"), "after step {0}"), (re.compile(r"checkpoint step (\d+) saved"), "after save {0}"),
          (re.compile(r"^eval after"), "eval"), (re.compile(r"resuming from"), "resume"))


def proc_status(pid: int) -> Optional[dict]:
    """``RssAnon``, ``RssShmem``, ``VmHWM`` of ``pid`` in bytes (from ``/proc/<pid>/status``), None if gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssShmem", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    return out


@dataclass
class ProcPeak:
    """One process's peaks (bytes): ``anon_shared`` = max(RssAnon + RssShmem), ``hwm`` = last VmHWM."""
    pid: int
    cmd: str
    card: Optional[str] = None
    anon_shared: int = 0
    hwm: int = 0
    by_phase: dict = field(default_factory=dict)  # phase -> peak anon+shared bytes


class MemWatch:
    """Poll ``root`` and its descendants until :meth:`stop`; ``peaks`` maps pid -> :class:`ProcPeak`."""

    def __init__(self, root: int, run_dir: Optional[str] = None, interval: float = 0.2,
                 load_interval: Optional[float] = None):
        """``interval`` s between samples; ``load_interval`` s while the phase is ``load`` (the model load's
        peak is short-lived: a tensor read in fp32 beside the weights), None: ``interval``."""
        self.root, self.run_dir, self.interval = root, run_dir, interval
        self.load_interval = load_interval
        self.peaks: dict[int, ProcPeak] = {}
        self.phase = "load"
        self._log_pos = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "MemWatch":
        self._thread.start()
        return self

    def stop(self) -> dict[int, ProcPeak]:
        self._stop.set()
        self._thread.join()
        return self.peaks

    def set_phase(self, phase: str) -> None:
        """Tag later samples with ``phase`` (a test's own phases: load, save, export ...)."""
        self.phase = phase

    def _cards(self) -> dict[int, str]:
        try:
            with open(os.path.join(self.run_dir, "job.json")) as f:
                return {int(c["pid"]): str(c["card"]) for c in json.load(f)["cards"]}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def _read_phase(self) -> None:
        try:
            with open(os.path.join(self.run_dir, "run.log")) as f:
                f.seek(self._log_pos)
                text = f.read()
                self._log_pos = f.tell()
        except OSError:
            return
        for line in text.splitlines():
            for pat, name in PHASES:
                m = pat.search(line.strip())
                if m:
                    self.phase = name.format(*m.groups())
            if "interrupt" in line:
                self.phase = "interrupt save"

    def sample(self) -> None:
        """One sample of every live process of the tree."""
        cards = self._cards() if self.run_dir else {}
        if self.run_dir:
            self._read_phase()
        try:
            procs = [psutil.Process(self.root)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            st = proc_status(p.pid)
            if st is None:
                continue
            pk = self.peaks.get(p.pid)
            if pk is None:
                try:
                    cmd = " ".join(p.cmdline())[:120]
                except psutil.Error:
                    cmd = "?"
                pk = self.peaks[p.pid] = ProcPeak(p.pid, cmd)
            pk.card = cards.get(p.pid, pk.card)
            now = st.get("RssAnon", 0) + st.get("RssShmem", 0)
            pk.anon_shared = max(pk.anon_shared, now)
            pk.hwm = max(pk.hwm, st.get("VmHWM", 0))
            pk.by_phase[self.phase] = max(pk.by_phase.get(self.phase, 0), now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            fast = self.load_interval is not None and self.phase == "load"
            self._stop.wait(self.load_interval if fast else self.interval)
        self.sample()

    def card_peaks(self) -> dict[str, ProcPeak]:
        """Card name -> its process's peaks (card processes only)."""
        return {p.card: p for p in self.peaks.values() if p.card}
