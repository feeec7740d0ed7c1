#!/usr/bin/env python
"""Pipeline training throughput: npu-train vs ``torch.distributed.pipelining``, side by side.

For every cell (P card processes, M micro-batches per optimizer step) and every round, each
system trains the same model (the embedded SmolLM2-135M, weights loaded with
``npu_train.model.load_config/load_tensors``) on the same micro-batches (the project's
packed Botchan rows and its seeded ``StepSampler``), fp32, ``--threads`` intra-op threads per
process, one process per stage pinned to its own core (round-robin when P > cores):

- ``npu-train <schedule>``: the real launcher as a subprocess, ``launch/run.py backend=cpu,...
  data.seq_len=S train.micro_batch=1 train.accum=M train.steps=N runtime.threads=T train.dtype=fp32
  train.schedule=<1f1b|gpipe|zb|zb-h1|zb-h2|zbv|interleaved>``; tokens/s and the idle share (``idle_s / step_s``), split
  into the pipeline bubble (``bubble_s / step_s``) and the end-of-step collectives (``collective_s /
  step_s``), per step come
  from the run dir's ``metrics.jsonl`` (fields of ``npu_train.metrics.report.Reporter.step``: the
  step's wall time is the slowest card's ``time_s``). The run writes no checkpoint
  (``checkpoint.save=false``: after the last step, not measured; ~9 s and 1.95 GB for the default model)
  and no held-out evaluation (``data.eval_batches=0``). The card processes are pinned from outside
  (pids from the run's ``job.json``, every thread, repeated while the job runs); the launcher
  process (the coordinator: it only relays messages) is not pinned.
- ``torch <Schedule> <split>``: P worker processes (``_torch_pipeline.py``, started as this script
  with ``--torch-worker``), pinned before ``import torch``, gloo (or NCCL) process group, ``PipelineStage`` built by hand around the project's
  ``StageModule`` per stage. Same step as the project (``npu_train.runtime.trainer``): loss =
  summed token cross-entropy / target tokens of the step (``scale_grads=False``), tied embedding
  gradient summed between the ranks holding the embedding and the LM head, global grad-norm clip
  at 1.0, LR warm-up + cosine (``npu_train.optim.lr.lr_at``), ``AdamW(fused=True)`` (lr 1e-4, betas
  0.9/0.95, eps 1e-8, no weight decay). Step time = the slowest rank's time from the start of
  ``schedule.step`` to the end of the optimizer step; per step and rank the ``--json`` output also
  holds the phases' seconds (``phases``: wall of ``schedule.step``, of the tied all-reduce + grad norm,
  of the norm/loss all-reduce and of clip + AdamW, and ``cpu_phases_s``: CPU seconds of the process in
  schedule / collectives / optimizer, as the project's ``metrics.jsonl`` ``cpu_phases_s_cards``, which
  the project entries carry in ``metrics``; for 1F1B / GPipe ``compute_s``: wall seconds of the module
  forwards, the loss and the backwards inside ``schedule.step``, as the project's ``compute_s``). Schedules: ``Schedule1F1B`` with the even
  split (what a torch user writes) and with the project's split (the ``split`` of the project run's
  ``plan.json``), and the multi-chunk schedules ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble`` (2 stages per rank, looped), ``ScheduleZBVZeroBubble``,
  ``ScheduleDualPipeV`` (2 stages per rank, V shape) with the even split and with the project's
  per-card layer counts halved into the card's two chunks. A (schedule, P, M) that torch's schedule
  constructor refuses (``_torch_pipeline.torch_refusal``: ``Schedule1F1B`` with M < P,
  ``ScheduleDualPipeV`` with M < 2P, the interleaved ones with M not a multiple of max(1, M // P)) is
  recorded as ``refused`` with the reason, without starting its processes; a schedule that fails
  otherwise is reported with its error; both are left out of the ratios.

Figures: median of steps 2..N of each run (step 1 allocates moments and warms up), then median,
min and max over rounds; ratios are against ``torch 1F1B even`` measured in the same run (``torch
GPipe even`` where M < P: torch's ``Schedule1F1B`` refuses M < P, so GPipe is added there), and the
project's best against the fastest torch entry of the cell. Systems run interleaved (every round
runs every system once, in a rotated order). The losses of the first and the last step of both
sides are printed (7 decimals) as a check that they train the same thing: same forward (step 1)
and the same update (last step).

Usage (from the repository root)::

    .venv/bin/python experiments/bench/pipeline.py --quick               # smoke: 1 round, tiny
    .venv/bin/python experiments/bench/pipeline.py --rounds 5 --json out.json   # full (hours)
    .venv/bin/python experiments/bench/pipeline.py --device cuda --P 1 2 --M 8   # NVIDIA GPU
    .venv/bin/python experiments/bench/pipeline.py --resummarize out.json        # reprint a saved run's summary
"""
from __future__ import annotations

import sys

# A torch worker (_torch_pipeline.py) pins itself before torch (and its threads) exist; see _common.pin_self.
if __name__ == "__main__" and "--torch-worker" in sys.argv:
    from _torch_pipeline import worker_main  # (this script's directory is sys.path[0])

    raise SystemExit(worker_main(sys.argv))

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from _common import core_for, free_port, machine_info, pin_pid_tree, print_machine, spread, usable_cores, write_json  # noqa: E402
from npu_train.pipeline.schedule import ALL_SCHEDULES  # noqa: E402  (torch-free)

from _torch_pipeline import LOOPED, SINGLE, VSHAPE, torch_refusal  # noqa: E402  (the torch worker side)

BASELINE = "torch 1F1B even"


# ----------------------------------------------------------------------------- splits
def even_counts(n_layers: int, parts: int) -> list[int]:
    """``n_layers`` split into ``parts`` contiguous counts differing by at most one (larger first)."""
    q, r = divmod(n_layers, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def stage_ranks(kind: str, P: int) -> list[int]:
    """Rank of each global stage: one per rank (single), looped ``s % P``, or V shape (rank r holds
    stages r and 2P-1-r)."""
    if kind in SINGLE:
        return list(range(P))
    if kind in LOOPED:
        return [s % P for s in range(2 * P)]
    return [s if s < P else 2 * P - 1 - s for s in range(2 * P)]


def stage_layers(kind: str, P: int, n_layers: int, card_counts: list[int] | None) -> list[tuple[int, int]]:
    """Half-open layer ranges per global stage. ``card_counts`` None: even over the stages;
    else layers per card (the project's split), halved into the card's two chunks for the
    multi-chunk schedules (first chunk = the card's lower stage index)."""
    ranks = stage_ranks(kind, P)
    S = len(ranks)
    if card_counts is None:
        counts = even_counts(n_layers, S)
    elif S == P:
        counts = list(card_counts)
    else:
        counts = [0] * S
        for r in range(P):
            mine = sorted(s for s in range(S) if ranks[s] == r)
            for s, c in zip(mine, even_counts(card_counts[r], len(mine))):
                counts[s] = c
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    assert a == n_layers, (counts, n_layers)
    return out


def run_torch(kind: str, P: int, M: int, layers, args, data_file: str, work: Path, cores: list[int],
              keep: bool = False) -> dict:
    """Launch P workers for one torch run; returns ``{"tokens_per_s", "step_s", "loss1", "error"}``.
    ``keep``: the workers keep freed host memory as the project's card processes do
    (:func:`npu_train.hostmem.keep_freed_memory`); default: the C library's settings."""
    out_dir = Path(tempfile.mkdtemp(prefix="torch-", dir=work))
    cfg = {"P": P, "M": M, "schedule": kind, "layers": layers, "stage_ranks": stage_ranks(kind, P),
           "device": "cuda:0" if args.device == "cuda" else "cpu", "pg": args.torch_pg, "port": free_port(),
           "model": args.model, "threads": args.threads, "micro_batch": 1, "steps": args.steps,
           "data_file": data_file, "out_dir": str(out_dir), "timeout_s": args.timeout,
           "cores": [core_for(r, cores) for r in range(P)], "pin": not args.no_pin, "keep_host_memory": keep}
    cfg_path = out_dir / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-worker", str(cfg_path), "--rank", str(r)],
                              cwd=ROOT, stdout=open(out_dir / f"rank{r}.log", "w"), stderr=subprocess.STDOUT)
             for r in range(P)]
    deadline = time.time() + args.timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) and failed_at is None:
            failed_at = time.time()  # a peer failed: the others block in gloo until killed
        if time.time() > deadline or (failed_at and time.time() - failed_at > 5):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    ranks = []
    for r in range(P):
        f = out_dir / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.is_file() else
                     {"error": f"rank {r} exited {procs[r].returncode} without a result: "
                               + (out_dir / f"rank{r}.log").read_text()[-800:]})
    errs = [r["error"] for r in ranks if "error" in r]
    res = {"layers": layers}
    if errs:
        res["error"] = errs[0].splitlines()[0][:400] if errs[0] else "failed"
    else:
        n = min(len(r["step_s"]) for r in ranks)
        step_s = [max(r["step_s"][i] for r in ranks) for i in range(n)]
        tokens = M * args.seq_len  # micro-batch 1; every label counts (packed rows)
        later = step_s[1:] or step_s
        res.update({"step_s": step_s, "tokens_per_s": tokens / spread(later)["median"],
                    "loss": ranks[0]["loss"], "loss1": ranks[0]["loss"][0] if ranks[0]["loss"] else None,
                    "phases": [r.get("phases") for r in ranks]})
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- project run
def run_project(schedule: str, P: int, M: int, args, work: Path, cores: list[int], extra: tuple = ()) -> dict:
    """One launcher run; returns tokens/s, idle share, per-step figures and the split it chose
    (``split``: half-open layer ranges ``[[a, b), ...]`` per stage, from the ``split`` layer counts
    of the run dir's ``plan.json``)."""
    run_dir = Path(tempfile.mkdtemp(prefix="npt-", dir=work))
    if args.device == "cuda":
        cards = ",".join(["cuda:0"] * P)  # the only GPU, once per card process (if the project allows it)
    else:
        cards = ",".join(["cpu"] * P)
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), f"backend={cards}", f"data.seq_len={args.seq_len}",
           "train.micro_batch=1", f"train.accum={M}", f"train.steps={args.steps}", f"runtime.threads={args.threads}",
           "train.dtype=fp32", f"train.schedule={schedule}", f"model.path={args.model}", f"hydra.run.dir={run_dir}",
           "data.eval_batches=0",  # no held-out evaluation before/after training: not measured, saves wall time
           "checkpoint.save=false",  # no final checkpoint: not measured (~9 s, 1.95 GB for the default model)
           *args.project_args, *extra]
    log = run_dir / "launcher.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        pinned: dict[int, int] = {}
        while proc.poll() is None:
            if time.time() - t0 > args.timeout:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                break
            jf = run_dir / "job.json"
            if not args.no_pin and jf.is_file():
                try:
                    for c in json.loads(jf.read_text())["cards"]:
                        pinned[c["pid"]] = pin_pid_tree(c["pid"], core_for(int(c["rank"]), cores))
                except (ValueError, KeyError, OSError):
                    pass
            time.sleep(0.25)
    res: dict = {"cmd": " ".join(cmd), "rc": proc.returncode}
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.is_file() else []
    if proc.returncode != 0 or not recs:
        text = log.read_text()
        errs = [l for l in text.splitlines() if l.startswith("error")] or text.strip().splitlines()[-1:]
        res["error"] = (errs[-1] if errs else f"exit {proc.returncode}")[:400]
    else:
        later = recs[1:] or recs

        def card_mean(r, key):  # the mean over cards of a per-card figure (metrics.jsonl's <key>_cards)
            v = r.get(f"{key}_cards")
            return sum(v) / len(v) if v else r[key]

        res.update({"step_s": [r["step_s"] for r in recs], "tokens_per_s": spread([r["tokens_per_s"] for r in later])["median"],
                    # idle share of all cards (metrics.jsonl's idle_share: the bubble-rate definition,
                    # 1 - sum of busy / (cards * wall)); records without it: the slowest card's idle_s / step_s
                    "idle_share": spread([r["idle_share"] if "idle_share" in r else r["idle_s"] / r["step_s"]
                                          for r in later])["median"],
                    # its split, also averaged over cards: pipeline bubble and end-of-step collectives
                    "bubble_share": spread([card_mean(r, "bubble_s") / r["step_s"] for r in later
                                            if "bubble_s" in r])["median"],
                    "collective_share": spread([card_mean(r, "collective_s") / r["step_s"] for r in later
                                                if "collective_s" in r])["median"],
                    "loss": [r["loss"] for r in recs], "loss1": recs[0]["loss"],
                    "metrics": recs})  # every step's metrics.jsonl record (per-phase seconds, per card)
        plan_file = run_dir / "plan.json"  # written by the launcher before the card processes start
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
        counts = plan.get("split")
        res["chosen_schedule"] = plan.get("shape", {}).get("schedule")  # what train.schedule=auto picked
        if counts:  # layers per stage -> [a, b) ranges (the format of the checkpoint manifest's split)
            ends = [sum(counts[:i + 1]) for i in range(len(counts))]
            res["split"] = [[e - c, e] for c, e in zip(counts, ends)]
    if args.keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- driver
def prepare_data(args, work: Path) -> tuple[str, int]:
    """The project's packed rows for ``--seq-len`` (``npu_train.data.prepare.prepare_data``: the
    launcher's tokenizer, cache and defaults), saved for the torch workers; returns (file, layers)."""
    from types import SimpleNamespace

    from npu_train.data.packfile import save_packed
    from npu_train.model import load_config, resolve_model_path
    from npu_train.data.prepare import prepare_data as project_data

    path = resolve_model_path(args.model)
    mcfg = load_config(path)
    cfg = SimpleNamespace(model=SimpleNamespace(tokenizer=None),
                          data=SimpleNamespace(source="botchan", format="text", seq_len=args.seq_len,
                                               val_fraction=0.05))
    data = project_data(cfg, path, mcfg)
    f = work / "data.safetensors"
    save_packed(data, f)
    return str(f), mcfg.num_layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--P", type=int, nargs="+", default=[1, 2, 3], help="card processes (pipeline stages)")
    ap.add_argument("--M", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches per optimizer step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (figures: median of steps 2..N)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--model", default="embedded", help="model.path; 'tiny' = a random 6-layer Llama "
                    "(hidden 64) written by tests/integration/conftest.make_tiny_model (default of --quick)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--torch-pg", default=None, help="process group backend of the torch side (default gloo on "
                    "cpu, nccl on cuda)")
    ap.add_argument("--project-schedules", nargs="+", default=["1f1b", "zb"], choices=("auto", *ALL_SCHEDULES),
                    help="train.schedule values ('auto', the default command's: the planner's choice, "
                         "printed per run)")
    ap.add_argument("--torch-schedules", nargs="*", default=["1F1B", *LOOPED, *VSHAPE],
                    help="torch.distributed.pipelining schedules (class name without 'Schedule'); none "
                         "given: the project's runs only (an A/B of two project trees)")
    ap.add_argument("--splits", nargs="+", choices=("even", "project"), default=["even", "project"])
    ap.add_argument("--project-args", nargs="*", default=[], help="extra launcher overrides")
    ap.add_argument("--host-memory", choices=("shipped", "both"), default="shipped",
                    help="shipped: the project keeps freed host memory (its default, npu_train.hostmem), torch "
                         "runs with the C library's settings; both: also the project with "
                         "runtime.keep_host_memory=false ('[keep=false]': cpu cards return freed blocks "
                         "from 256 KiB, accelerator cards get the C library's settings) and torch keeping "
                         "it ('[keep]')")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    ap.add_argument("--keep", action="store_true", help="keep run directories (logs) under the work dir")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, P=2, M=4, seq 32, 3 steps, tiny "
                    "model unless --model is given")
    ap.add_argument("--json", default=None, help="write all results to this file")
    ap.add_argument("--resummarize", default=None, metavar="JSON", help="run nothing: print the summary of a "
                    "results file an earlier run wrote with --json (with what this version adds, e.g. the work line)")
    args = ap.parse_args(argv)
    if args.resummarize:
        saved = json.loads(Path(args.resummarize).read_text())
        summarize(saved["results"], argparse.Namespace(**{**vars(args), **saved["args"]}))
        return 0
    if args.quick:
        args.rounds, args.steps, args.seq_len = 1, 3, 32
        if args.P == [1, 2, 3]:
            args.P = [2]
        if args.M == [1, 2, 4, 8]:
            args.M = [4]
        if args.model == "embedded" and "--model" not in (argv if argv is not None else sys.argv):
            args.model = "tiny"
    args.torch_pg = args.torch_pg or ("nccl" if args.device == "cuda" else "gloo")

    cores = usable_cores()
    info = machine_info(args.device)
    print_machine(info)
    for P in args.P:
        if P > len(cores) and not args.no_pin:
            print(f"note: P={P} > {len(cores)} usable cores: processes pinned round-robin "
                  f"({[core_for(r, cores) for r in range(P)]}), so some share a core", flush=True)
    print(f"shape: seq_len {args.seq_len}, micro-batch 1, fp32, {args.threads} thread(s) per process, "
          f"{args.steps} steps per run (median of steps 2..{args.steps}), {args.rounds} round(s), device {args.device}",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    if args.model == "tiny":
        sys.path.insert(0, str(ROOT / "tests" / "integration"))
        from conftest import make_tiny_model

        args.model = make_tiny_model(str(work / "tiny_model"))
        print(f"model: tiny random Llama at {args.model} (smoke run only: not the benchmark's model)", flush=True)
    data_file, n_layers = prepare_data(args, work)
    results: list[dict] = []
    t_start = time.time()
    for P in args.P:
        for M in args.M:
            proj_split: list[int] | None = None
            # (name, torch schedule or None for the project, split, keep freed host memory or None = as shipped)
            systems = [("npu-train " + s, None, None, None) for s in args.project_schedules]
            if args.host_memory == "both":  # the project as shipped keeps it; also run it without
                systems += [("npu-train " + s + " [keep=false]", None, None, False) for s in args.project_schedules]
            kinds = list(args.torch_schedules)
            if M < P and "1F1B" in kinds and "GPipe" not in kinds:
                kinds.append("GPipe")  # torch's Schedule1F1B needs M >= P: GPipe is the baseline there
            for kind in kinds:
                for sp in args.splits:
                    systems.append((f"torch {kind} {sp}", kind, sp, None))
                    if args.host_memory == "both":
                        systems.append((f"torch {kind} {sp} [keep]", kind, sp, True))
            for rnd in range(args.rounds):
                k = rnd % len(systems)
                order = systems if rnd == 0 else systems[k:] + systems[:k]  # round 0: project first (its split)
                for name, kind, sp, keep in order:
                    if kind is None:
                        r = run_project(name.split()[1], P, M, args, work, cores,
                                        extra=["runtime.keep_host_memory=false"] if keep is False else [])
                        if r.get("split") and proj_split is None:
                            proj_split = [b - a for a, b in r["split"]]
                    elif refused := torch_refusal(kind, P, M):  # torch's constructor raises: start nothing
                        r = {"refused": refused}
                    else:
                        if sp == "project" and proj_split is None:
                            r = {"error": "no project split (the project run failed)"}
                        else:
                            lay = stage_layers(kind, P, n_layers, proj_split if sp == "project" else None)
                            if sp == "project" and lay == stage_layers(kind, P, n_layers, None):
                                r = {"skipped": "same layers as the even split"}
                            else:
                                r = run_torch(kind, P, M, lay, args, data_file, work, cores, keep=bool(keep))
                    r.update({"P": P, "M": M, "system": name, "round": rnd})
                    results.append(r)
                    if "refused" in r:
                        tps = "  refused: " + r["refused"]
                    elif "skipped" in r:
                        tps = "  skipped: " + r["skipped"]
                    else:
                        tps = f"{r['tokens_per_s']:8.1f} tok/s" if "tokens_per_s" in r else "  failed: " + r["error"]
                    idle = f" idle {100 * r['idle_share']:.1f}%" if r.get("idle_share") is not None else ""
                    if r.get("bubble_share") is not None:
                        idle += f" (bubble {100 * r['bubble_share']:.1f}%"
                        idle += (f", collectives {100 * r['collective_share']:.1f}%)"
                                 if r.get("collective_share") is not None else ")")
                    loss = f" loss1 {r['loss1']:.4f}" if r.get("loss1") is not None else ""
                    if kind is None and name.split()[1] == "auto" and r.get("chosen_schedule"):
                        loss += f" (auto: {r['chosen_schedule']}, split {r.get('split')})"
                    print(f"[{time.time() - t_start:6.0f}s] P={P} M={M} round {rnd}: {name:<36} {tps}{idle}{loss}",
                          flush=True)
                    # every finished run at once: a bench stopped by a time limit keeps what it measured
                    write_json(args.json, {"machine": info, "args": vars(args), "results": results,
                                           "summary": None}, quiet=True)
    summary = summarize(results, args)
    write_json(args.json, {"machine": info, "args": vars(args), "results": results, "summary": summary})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def step_work_s(r: dict) -> list[float]:
    """Card-seconds of work of each measured step (steps 2..N) of one run: the CPU seconds of every card
    process in the step, summed over the cards. A card process runs one intra-op thread, so its CPU
    seconds are the time it computed (forward, backward, loss, optimizer, collectives' copies) and not the
    time it waited for a peer. Torch runs: ``phases[rank][step]["cpu_phases_s"]`` (schedule, collectives,
    optimizer); project runs: ``metrics.jsonl``'s ``cpu_s_cards``. Empty when the run holds neither."""
    if r.get("phases") and all(r["phases"]) and all("cpu_phases_s" in p for ph in r["phases"] for p in ph):
        n = min(len(ph) for ph in r["phases"])
        steps = [sum(sum(ph[i]["cpu_phases_s"]) for ph in r["phases"]) for i in range(n)]
    elif r.get("metrics") and all("cpu_s_cards" in m for m in r["metrics"]):
        steps = [sum(m["cpu_s_cards"]) for m in r["metrics"]]
    else:
        return []
    return steps[1:] or steps


def work_ceiling(stats: dict, base_name: str, P: int, tokens_per_step: int) -> str | None:
    """The line on the most any schedule or split can reach over the baseline with the baseline's own work
    per step: that work (card-seconds, :func:`step_work_s`) spread evenly over the P cards with no idle
    time takes ``work / P`` seconds a step; the baseline's step (``tokens_per_step / tokens/s``) over that
    is the ceiling. Each other system's work is given relative to the baseline's (same model, same
    tokens: above 1 is overhead). None without the figures."""
    base = stats.get(base_name, {})
    w, tps = base.get("work", {}).get("median"), base.get("tps", {}).get("median")
    if not w or not tps:
        return None
    balanced = w / P
    step = tokens_per_step / tps
    rel = [f"{n} {s['work']['median'] / w:.3f}" for n, s in stats.items()
           if n != base_name and s.get("work", {}).get("median")]
    return (f"  work: {base_name} {w:.1f} card-s a step; spread evenly over {P} cards with no idle: {balanced:.1f} s "
            f"a step against its {step:.1f} s, so {step / balanced:.2f}x is the most any schedule or split of the "
            "same work can reach" + (f"; work of the others relative to it: {', '.join(rel)}" if rel else ""))


def summarize(results: list[dict], args) -> list[dict]:
    """Per cell and system: median/min/max tokens/s over rounds, ratio to the baseline and to the
    fastest torch entry, and the work ceiling (:func:`work_ceiling`); printed as a table."""
    out = []
    cells = sorted({(r["P"], r["M"]) for r in results})
    print("\nsummary: tokens/s over rounds (median [min-max]); ratios of medians measured in this run")
    for P, M in cells:
        rows = [r for r in results if (r["P"], r["M"]) == (P, M)]
        names = list(dict.fromkeys(r["system"] for r in rows))
        stats = {}
        for n in names:
            rs = [r for r in rows if r["system"] == n]
            ok = [r for r in rs if "tokens_per_s" in r]
            stats[n] = {"tps": spread([r["tokens_per_s"] for r in ok]),
                        "idle": spread([r.get("idle_share") for r in ok]),
                        "bubble": spread([r.get("bubble_share") for r in ok]),
                        "collective": spread([r.get("collective_share") for r in ok]),
                        "loss1": spread([r.get("loss1") for r in ok]),
                        "lossN": spread([r["loss"][-1] if r.get("loss") else None for r in ok]),
                        "work": spread([w for r in ok for w in step_work_s(r)]),
                        "errors": sorted({r["error"] for r in rs if "error" in r}),
                        "refused": sorted({r["refused"] for r in rs if "refused" in r})}
        base_name = BASELINE
        if not stats.get(BASELINE, {}).get("tps", {}).get("n") and stats.get("torch GPipe even", {}).get("tps", {}).get("n"):
            base_name = "torch GPipe even"  # e.g. M < P: Schedule1F1B refuses to run (refused entries)
        base = stats.get(base_name, {}).get("tps", {}).get("median")
        torch_ok = {n: s["tps"]["median"] for n, s in stats.items() if n.startswith("torch") and s["tps"]["n"]}
        best_torch = max(torch_ok, key=torch_ok.get) if torch_ok else None
        if base is None:  # no torch run (--torch-schedules without names) or the baseline failed
            base_name = "none run"
        print(f"\nP={P} M={M}  (baseline: {base_name}; fastest torch: {best_torch})")
        print(f"  {'system':<36} {'tok/s median':>12} {'[min-max]':>17} {'vs base':>8} {'vs best':>8} "
              f"{'idle %':>7} {'bubble %':>8} {'coll %':>7} {'loss step 1':>11} {'last':>10}")
        for n, s in stats.items():
            t = s["tps"]
            rec = {"P": P, "M": M, "system": n, "baseline": base_name, **s}
            if t["n"]:
                rb = t["median"] / base if base else None
                rt = t["median"] / torch_ok[best_torch] if best_torch else None
                rec.update({"vs_baseline": rb, "vs_best_torch": rt})
                idle = f"{100 * s['idle']['median']:.1f}" if s["idle"]["n"] else "n/a"
                bub = f"{100 * s['bubble']['median']:.1f}" if s["bubble"]["n"] else "n/a"
                col = f"{100 * s['collective']['median']:.1f}" if s["collective"]["n"] else "n/a"
                print(f"  {n:<36} {t['median']:12.1f} {t['min']:8.1f}-{t['max']:<8.1f} "
                      f"{(f'{rb:.2f}x' if rb else 'n/a'):>8} {(f'{rt:.2f}x' if rt else 'n/a'):>8} {idle:>7} {bub:>8} {col:>7} "
                      f"{s['loss1']['median']:11.7f} {s['lossN']['median']:10.7f}")
            elif s["refused"]:
                print(f"  {n:<36} {'refused':>12}: {'; '.join(s['refused'])[:300]}")
            elif any("skipped" in r for r in rows if r["system"] == n):
                print(f"  {n:<36} {'skipped':>12}: same layers as the even split")
            else:
                print(f"  {n:<36} {'failed':>12}: {'; '.join(s['errors'])[:300]}")
            out.append(rec)
        ceiling = work_ceiling(stats, base_name, P, M * args.seq_len)
        if ceiling:
            print(ceiling)
    bubble = [f"P={P} M={M}: {(P - 1) / (M + P - 1):.3f}" for P, M in cells]
    print("\n1F1B bubble (P-1)/(M+P-1) for reference: " + ", ".join(bubble))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
