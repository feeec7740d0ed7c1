"""Memory calibration from real runs: ``python -m npu_train.planner.memfit RUN_DIR [RUN_DIR ...]``.

Each run directory is one training run (a few steps) of a layout on RNGD with
``runtime.furiosa.probe_free=true`` (``experiments/rngd-runbook.md``, "Memory calibration"). From
it this reads the plan the run used (``plan.json``, written by the launcher) and the step metrics
(``metrics.jsonl``). Per card and step:

- the card process's own accounting: ``mem_peak_bytes`` (peak of the step) and
  ``mem_quiet_bytes`` (after the step), :class:`~npu_train.backends.accounting.StorageLedger`;
- ``card_free_bytes``: free card memory after the step, measured by allocating it
  (:func:`~npu_train.backends.furiosa_compile.probe_free_bytes`);
- real peak = capacity - free + (peak - quiet): what the card held after the step (everything:
  runtime buffers, loaded modules, allocator slack) plus what the step added on top at its peak.

The largest real peak per card over the run's steps after the first is one sample
``(body, real peak)``, body = the plan's weights + grads + optimizer + activations + transient of
that card. :func:`~npu_train.planner.memterms.fit_memory_terms` fits the workspace constant and
fraction, :func:`~npu_train.planner.memterms.save_memory_terms` writes them into the calibration
profile (``--profile``, default ``<cache>/calibration/furiosa.json``); later plans read them and
name them "measured". ``--dry-run`` prints without writing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from npu_train.planner.memterms import fit_memory_terms, load_memory_terms, save_memory_terms

__all__ = ["samples_from_run", "main"]

BODY_KEYS = ("weights", "grads", "optimizer", "activations", "transient")


def samples_from_run(run_dir: str, kind: str = "furiosa") -> list[dict]:
    """One sample per card of ``kind`` in ``run_dir``: ``{"run", "card", "layout", "body_bytes",
    "predicted_bytes", "ledger_peak_bytes", "real_peak_bytes"}`` (bytes). Steps without
    ``card_free_bytes`` and the first step (compilation, one-off allocations) are skipped when later
    steps exist.

    Raises:
        FileNotFoundError: no ``plan.json`` / ``metrics.jsonl`` in ``run_dir``.
        ValueError: no step with ``card_free_bytes`` (the run was not made with
            ``runtime.furiosa.probe_free=true``).
    """
    with open(os.path.join(run_dir, "plan.json")) as f:
        plan = json.load(f)
    recs = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "card_free_bytes" in r:
                recs.append(r)
    if not recs:
        raise ValueError(f"{run_dir}: no step reported card_free_bytes; rerun it with "
                         "runtime.furiosa.probe_free=true")
    if len(recs) > 1:
        recs = [r for r in recs if r["step"] > recs[0]["step"]]
    layout = "x".join(str(len(st["resident"])) for st in plan["stages"])
    out = []
    for i, st in enumerate(plan["stages"]):
        if not st["card"].startswith(kind):
            continue
        real = max(st["capacity_bytes"] - r["card_free_bytes"][i] + r["mem_peak_bytes"][i]
                   - r["mem_quiet_bytes"][i] for r in recs)
        out.append({"run": run_dir, "card": st["card"], "layout": f"{len(plan['stages'])} cards, resident {layout}",
                    "body_bytes": int(sum(st["mem"][k] for k in BODY_KEYS)),
                    "predicted_bytes": int(st["mem"]["total"]),
                    "ledger_peak_bytes": int(max(r["mem_peak_bytes"][i] for r in recs)),
                    "real_peak_bytes": int(real)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Command line (module docstring). Returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m npu_train.planner.memfit", description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--kind", default="furiosa")
    ap.add_argument("--profile", default=None, help="calibration profile to update")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    samples = [s for d in a.run_dirs for s in samples_from_run(d, a.kind)]
    g = 2**30
    for s in samples:
        print(f"{s['layout']:<28} {s['card']:<10} body {s['body_bytes'] / g:6.2f}  ledger peak "
              f"{s['ledger_peak_bytes'] / g:6.2f}  real peak {s['real_peak_bytes'] / g:6.2f}  "
              f"predicted {s['predicted_bytes'] / g:6.2f} GiB")
    base = load_memory_terms(a.kind, a.profile)
    terms = fit_memory_terms([(s["body_bytes"], s["real_peak_bytes"]) for s in samples], base)
    print(f"fitted workspace: {terms.describe()}")
    if not a.dry_run:
        path = save_memory_terms(a.kind, terms, samples, a.profile)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
