#!/usr/bin/env bash
# One traced project run of a tree, with per-action medians over steps 2..8 (an A/B of two trees:
# run it alternately for each; record: experiments/2026-12-01-bench-run8.md, sections 2-3).
#   bash experiments/scripts/trace_ab.sh <tree> <label> [launcher overrides...]
#   e.g. git worktree add /tmp/wt-before <commit>; cp experiments/bench/pipeline.py /tmp/wt-before/experiments/bench/
#        bash experiments/scripts/trace_ab.sh /tmp/wt-before BEFORE 'train.split=[19,11]'
#        bash experiments/scripts/trace_ab.sh "$PWD" AFTER 'train.split=[19,11]'
set -euo pipefail
tree=$1; label=$2; shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/trace-ab.XXXXXX)
cd "$tree"
PYTHONPATH="$tree/src" TMPDIR="$work" "$here/.venv/bin/python" experiments/bench/pipeline.py --steps 8 --seq-len 128 \
    --torch-schedules --P 2 --M 8 --rounds 1 --project-schedules zb-h2 --project-args runtime.trace=true "$@" \
    --keep 2>&1 | grep "round 0" | sed "s/^/$label /"
run=$(ls -td "$work"/bench-pipeline-*/npt-* | head -1)
"$here/.venv/bin/python" - "$run" "$label" <<'PY'
import json, statistics as st, sys
from collections import defaultdict
run, label = sys.argv[1], sys.argv[2]
with open(run + "/trace.json") as f:
    events = json.load(f)
ms = defaultdict(float)  # (card, step, action kind) -> milliseconds
for e in events:
    if e.get("ph") != "X":
        continue
    n = e["name"]
    kind = n if n.startswith("wait F0") else (n.split()[0] if n.startswith(("wait", "send")) else n.rstrip("0123456789"))
    ms[(e["tid"], e["args"]["step"], kind)] += e["dur"] / 1e3
steps = range(2, 9)
for card in (0, 1):
    kinds = sorted({k for (c, _, k) in ms if c == card})
    print(label, "card", card, {k: round(st.median(ms.get((card, s, k), 0.0) for s in steps)) for k in kinds})
with open(run + "/metrics.jsonl") as f:
    recs = [json.loads(l) for l in f if l.strip()]
recs = [r for r in recs if r.get("step", 0) >= 2]
print(label, "median step_s %.3f idle %.4f" % (st.median(r["step_s"] for r in recs), st.median(r["idle_share"] for r in recs)))
PY
rm -rf "$work"
