"""Run a command and print per-process peak memory sampled from outside (tests/memwatch.py).

``python experiments/bench/memwatch.py [--run-dir DIR] [--interval S] [--load-interval S] -- <command...>``: a table
(pid, card, peak RssAnon+RssShmem, VmHWM, peak per phase, GiB) and one JSON line. ``--run-dir``
(the job's Hydra run dir) tags card processes (job.json) and phases (run.log).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from memwatch import MemWatch  # noqa: E402

G = 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--load-interval", type=float, default=None, help="seconds between samples while loading")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command after --")
    proc = subprocess.Popen(cmd)
    w = MemWatch(proc.pid, a.run_dir, a.interval, a.load_interval).start()
    rc = proc.wait()
    peaks = w.stop()
    print(f"{'pid':>8} {'card':>8} {'anon+shm':>9} {'VmHWM':>7}  per phase (anon+shm GiB)  command")
    for p in sorted(peaks.values(), key=lambda p: -p.anon_shared):
        phases = " ".join(f"{k}={v / G:.2f}" for k, v in p.by_phase.items())
        print(f"{p.pid:>8} {p.card or '-':>8} {p.anon_shared / G:>9.2f} {p.hwm / G:>7.2f}  {phases}  {p.cmd[:60]}")
    print(json.dumps({"exit_code": rc, "processes": [
        {"pid": p.pid, "card": p.card, "anon_shared_bytes": p.anon_shared, "hwm_bytes": p.hwm,
         "by_phase": p.by_phase, "cmd": p.cmd} for p in peaks.values()]}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
