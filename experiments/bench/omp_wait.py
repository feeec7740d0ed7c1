#!/usr/bin/env python
"""Step time of a cpu card at several torch threads under each OpenMP wait policy: ``OMP_WAIT_POLICY=PASSIVE``
(what the launcher sets when the user set no wait setting), ``ACTIVE`` and libgomp's default (unset), in the
same run, interleaved (every round runs every policy once, in a rotated order).

``flock /tmp/bench.lock python experiments/bench/omp_wait.py --rounds 3 --json /tmp/omp.json``

Each run is a real launch (``launch/run.py``, one cpu card, ``runtime.threads=2`` by default) of a random
SmolLM2-shaped Llama with ``--layers`` layers (written once to ``--work``), ``--steps`` steps of micro-batch 2 x
``--accum``, no checkpoint;
the step times are ``metrics.jsonl``'s ``step_s`` after the first step (start-up excluded). "unset" passes
``OMP_WAIT_POLICY=`` (empty): the launcher then leaves the policy alone (a user setting,
``npu_train.hostmem.USER_WAIT_SETTINGS``) and libgomp, which reads an empty value as no value, keeps its
default (it may print that the value is invalid). Prints the machine, per policy the median step (s) with its
spread over all steps of all rounds, the process CPU seconds a step, and each policy's ratio to PASSIVE.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

POLICIES = {"PASSIVE": "PASSIVE", "ACTIVE": "ACTIVE", "unset": ""}


def make_model(out: str, layers: int) -> str:
    """A random SmolLM2-135M-shaped Llama cut to ``layers`` layers, fp32 safetensors, a 2048-entry BPE."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    subprocess.run([sys.executable, os.path.join(REPO, "experiments", "bench", "make_random_model.py"),
                    "--preset", "smollm2-135m", "--out", out], check=True, cwd=REPO)
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    kept = {k: v for k, v in load_file(path).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, path)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out


def one_run(model: str, policy: str, work: str, a) -> dict:
    """One launch under ``policy``; its step times (after the first) and the launch's CPU seconds."""
    run_dir = os.path.join(work, f"run-{policy}-{time.time_ns()}")
    env = dict(os.environ, OMP_WAIT_POLICY=POLICIES[policy], NPT_CACHE=os.path.join(work, "cache"))
    for k in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(k, None)
    argv = [sys.executable, os.path.join(REPO, "launch", "run.py"), f"model.path={model}", "backend=cpu",
            f"runtime.threads={a.threads}", f"train.steps={a.steps}", "data.eval_batches=1", "checkpoint.save=false",
            f"train.accum={a.accum}", "train.schedule=1f1b", f"hydra.run.dir={run_dir}"]
    before = os.times()
    load0 = os.getloadavg()[0]
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    after = os.times()
    if r.returncode != 0:
        raise SystemExit(f"{policy}: exit {r.returncode}\n{r.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    steps = [float(x["step_s"]) for x in recs if "step_s" in x and int(x.get("step", 0)) > 1]
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"policy": policy, "step_s": steps, "launch_cpu_s": cpu, "load_start": load0,
            "load_end": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--work", default="/tmp/omp_wait")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from _common import machine_info

    os.makedirs(a.work, exist_ok=True)
    model = make_model(os.path.join(a.work, "model"), a.layers)
    print(json.dumps(machine_info()), flush=True)
    names = list(POLICIES)
    runs = []
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for p in order:
            res = one_run(model, p, a.work, a)
            runs.append(res)
            print(f"round {rnd + 1} {p:8s} steps {' '.join(f'{s:.2f}' for s in res['step_s'])} s | "
                  f"launch CPU {res['launch_cpu_s']:.1f} s | load {res['load_start']:.1f}->{res['load_end']:.1f}",
                  flush=True)
    summary = {}
    for p in names:
        steps = [s for r in runs if r["policy"] == p for s in r["step_s"]]
        summary[p] = {"median_step_s": statistics.median(steps), "min": min(steps), "max": max(steps),
                      "n": len(steps), "launch_cpu_s": statistics.median(r["launch_cpu_s"] for r in runs
                                                                         if r["policy"] == p)}
    base = summary["PASSIVE"]["median_step_s"]
    for p in names:
        s = summary[p]
        print(f"{p:8s} median step {s['median_step_s']:.3f} s [{s['min']:.3f}-{s['max']:.3f}] over {s['n']} steps, "
              f"x{s['median_step_s'] / base:.3f} of PASSIVE; launch CPU {s['launch_cpu_s']:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(a), "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
