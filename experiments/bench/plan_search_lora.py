"""CPU seconds of ``train.schedule=auto``'s plans (``choose_schedule``, every schedule with and without the
attention core recomputed) on 8 ``furiosa:auto`` cards, with this checkout's split search and with an earlier
one, in the same process; prints both, their ratio and whether the choices are identical.

    git show 999ac3d:src/npu_train/planner/search.py > /tmp/search_before.py
    PYTHONPATH=src flock /tmp/bench.lock .venv/bin/python experiments/bench/plan_search_lora.py \\
        /tmp/search_before.py qwen3-30b-a3b train.mode=lora
"""
import importlib.util
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "unit"))

from npu_train.planner import search  # noqa: E402
from npu_train.planner.schedule_choice import choose_schedule  # noqa: E402
from test_split_search_cost import _request  # noqa: E402


def _with_beat(fs):
    """An earlier ``fastest_split`` (no ``beat``: 2026-12-07, ``search.plan_beats``) taking ``beat`` as a full
    search whose split is then kept only when its step is under ``beat``."""
    def split(pm, L, resident="auto", max_timelines=search.MAX_TIMELINES, stats=None, beat=None):
        sp = fs(pm, L, resident, max_timelines, stats)
        if beat is None or sp is None:
            return sp
        return sp if pm.step_time(sp, [pm.max_resident(i, n) for i, n in enumerate(sp)]) < beat else None
    return split


def main() -> None:
    before_path, preset, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    spec = importlib.util.spec_from_file_location("search_before", before_path)
    before = importlib.util.module_from_spec(spec)
    sys.modules["search_before"] = before
    spec.loader.exec_module(before)
    req = replace(_request(preset, "1f1b", *extra), host_cores=2, strict=False)
    out, cpu = {}, {}
    for name, fs in (("after", search.fastest_split), ("before", _with_beat(before.fastest_split))):
        search.fastest_split = fs
        t = time.process_time()
        ch = choose_schedule(req, "auto")
        cpu[name] = time.process_time() - t
        p = ch.plan
        out[name] = (ch.schedule, ch.recompute, ch.recompute_attention, [st.num_layers for st in p.stages],
                     [len(st.resident) for st in p.stages], p.step_time_s, ch.why)
        print(f"{name}: {cpu[name]:.2f} CPU s, {out[name][:6]}", flush=True)
    print(f"before / after: {cpu['before'] / cpu['after']:.2f}x;",
          "identical choice" if out["after"] == out["before"] else "DIFFERENT choice")


if __name__ == "__main__":
    main()
