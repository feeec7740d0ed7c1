import json, os, sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, "/work/main/experiments/bench")
import pipeline as bp  # noqa
args = SimpleNamespace(device="cpu", seq_len=128, steps=4, threads=1, model="embedded", timeout=1200,
                       no_pin=False, keep=False, project_args=["train.split=[19,11]"])
work = Path("/work/probe/runs"); work.mkdir(exist_ok=True)
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
for rnd in range(int(sys.argv[1])):
    for k in (["base", "malloc"] if rnd % 2 == 0 else ["malloc", "base"]):
        for e in ENV:
            os.environ.pop(e, None)
        if k == "malloc":
            os.environ.update(ENV)
        r = bp.run_project("1f1b", 2, 8, args, work, [0, 1])
        recs = r.get("metrics", [])
        print(k, rnd, "tok/s %.1f" % r.get("tokens_per_s", 0), "idle %.3f" % r.get("idle_share", 0),
              "comp", [[round(x, 2) for x in rec.get("compute_s_cards")] for rec in recs[1:]],
              "mem", [rec.get("mem_gib_cards", rec.get("peak_gib_cards")) for rec in recs[-1:]], r.get("error", ""), flush=True)
