#!/usr/bin/env python
"""What the automatic first-run calibration costs a user: the default job launched twice on one
cache root, first without a calibration profile (it calibrates), then with the profile it cached.

The user-visible cost is the difference of the two launches' time from start to the ``job ...``
line (printed when the launcher hands over to the card processes; everything after it is the
same in both launches) and, as a check, to the first step's line minus that step's own time (the
first step started). The calibration's own seconds (``details.auto.seconds`` of the profile) and
the machine's load average before and after each launch are printed with them.

Each round uses a fresh cache root ``<out-dir>/cache-<round>`` with the user's cache entries
(tokenized data, tokenizers, tensors) linked in except ``calibration``, so only the calibration
differs between the two launches of a round. ``NPT_CALIBRATE`` is removed from the environment.

Usage (from the repository root)::

    .venv/bin/python experiments/bench/first_run_cost.py --rounds 2 --out-dir /tmp/first-run \\
        [--wait-idle 30 --max-wait 600] [--python /path/to/python] [-- extra launcher overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import linked_cache, wait_idle  # noqa: E402


def launch(python: str, cache: Path, run_dir: Path, extra: list[str]) -> dict:
    """One launch of ``launch/run.py train.steps=1``: seconds from start to the ``calibrating``,
    ``job`` and first-step lines, the first step's own seconds, the load average around it."""
    env = {k: v for k, v in os.environ.items() if k != "NPT_CALIBRATE"}
    env["NPT_CACHE"] = str(cache)
    cmd = [python, str(ROOT / "launch" / "run.py"), "train.steps=1", f"hydra.run.dir={run_dir}", *extra]
    out: dict = {"load_before": round(os.getloadavg()[0], 2)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    for line in proc.stdout:
        t = time.monotonic() - t0
        lines.append(f"{t:7.2f}  {line.rstrip()}")
        if line.startswith("calibrating ") and "t_calibrating" not in out:
            out["t_calibrating"] = round(t, 2)
        elif line.startswith("job ") and "t_job" not in out:
            out["t_job"] = round(t, 2)
        elif line.lstrip().startswith("step") and "t_step1" not in out:
            out["t_step1"] = round(t, 2)
    out["rc"] = proc.wait()
    out["t_exit"] = round(time.monotonic() - t0, 2)
    out["load_after"] = round(os.getloadavg()[0], 2)
    (run_dir / "launch.log").write_text("\n".join(lines) + "\n")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~2 GB per launch, not needed
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        steps = [r for r in recs if "step_s" in r]
        if steps and "t_step1" in out:
            out["step1_s"] = round(float(steps[0]["step_s"]), 2)
            out["t_step1_started"] = round(out["t_step1"] - out["step1_s"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--wait-idle", type=float, default=100.0,
                    help="before each launch, wait until the machine's CPU use is at most this percent")
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for --wait-idle at most")
    ap.add_argument("extra", nargs="*", help="launcher overrides (after --)")
    a = ap.parse_args()
    print(f"machine: {os.cpu_count()} cpu(s), {os.uname().nodename}, python {a.python}", flush=True)
    results = []
    for r in range(a.rounds):
        cache = linked_cache(a.out_dir / f"cache-{r}")
        row = {}
        for which in ("first", "cached"):
            run_dir = a.out_dir / f"run-{r}-{which}"
            run_dir.mkdir(parents=True, exist_ok=True)
            pct = wait_idle(a.wait_idle, a.max_wait, interval_s=5.0) if a.wait_idle < 100 else None
            row[which] = launch(a.python, cache, run_dir, a.extra)
            row[which]["cpu_pct_before"] = pct
            print(f"round {r} {which}: {json.dumps(row[which])}", flush=True)
        prof = cache / "calibration" / "cpu.json"
        if prof.is_file():
            det = json.loads(prof.read_text()).get("details", {})
            row["calibration_seconds"] = (det.get("auto") or {}).get("seconds")
            row["others_cores"] = det.get("others_cores")
        if "t_job" in row["first"] and "t_job" in row["cached"]:
            row["cost_to_job_s"] = round(row["first"]["t_job"] - row["cached"]["t_job"], 2)
        if "t_step1_started" in row["first"] and "t_step1_started" in row["cached"]:
            row["cost_to_step1_s"] = round(row["first"]["t_step1_started"] - row["cached"]["t_step1_started"], 2)
        print(f"round {r}: cost to the job line {row.get('cost_to_job_s')} s, to step 1 started "
              f"{row.get('cost_to_step1_s')} s; calibration's own seconds {row.get('calibration_seconds')}; "
              f"others during calibration {row.get('others_cores')} cores", flush=True)
        results.append(row)
    (a.out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
