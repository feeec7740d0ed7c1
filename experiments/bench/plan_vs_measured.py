#!/usr/bin/env python
"""Placement model vs measurement: run short jobs and compare predicted and measured memory/time.

For every layout the job runs as a subprocess (``launch/run.py ... train.steps=N
hydra.run.dir=<tmp> placement.profile=<profile>``); its ``metrics.jsonl`` gives per step and card
the measured peak memory (``mem_peak_bytes``; on cpu the process RSS sampled at backend calls)
and the plan's prediction (``mem_pred_bytes``), the step time (``step_s``) and the plan's
(``step_s_pred``). The table shows, per layout and card:

    predicted GiB | measured peak GiB (max over steps) | ratio measured/predicted
    predicted step s | measured mean step s (steps 2..N; step 1 allocates the AdamW moments and
    warms up) | ratio

First the machine is calibrated (``npu_train.calibrate.main_calibrate``, profile written to
the output directory) unless ``--profile`` names an existing profile. ``--auto`` instead checks
what a user gets without any manual step: no ``placement.profile`` and a cache of its own
(``<out-dir>/cache``, the rest of ``$NPT_CACHE`` linked in), so the first job plans from the
assumed figures and later ones from the figures fitted from the finished jobs. Ratios only, no assertions.
On a shared machine other processes slow the cpu "cards" down (an OpenMP team with a
descheduled thread stalls), so for each job the CPU used by *other* processes is reported
("others", in cores: the machine's busy time from ``/proc/stat`` minus the job's own CPU time);
``--wait-idle PCT`` waits for a quiet machine before each job.

Usage (from the repository root)::

    .venv/bin/python experiments/bench/plan_vs_measured.py                  # calibrate + all layouts
    .venv/bin/python experiments/bench/plan_vs_measured.py --profile ~/.cache/npu-train/calibration/cpu.json \\
        --layouts default single --steps 4 --out /tmp/pvm.json
    .venv/bin/python experiments/bench/plan_vs_measured.py --auto --layouts default   # fitted figures
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import linked_cache, wait_idle  # noqa: E402

GIB = 2 ** 30

#: layout name -> extra launcher overrides (the default job is SmolLM2-135M, seq 128, micro-batch 2,
#: accumulation 4, fp32, backend=cpu,cpu)
LAYOUTS: dict[str, list[str]] = {
    "default": [],
    "single": ["backend=cpu"],
    "three": ["backend=cpu,cpu,cpu"],
    "offload": ["train.resident_layers=0"],
    "mb4-s64": ["train.micro_batch=4", "data.seq_len=64"],
}


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (user + system + irq, from /proc/stat)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def children_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_layout(name: str, overrides: list[str], profile: Optional[str], steps: int, out_dir: Path,
               python: str, timeout: float, keep: bool = False, env: Optional[dict] = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / name
    log = out_dir / f"{name}.log"
    cmd = [python, str(ROOT / "launch" / "run.py"), f"train.steps={steps}",
           f"hydra.run.dir={run_dir}", *([f"placement.profile={profile}"] if profile else []),
           *overrides]
    la0, t0, busy0, own0 = loadavg(), time.time(), busy_seconds(), children_seconds()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env=env)
    wall = time.time() - t0
    other = max(0.0, (busy_seconds() - busy0) - (children_seconds() - own0))
    cores = os.cpu_count() or 1
    res = {"layout": name, "overrides": overrides, "cmd": " ".join(cmd), "rc": proc.returncode,
           "wall_s": round(wall, 1), "loadavg_before": la0, "loadavg_after": loadavg(),
           # CPU used by *other* processes during the job, in cores (machine total minus the job)
           "other_cores": round(other / wall, 2), "cores": cores, "log": str(log)}
    if not keep:  # the final checkpoint (~2 GB for the default job) is not needed here
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        res["error"] = log.read_text()[-3000:]
        return res
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    n_cards = len(recs[0]["mem_peak_bytes"])
    res["steps"] = [{k: r.get(k) for k in ("step", "step_s", "compute_s", "optimizer_s",
                                          "transfer_s", "idle_s", "mem_peak_bytes")} for r in recs]
    res["pred_mem_bytes"] = recs[0].get("mem_pred_bytes") or [None] * n_cards
    res["meas_mem_bytes"] = [max(r["mem_peak_bytes"][i] for r in recs) for i in range(n_cards)]
    later = recs[1:] or recs
    res["pred_step_s"] = recs[0].get("step_s_pred")
    res["meas_step_s"] = sum(r["step_s"] for r in later) / len(later)
    res["plan"] = [ln for ln in log.read_text().splitlines()
                   if ln.startswith(("cpu", "card ", "total ", "predicted:", "rates ", "calibrating",
                                     "warning: the machine"))][:10]
    return res


def fmt_table(results: list[dict]) -> str:
    head = (f"{'layout':<9} {'card':<5} {'pred GiB':>8} {'meas GiB':>8} {'ratio':>6}   "
            f"{'pred s':>7} {'meas s':>7} {'ratio':>6}   {'others':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['layout']:<9} FAILED (rc {r['rc']}), see {r['log']}")
            continue
        for i, (p, m) in enumerate(zip(r["pred_mem_bytes"], r["meas_mem_bytes"])):
            first = i == 0
            ts = (f"{r['pred_step_s']:7.2f} {r['meas_step_s']:7.2f} "
                  f"{r['meas_step_s'] / r['pred_step_s']:6.2f}" if first and r["pred_step_s"]
                  else " " * 22)
            la = f"{r['other_cores']:.2f}" if first else ""
            lines.append(f"{r['layout'] if first else '':<9} {i:<5} {p / GIB:8.2f} {m / GIB:8.2f} "
                         f"{m / p:6.2f}   {ts}   {la:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="existing calibration profile (default: calibrate first)")
    ap.add_argument("--auto", action="store_true",
                    help="no profile: figures fitted from the finished jobs, in <out-dir>/cache")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out-dir", help="where run dirs and logs go (default: a new temp dir)")
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--wait-idle", type=float, metavar="PCT",
                    help="before each job wait until the machine's CPU use is below PCT %%")
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds, for --wait-idle")
    ap.add_argument("--retry-if-others", type=float, metavar="CORES",
                    help="rerun a job (up to --tries times) while other processes used more than "
                         "CORES cores during it; the table shows the least disturbed attempt, "
                         "the JSON keeps all")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep each job's final checkpoint (deleted by default)")
    args = ap.parse_args(argv)

    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="plan-vs-measured-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"output: {out_dir}", flush=True)
    env = None
    if args.auto:
        env = dict(os.environ, NPT_CACHE=str(linked_cache(out_dir / "cache")))
        profile = None
        print(f"profile: none; figures fitted from the jobs into {env['NPT_CACHE']}/fitted", flush=True)
    elif args.profile:
        profile = str(Path(args.profile).expanduser())
        print(f"profile: {profile} (existing)", flush=True)
    else:
        from npu_train.calibrate import main_calibrate

        if args.wait_idle is not None:
            wait_idle(args.wait_idle, args.max_wait)

        profile = main_calibrate(["cpu"], model_path="embedded",
                                 profile=out_dir / "cpu-calibration.json")[0]
    prof = json.loads(Path(profile).read_text()) if profile else {}
    if prof:
        print(f"machine: {json.dumps(prof.get('machine', {}))}", flush=True)

    results = []
    for name in args.layouts:
        print(f"\n== {name}: {' '.join(LAYOUTS[name]) or '(default job)'}", flush=True)
        attempts = []
        for k in range(max(1, args.tries if args.retry_if_others is not None else 1)):
            if args.wait_idle is not None:
                wait_idle(args.wait_idle, args.max_wait)
            a = run_layout(name, LAYOUTS[name], profile, args.steps, out_dir / f"try{k}",
                           args.python, args.timeout, args.keep_checkpoints, env)
            attempts.append(a)
            if "error" not in a:
                print(f"   attempt {k + 1}: steps " + ", ".join(f"{s['step_s']:.2f}s" for s in a["steps"])
                      + f"; other processes used {a['other_cores']} cores", flush=True)
            if args.retry_if_others is None or a.get("other_cores", 0) <= args.retry_if_others:
                break
        ok = [a for a in attempts if "error" not in a] or attempts
        r = dict(min(ok, key=lambda a: a.get("other_cores", 0)))
        r["attempts"] = [{k: a.get(k) for k in ("other_cores", "meas_step_s", "meas_mem_bytes",
                                                "rc", "log")} for a in attempts]
        results.append(r)
        for ln in r.get("plan", []):
            print("   " + ln)
        if "error" in r:
            print(f"   FAILED rc={r['rc']}: {r['error'][-800:]}")
        else:
            print(f"   steps: " + ", ".join(f"{s['step_s']:.2f}s" for s in r["steps"])
                  + f"; wall {r['wall_s']} s; load {r['loadavg_before']} -> {r['loadavg_after']}; "
                  f"other processes used {r['other_cores']} of {r['cores']} cores",
                  flush=True)
    print("\npredicted vs measured (ratio = measured / predicted; memory = peak per card over all "
          f"steps; step time = mean of steps 2..{args.steps}; others = cores used by other "
          "processes during the job)")
    print(fmt_table(results))
    if args.auto:
        for f in sorted((Path(env["NPT_CACHE"]) / "fitted").glob("*.json")):
            print(f"fitted figures: {f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": profile, "calibration": prof,
                                              "results": results}, indent=1))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
