#!/usr/bin/env python
"""Plan vs measured for experiments/2026-12-02-fitted-figures.md: medians of steady steps (2..N).

Usage: fitted_vs_measured.py ROOT NAME... where ROOT holds NAME.log (launcher output; "plan*" names
are plan=true runs) and NAME/ (run dirs with metrics.jsonl)."""
import json, re, statistics, sys
from pathlib import Path

root = Path(sys.argv[1])
GIB = 2**30

def plan_of(log):
    text = Path(log).read_text()
    step = float(re.search(r"predicted: step ([\d.]+) s", text).group(1))
    mem = [float(m.split()[-11]) for m in re.findall(r"^cpu:\d.*$", text, re.M)]
    rates = re.search(r"^rates cpu.*$", text, re.M).group(0)
    return step, mem, rates

def measured(run):
    recs = [json.loads(l) for l in open(run / "metrics.jsonl") if l.strip()]
    steady = recs[1:]
    med = statistics.median(r["step_s"] for r in steady)
    comp = [statistics.median(r["compute_s_cards"][i] for r in steady) for i in range(2)]
    opt = statistics.median(r["optimizer_s"] for r in steady)
    peak = [max(r["mem_peak_bytes"][i] for r in recs) / GIB for i in range(2)]
    return med, comp, opt, peak, [round(r["step_s"], 2) for r in recs]

for name in sys.argv[2:]:
    p = root / name
    if (p.with_suffix(".log")).exists() and "plan" in name:
        s, m, r = plan_of(p.with_suffix(".log"))
        print(f"{name}: plan step {s:.2f} s, mem {m} GiB\n  {r}")
    elif (p / "metrics.jsonl").exists():
        med, comp, opt, peak, steps = measured(p)
        s, m, _ = plan_of(p.with_suffix(".log"))
        print(f"{name}: planned step {s:.2f} s / mem {m}; measured median step {med:.2f} s (steps {steps}), "
              f"compute {comp[0]:.2f}/{comp[1]:.2f} s, opt {opt:.2f} s, peak {peak[0]:.2f}/{peak[1]:.2f} GiB")
