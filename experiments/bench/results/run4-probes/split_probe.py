import json, sys, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, "/work/main/experiments/bench")
import pipeline as bp  # noqa
args = SimpleNamespace(device="cpu", seq_len=128, steps=4, threads=1, model="embedded", timeout=1200,
                       no_pin=False, keep=False, project_args=[])
work = Path("/work/probe/runs"); work.mkdir(exist_ok=True)
variants = {"auto": [], "19/11": ["train.split=[19,11]"], "18/12": ["train.split=[18,12]"]}
out = {k: [] for k in variants}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    keys = list(variants)
    keys = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
    for k in keys:
        args.project_args = variants[k]
        r = bp.run_project("1f1b", 2, 8, args, work, [0, 1])
        recs = r.get("metrics", [])
        comp = [rec.get("compute_s_cards") for rec in recs[1:]]
        print(k, "rnd", rnd, "tok/s %.1f" % r.get("tokens_per_s", 0), "idle %.3f" % r.get("idle_share", 0),
              "split", r.get("split"), "compute_s_cards", comp, r.get("error", ""), flush=True)
        out[k].append({"tps": r.get("tokens_per_s"), "idle": r.get("idle_share"), "comp": comp,
                       "keys": sorted(recs[1].keys()) if len(recs) > 1 else None})
json.dump(out, open("/work/probe/split_probe.json", "w"), indent=1)
