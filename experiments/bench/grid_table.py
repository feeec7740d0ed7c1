#!/usr/bin/env python
"""Print one Markdown table of a P x M grid from ``pipeline.py --json`` files (the ``summary`` entries):
per cell the project's tokens/s per schedule, torch's baseline (``Schedule1F1B`` even, or ``ScheduleGPipe``
even where M < P) and its fastest entry, the ratios of medians, the project's idle and bubble shares
(median over rounds) and the 1F1B bubble (P-1)/(M+P-1) for reference.

Usage::

    python experiments/bench/grid_table.py experiments/bench/results/bench-pipeline-grid-p*-run4.json ...
"""
from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> int:
    cells: dict = {}
    for p in paths:
        for e in json.load(open(p))["summary"]:
            cells.setdefault((e["P"], e["M"]), []).append(e)
    print("| P | M | npu-train tok/s [min–max] | torch baseline tok/s | fastest torch tok/s | vs baseline | vs fastest torch "
          "| idle % | bubble % | 1F1B bubble % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (P, M), es in sorted(cells.items()):
        ok = [e for e in es if e["tps"]["n"]]
        torch = [e for e in ok if e["system"].startswith("torch")]
        base = next((e for e in ok if e["system"] == e["baseline"]), None)
        best_t = max(torch, key=lambda e: e["tps"]["median"]) if torch else None
        for e in [e for e in ok if e["system"].startswith("npu-train")]:
            t = e["tps"]
            print(f"| {P} | {M} | `{e['system'].split(' ', 1)[1]}` {t['median']:.1f} [{t['min']:.1f}–{t['max']:.1f}] "
                  f"| {base['tps']['median']:.1f} ({base['system'][6:]}) | {best_t['tps']['median']:.1f} ({best_t['system'][6:]}) "
                  f"| {t['median'] / base['tps']['median']:.2f}× | {t['median'] / best_t['tps']['median']:.2f}× "
                  f"| {100 * e['idle']['median']:.1f} | {100 * e['bubble']['median']:.1f} | {100 * (P - 1) / (M + P - 1):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
