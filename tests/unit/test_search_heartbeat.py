"""While the placement search runs, the launcher says what it searches (an 8-card ``train.schedule=auto`` dry run
took 21-138 s on a loaded 2-core host and printed nothing before its table). ``every=0`` prints at each of the
search's ticks (a new plan, every ``TICK_TIMELINES`` timelines), so the test needs no clock."""
from __future__ import annotations

import re

from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.runtime import job


def _cfg(*dotlist):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(["plan=true", *dotlist]))


def test_a_dry_run_says_what_it_searches_before_the_table(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(job, "SEARCH_HEARTBEAT_S", 0.0)
    cards = ",".join(f"furiosa:{k}" for k in range(4))
    job._dry_run(_cfg("model.path=llama-3.2-1b", f"backend=[{cards}]", "train.schedule=auto"), str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    beats = [l for l in out if l.startswith("plan: searching (")]
    assert beats, out[:5]
    table = next(i for i, l in enumerate(out) if l.startswith("card "))
    assert out.index(beats[-1]) < table  # said while it searched, before the table
    # the schedules it tried, by name, with the plans and timelines counted so far
    tried = {m.group(1) for l in beats for m in [re.search(r"so far\): ([a-z0-9-]+)", l)] if m}
    assert {"1f1b", "zb-h2", "zbv"} <= tried, beats
    m = re.match(r"plan: searching \(\d+ s, (\d+) plan\(s\), ([\d,]+) timelines so far\): ", beats[-1])
    assert m and int(m.group(1)) >= 6, beats[-1]
    assert all(len(l) <= 100 for l in out if l.startswith(("plan: searching", "  "))), beats


def test_no_line_within_the_interval_and_the_listener_is_restored():
    """The default interval says nothing for a search shorter than it; the listener is the caller's again
    after the search (a nested or later search reports to its own)."""
    from npu_train.planner.search import PROGRESS

    lines: list[str] = []
    before = PROGRESS.listener
    with job.search_heartbeat(every=3600.0, out=lines.append):
        assert PROGRESS.listener is not before
        PROGRESS.plans += 1
        PROGRESS.tick()
    assert lines == [] and PROGRESS.listener is before
    with job.search_heartbeat(every=0.0, out=lines.append):
        PROGRESS.current = "zb-h2, micro-batch 1 x 4"
        PROGRESS.tick()
    assert lines == ["plan: searching (0 s, 0 plan(s), 0 timelines so far): zb-h2, micro-batch 1 x 4"]
