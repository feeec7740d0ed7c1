"""Cpu cards at several torch threads run with passive OpenMP waits (``hostmem.card_wait_env``), so the
computing thread's CPU time measures the work (``pipeline.stage.work_clock``): with spinning threads (libgomp's
default) a card at 2 threads on a loaded 2-core host spent 11-17 s of CPU time a step against 3.1-3.4 s and
took 20-35 s against 4.6-7.0 s (experiments/2026-12-06-first-impressions.md). The user's own wait settings stay."""
from __future__ import annotations

import os
import re
import time

import pytest
import torch

from npu_train.pipeline.stage import work_clock
from npu_train.hostmem import USER_WAIT_SETTINGS, card_wait_env, passive_waits


def test_cpu_cards_at_several_threads_get_passive_waits():
    assert card_wait_env("cpu", 2, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert card_wait_env("cpu", 1, {}) == {}  # no worker threads to wait
    assert card_wait_env("furiosa", 4, {}) == {} and card_wait_env("cuda", 4, {}) == {}
    for k in USER_WAIT_SETTINGS:  # the user's choice stays
        assert card_wait_env("cpu", 2, {k: "1"}) == {}
    assert passive_waits({"OMP_WAIT_POLICY": " passive "}) and not passive_waits({"OMP_WAIT_POLICY": "ACTIVE"})
    assert not passive_waits({})


def test_the_launcher_sets_what_the_cards_would_get():
    """launch/run.py sets OMP_WAIT_POLICY=PASSIVE before torch loads unless one of the same user settings is set."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "launch", "run.py")) as f:
        text = f.read()
    m = re.search(r"if not any\(k in os\.environ for k in (\([^)]*\))\):\n\s+os\.environ\[\"OMP_WAIT_POLICY\"\] = "
                  r"\"PASSIVE\"", text)
    assert m and eval(m.group(1)) == USER_WAIT_SETTINGS, "launch/run.py's wait setting"
    assert text.index('os.environ["OMP_WAIT_POLICY"]') < text.index("import torch") if "import torch" in text \
        else True


def test_work_clock_at_several_threads_only_with_passive_waits(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        assert work_clock("cpu") is None  # spinning threads: CPU time is no measure of the work
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        assert work_clock("cpu") is time.thread_time and work_clock("cuda") is None
        torch.set_num_threads(1)
        monkeypatch.delenv("OMP_WAIT_POLICY")
        assert work_clock("cpu") is time.thread_time
    finally:
        torch.set_num_threads(before)
