#!/usr/bin/env python
"""Timeline of the host-optimizer overlap of offloaded layers (issue 9, item 4).

Runs one short job per mode through the launcher (``launch/run.py``, a subprocess each) with every
decoder layer offloaded (``train.resident_layers=0``) and reads the per-step records of
``metrics.jsonl``: each card's marks of the step (``marks``: start, backward end, clip coefficient
known; ``time.perf_counter``, CLOCK_MONOTONIC, comparable across the card processes) and the
previous step's host update (``host``: start, per layer ``[layer, AdamW start, AdamW end, upload
end]`` relative to the start, seconds waited by the main thread, seconds hidden). Modes:

- ``on``: ``train.offload_overlap=true`` (the default): host AdamW + upload on a background thread;
- ``off``: ``train.offload_overlap=false``: the same work inline after the collectives;
- ``delayed``: ``train.offload_update=delayed`` (one step stale);
- ``resident``: ``train.resident_layers=auto`` (no offload where everything fits: the target's
  reference, "offloaded step <= 1.05x all-resident" on CUDA).

Printed per mode and card, for one step pair (``--show``, default the second-to-last): times in
seconds from that step's backward end: clip known, each layer's AdamW start/end and upload end,
the next step's start (its forward begins there); then per mode the mean step time over steps
2..N, the host update's seconds, waited seconds and hidden share. ``--rounds N`` runs the modes N
times interleaved and prints medians with their spread, and each offloaded mode's ratio to
``resident`` as the median of the per-round ratios (the machine's drift cancels within a round). ``--plot PNG`` draws the same
step pair as bars (matplotlib). On a shared machine the times are noisy: one run, not a benchmark.

Usage (from the repository root)::

    .venv/bin/python experiments/bench/offload_timeline.py --steps 4 -- data.seq_len=64 train.accum=4
    .venv/bin/python experiments/bench/offload_timeline.py --device cuda --modes on off resident
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]

MODES = {
    "on": ["train.resident_layers=0", "train.offload_overlap=true"],
    "off": ["train.resident_layers=0", "train.offload_overlap=false"],
    "delayed": ["train.resident_layers=0", "train.offload_update=delayed"],
    "resident": ["train.resident_layers=auto"],
}
BACKEND = {"cpu": "backend=[cpu,cpu]", "cuda": "backend=[cuda:0]"}


def run_mode(mode: str, args, out: Path, tag: str = "") -> list[dict]:
    run_dir = out / f"{mode}{tag}"
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), f"train.steps={args.steps}", f"hydra.run.dir={run_dir}",
           BACKEND[args.device] if args.backend is None else f"backend={args.backend}",
           f"runtime.threads={args.threads}", *MODES[mode], *args.overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(out / f"{mode}{tag}.log", "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if rc != 0:
        print((out / f"{mode}{tag}.log").read_text()[-3000:])
        raise SystemExit(f"{mode}: launcher exit status {rc}")
    print(f"  {mode}: {time.time() - t0:.0f} s wall", flush=True)
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def step_pair(recs: list[dict], k: int, card: int) -> dict:
    """The update of step ``k`` (1-based) on ``card``, in seconds from step k's backward end: it is
    reported in step k+1's record (``host``), step k's marks are in step k's record."""
    prev, nxt = recs[k - 1], recs[k]
    t0, bwd_end, clip = prev["marks"][card]
    host = nxt["host"][card]
    rel = lambda t: t - bwd_end  # noqa: E731
    layers = [(name, rel(host["start"] + a), rel(host["start"] + b), rel(host["start"] + c))
              for name, a, b, c in host["timeline"]]
    return {"step_start": rel(t0), "clip": rel(clip), "layers": layers, "next_start": rel(nxt["marks"][card][0]),
            "next_bwd_end": rel(nxt["marks"][card][1]), "update_s": host["update_s"], "wait_s": host["wait_s"],
            "hidden": host["hidden"]}


def show(mode: str, recs: list[dict], k: int) -> list[dict]:
    out = []
    for card in range(len(recs[0]["mem_peak_bytes"])):
        if not recs[k].get("host") or not recs[k]["host"][card]["timeline"]:
            continue
        p = step_pair(recs, k, card)
        out.append(p)
        print(f"\n[{mode}] card {card}: update of step {k}, seconds from step {k}'s backward end "
              f"(step {k} started {p['step_start']:+.3f})")
        print(f"  clip coefficient known  {p['clip']:+.3f}")
        for name, a, b, c in p["layers"]:
            print(f"  {name:<8} AdamW {a:+.3f} .. {b:+.3f}   upload end {c:+.3f}")
        print(f"  step {k + 1} starts {p['next_start']:+.3f}, its backward ends {p['next_bwd_end']:+.3f}")
        print(f"  host update {p['update_s']:.3f} s, main thread waited {p['wait_s']:.3f} s, "
              f"hidden {100 * p['hidden']:.0f}%")
    return out


def plot(pairs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m, i, p) for m, ps in pairs.items() for i, p in enumerate(ps)]
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(rows)))
    for y, (mode, card, p) in enumerate(rows):
        for name, a, b, c in p["layers"]:
            ax.barh(y, b - a, left=a, color="tab:orange", edgecolor="k", linewidth=0.3)
            ax.barh(y, c - b, left=b, color="tab:green", edgecolor="k", linewidth=0.3)
        ax.axvline(0, color="k", lw=0.5)
        ax.plot([p["clip"]], [y], "k|", ms=14)
        ax.plot([p["next_start"]], [y], "bv", ms=8)
    ax.set_yticks(range(len(rows)), [f"{m} card{c}" for m, c, _ in rows])
    ax.set_xlabel("seconds from the step's backward end (| clip known, v next step starts; "
                  "orange AdamW, green upload)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(BACKEND), default="cpu")
    ap.add_argument("--backend", default=None, help="backend list override, e.g. 'cuda:0,cuda:0'")
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["on", "off"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="run every mode this many times, interleaved; "
                    "figures are medians over rounds, ratios the median of per-round ratios")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=None, help="1-based step whose update is shown (default steps-1)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="launcher overrides after --")
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="offload-timeline-"))
    k = args.show or args.steps - 1
    pairs, summary, rounds = {}, {}, []
    for r in range(args.rounds):  # every round runs each mode once, in the order given (interleaved)
        if args.rounds > 1:
            print(f"round {r + 1}/{args.rounds}", flush=True)
        this = {}
        for mode in args.modes:
            recs = run_mode(mode, args, out, f"-r{r}" if args.rounds > 1 else "")
            later = recs[1:] or recs
            this[mode] = {"step_s": sum(x["step_s"] for x in later) / len(later),
                          "steps_s": [round(x["step_s"], 3) for x in recs]}
            if r == 0 and mode != "resident" and len(recs) > k:
                pairs[mode] = show(mode, recs, k)
        rounds.append(this)
        if args.json:  # after every round: a run cut short (a device's time limit) keeps what it measured
            Path(args.json).write_text(json.dumps({"rounds": rounds, "argv": sys.argv}, indent=1))
    summary = rounds[0] if args.rounds == 1 else {
        m: {"step_s": median([rd[m]["step_s"] for rd in rounds]),
            "min_s": min(rd[m]["step_s"] for rd in rounds), "max_s": max(rd[m]["step_s"] for rd in rounds),
            "steps_s": [rd[m]["steps_s"] for rd in rounds]} for m in args.modes}
    print("\nmode       mean step s (steps 2..N)" + (f", median of {args.rounds} rounds [min-max]" if args.rounds > 1
                                                    else "   per step"))
    for mode, s in summary.items():
        spread = f"[{s['min_s']:.3f}-{s['max_s']:.3f}]" if args.rounds > 1 else str(s["steps_s"])
        print(f"{mode:<10} {s['step_s']:>10.3f}               {spread}")
    ratios = {}
    for off in ("on", "delayed", "off"):
        if "resident" in args.modes and off in args.modes:
            # the ratio within each round (both runs side by side), then the median over rounds
            per = [rd[off]["step_s"] / rd["resident"]["step_s"] for rd in rounds]
            ratios[off] = {"median": median(per), "rounds": [round(x, 4) for x in per]}
            print(f"offloaded ({off}) / all-resident: {ratios[off]['median']:.3f}"
                  + (f" (median of per-round ratios {ratios[off]['rounds']})" if args.rounds > 1 else ""))
    if args.plot and pairs:
        plot(pairs, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds, "ratios": ratios,
                                               "pairs": pairs, "argv": sys.argv}, indent=1))
    print(f"logs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
