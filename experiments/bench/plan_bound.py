#!/usr/bin/env python
"""Each card's peak memory per phase, sampled from outside, next to its plan (issue 43).

``python experiments/bench/plan_bound.py --run-dir DIR [--interval 0.1] [--json OUT] -- <launch/run.py overrides>``
runs ``launch/run.py <overrides> hydra.run.dir=DIR`` and samples ``/proc/<pid>/status`` of every card process
(``DIR/job.json``) every ``--interval`` s (0.1 s throughout, so the load too): ``RssAnon + RssShmem`` (what the
plan bounds) and ``VmHWM`` (the kernel's own peak RSS, file pages included). A sample's phase is the phase
the next ``run.log`` line ends: ``cards ready`` (the load), ``DPO reference pass`` (reference), ``eval after
step K`` (eval), ``step K/`` (steps), ``checkpoint step K saved`` (save); after the last line: ``exit``.
Prints per card: plan (``DIR/plan.json``), the peak of each phase, the run's peak and peak / plan; and
the cards' own report (``summary.json``'s ``phase_peak_mem_bytes``). ``--thread-name NAME`` (e.g. ``moe-blocks``,
the pool of the experts' concurrent blocks, ``npu_train.model.moe._pool``) also prints, per card, how many threads of
that name it ran and their CPU seconds (``/proc/<pid>/task/<tid>/stat`` utime + stime, read every second).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from memwatch import proc_status  # noqa: E402

G = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: run.log line -> the phase it ends (first match wins)
ENDS = ((re.compile(r"^cards ready"), "load"), (re.compile(r"^DPO reference pass"), "reference"),
        (re.compile(r"^eval after step"), "eval"), (re.compile(r"^step\s+\d+/"), "steps"),
        (re.compile(r"checkpoint step \d+ saved"), "save"))


class Sampler:
    """Samples the card processes of ``run_dir`` every ``interval`` s in a thread; remembers when each run.log
    line arrived."""

    def __init__(self, run_dir: str, interval: float, thread_name: str = ""):
        self.run_dir, self.interval, self.thread_name = run_dir, interval, thread_name
        self.named: dict = {}  # {card: {tid: CPU seconds}} of the threads named thread_name
        self.samples: list[tuple[float, dict]] = []  # (time, {card: (anon+shm, VmHWM)})
        self.lines: list[tuple[float, str]] = []
        self._pos = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _cards(self) -> dict:
        try:
            with open(os.path.join(self.run_dir, "job.json")) as f:
                return {int(c["pid"]): str(c["card"]) for c in json.load(f)["cards"]}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def _read_log(self, now: float) -> None:
        try:
            with open(os.path.join(self.run_dir, "run.log")) as f:
                f.seek(self._pos)
                text = f.read()
        except OSError:
            return
        cut = text.rfind("\n") + 1  # whole lines only
        self._pos += len(text[:cut].encode())
        self.lines += [(now, ln.strip()) for ln in text[:cut].splitlines() if ln.strip()]

    def _read_threads(self, cards: dict) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for pid, card in cards.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                if name == self.thread_name:  # rest[11], rest[12]: utime, stime (fields 14, 15)
                    self.named.setdefault(card, {})[tid] = (int(rest[11]) + int(rest[12])) / tick

    def _run(self) -> None:
        cards: dict = {}
        last = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            cards = cards or self._cards()
            if self.thread_name and now - last >= 1.0:
                self._read_threads(cards)
                last = now
            snap = {}
            for pid, card in cards.items():
                st = proc_status(pid)
                if st:
                    snap[card] = (st.get("RssAnon", 0) + st.get("RssShmem", 0), st.get("VmHWM", 0))
            if snap:
                self.samples.append((now, snap))
            self._read_log(now)
            self._stop.wait(self.interval)
        self._read_log(time.monotonic() + 1)

    def start(self) -> "Sampler":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def phases(self) -> dict:
        """``{card: {phase: peak anon+shm bytes, "run": peak, "hwm": last VmHWM}}``."""
        ends = [(t, name) for t, ln in self.lines for pat, name in ENDS if pat.search(ln)]
        out: dict = {}
        for t, snap in self.samples:
            phase = next((name for te, name in ends if te >= t), "exit")
            for card, (anon, hwm) in snap.items():
                d = out.setdefault(card, {})
                d[phase] = max(d.get(phase, 0), anon)
                d["run"] = max(d.get("run", 0), anon)
                d["hwm"] = max(d.get("hwm", 0), hwm)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--thread-name", default="", help="also count the CPU seconds of the cards' threads of this name")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    ov = a.overrides[1:] if a.overrides[:1] == ["--"] else a.overrides
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), *ov, f"hydra.run.dir={a.run_dir}"]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    s = Sampler(a.run_dir, a.interval, a.thread_name).start()
    rc = proc.wait()
    s.stop()
    with open(os.path.join(a.run_dir, "plan.json")) as f:
        plan = {st["card"]: int(st["mem"]["total"]) for st in json.load(f)["stages"]}
    try:
        with open(os.path.join(a.run_dir, "summary.json")) as f:
            summ = json.load(f)
    except OSError:
        summ = {}
    got = s.phases()
    order = ["load", "reference", "eval", "steps", "save", "exit"]
    print(f"exit code {rc}, {time.time() - t0:.0f} s, {len(s.samples)} samples every {a.interval} s")
    print(f"{'card':>6} {'plan':>6} " + " ".join(f"{p:>9}" for p in order) + f" {'run':>6} {'ratio':>6} {'VmHWM':>6}")
    for card, pl in plan.items():
        d = got.get(card, {})
        cells = " ".join(f"{d[p] / G:>9.2f}" if p in d else f"{'-':>9}" for p in order)
        print(f"{card:>6} {pl / G:>6.2f} {cells} {d.get('run', 0) / G:>6.2f} {d.get('run', 0) / pl:>6.2f} "
              f"{d.get('hwm', 0) / G:>6.2f}")
    own = summ.get("phase_peak_mem_bytes") or {}
    if own:
        print("cards' own report (summary.json phase_peak_mem_bytes, GiB): " + "; ".join(
            f"{ph} " + "/".join(f"{v / G:.2f}" for v in vals) for ph, vals in own.items()))
    if a.thread_name:
        print(f"threads named {a.thread_name!r}: " + ("; ".join(
            f"{card} {len(t)} thread(s), {sum(t.values()):.1f} CPU s" for card, t in sorted(s.named.items()))
            or "none seen"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": cmd, "exit_code": rc, "plan": plan, "outside": got, "cards_own": own,
                       "interval_s": a.interval, "samples": len(s.samples),
                       "named_threads_cpu_s": s.named}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
