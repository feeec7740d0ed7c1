"""Soak (issue #4, heavy): 200 optimizer steps of the tiny model on 2 card processes with resident
and offloaded layers mixed (``train.resident_layers=[1,2]``): no error, and neither the host RSS
of any process of the job (launcher and card processes) nor the job's ``/dev/shm`` usage grows
after warm-up.

RSS is sampled with psutil from this test while the job runs as a subprocess; the step each
sample belongs to is the number of lines in ``metrics.jsonl`` at that moment. Compared: the mean
RSS over steps 20-40 against the mean over steps 180-200, allowing max(5 %, 10 MiB) of noise.
Figures are printed (``pytest -s``) and written to ``<tmp>/soak.json``; the last measured run is
recorded in ``experiments/2026-11-29-soak.md``.
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from launch_util import Job

MIB = 2 ** 20
STEPS = 200
EARLY, LATE = (20, 40), (180, 200)


def _shm_bytes(prefix: str) -> int:
    total = 0
    for f in os.listdir("/dev/shm"):
        if f.startswith(prefix):
            try:
                total += os.stat(f"/dev/shm/{f}").st_blocks * 512  # pages actually used
            except FileNotFoundError:
                pass
    return total


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_soak_no_growth(tiny_model, tmp_path):
    job = Job(tmp_path, tiny_model, f"train.steps={STEPS}", "train.resident_layers=[1,2]")
    samples = []  # (step, {name: rss}, shm bytes)
    try:
        info = job.job_info()
        procs = {"launcher": psutil.Process(job.proc.pid)}
        procs.update({f"card{c['rank']}": psutil.Process(c["pid"]) for c in info["cards"]})
        t0 = time.monotonic()
        while job.poll_exit() is None and time.monotonic() - t0 < 800:
            step = len(job.losses())
            try:
                rss = {n: p.memory_info().rss for n, p in procs.items()}
            except psutil.NoSuchProcess:
                break
            samples.append((step, rss, _shm_bytes(info["shm_prefix"])))
            time.sleep(0.02)
        rc = job.wait(60)
    finally:
        job.kill_all()
    assert rc == 0, job.tail()
    assert len(job.losses()) == STEPS

    def window(lo, hi):
        sel = [s for s in samples if lo <= s[0] < hi]
        assert len(sel) >= 5, f"only {len(sel)} samples in steps {lo}-{hi}"
        return sel

    early, late = window(*EARLY), window(*LATE)
    figures = {"steps": STEPS, "samples": len(samples), "wall_s": job.t_exit - job.t_start, "rss_mib": {}}
    for name in procs:
        a = sum(s[1][name] for s in early) / len(early)
        b = sum(s[1][name] for s in late) / len(late)
        figures["rss_mib"][name] = {"steps_20_40": a / MIB, "steps_180_200": b / MIB, "growth_mib": (b - a) / MIB}
    shm_a = max(s[2] for s in early)
    shm_b = max(s[2] for s in late)
    figures["shm_bytes"] = {"steps_20_40": shm_a, "steps_180_200": shm_b}
    with open(tmp_path / "soak.json", "w") as f:
        json.dump(figures, f, indent=1)
    print("\nsoak figures:", json.dumps(figures, indent=1))
    for name, r in figures["rss_mib"].items():
        allowed = max(0.05 * r["steps_20_40"], 10.0)
        assert r["growth_mib"] <= allowed, f"{name}: RSS grew {r['growth_mib']:.1f} MiB (allowed {allowed:.1f})"
    assert shm_a > 0 and shm_b <= shm_a, figures["shm_bytes"]
