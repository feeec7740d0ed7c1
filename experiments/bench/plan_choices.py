"""``train.schedule=auto``'s choices (``choose_schedule``, every schedule with and without the attention core
recomputed) for a matrix of launcher requests on ``furiosa:auto`` cards, one JSON line each with its CPU
seconds, and the total: run it with two checkouts' ``src`` and diff the lines without ``cpu_s`` to show a change
to the planner's search keeps every choice (2026-12-07-plan-search.md).

    git -C /work/main archive <before> src | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before/src flock /tmp/bench.lock .venv/bin/python experiments/bench/plan_choices.py > before.jsonl
    PYTHONPATH=src flock /tmp/bench.lock .venv/bin/python experiments/bench/plan_choices.py > after.jsonl

Arguments (optional): presets, comma-separated; modes; card counts (default: llama-3.1-8b, llama-3.1-70b,
qwen3-30b-a3b, mixtral-8x7b; full, lora; 2, 4, 8).
"""
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "unit"))

from npu_train.planner.schedule_choice import choose_schedule  # noqa: E402
from test_split_search_exact import _request  # noqa: E402


def main() -> None:
    args = sys.argv[1:] + [None] * 3
    presets = (args[0] or "llama-3.1-8b,llama-3.1-70b,qwen3-30b-a3b,mixtral-8x7b").split(",")
    modes = (args[1] or "full,lora").split(",")
    cards = [int(c) for c in (args[2] or "2,4,8").split(",")]
    total = 0.0
    for preset in presets:
        for mode in modes:
            for n in cards:
                req = replace(_request(preset, n, "1f1b", f"train.mode={mode}"), strict=False)
                t = time.process_time()
                ch = choose_schedule(req, "auto")
                cpu = time.process_time() - t
                total += cpu
                p = ch.plan
                print(json.dumps({"preset": preset, "mode": mode, "cards": n, "schedule": ch.schedule,
                                  "recompute": ch.recompute, "core": ch.recompute_attention,
                                  "fewest": ch.recompute_fewest, "fits": p.fits,
                                  "split": [st.num_layers for st in p.stages],
                                  "resident": [len(st.resident) for st in p.stages],
                                  "step_s": p.step_time_s, "why": ch.why, "cpu_s": round(cpu, 2)}), flush=True)
    print(json.dumps({"total_cpu_s": round(total, 2)}))


if __name__ == "__main__":
    main()
