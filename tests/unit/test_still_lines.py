"""The launcher says what it does in a quiet phase before the card processes start (issue 40): a fresh-clone
review waited 11 s after ``loading the model, planning ...`` (the GGUF header with its tokenizer vocabulary),
13 s before the plan table (tokenising the data) and 11 s after a tracker job's ``job ...`` line (importing the
tracker). :func:`npu_train.metrics.report.still_saying` prints ``still: <what> (N s)`` while such a phase runs."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.metrics import report


def test_a_long_phase_says_still_and_a_short_one_says_nothing():
    said, seen = [], threading.Event()

    def out(text):
        said.append(text)
        seen.set()

    with report.still_saying("data: reading and tokenizing", every=0.01, out=out):
        assert seen.wait(30)  # the block outlasts the first interval: a line comes (no timing is asserted)
    assert said[0].startswith("still: data: reading and tokenizing (") and said[0].endswith(" s)"), said
    n = len(said)
    with report.still_saying("quick", every=60, out=out):
        pass
    assert len(said) == n  # over before the interval: nothing said, and the block did not wait for it


def test_opening_the_trackers_says_so_while_it_takes(monkeypatch, capsys):
    """``_open_trackers`` (wandb / mlflow import for seconds) runs inside a still line naming the trackers."""
    from npu_train.metrics import trackers
    from npu_train.runtime import job

    monkeypatch.setattr(report, "STILL_EVERY_S", 0.01)
    got = []

    def slow_open(names, setup):  # returns once the still line is out (at most 30 s)
        for _ in range(3000):
            got.append(capsys.readouterr().out)
            if "still:" in "".join(got):
                break
            threading.Event().wait(0.01)
        return []

    monkeypatch.setattr(trackers, "open_trackers", slow_open)
    cfg = OmegaConf.structured(Config)
    cfg.metrics.logger = ["wandb", "mlflow"]
    plan = SimpleNamespace(to_dict=lambda: {})
    resume = SimpleNamespace(ckpt_root="/nonexistent", saving=False, resume_dir=None)
    node = SimpleNamespace(is_owner=True)
    assert job._open_trackers(cfg, "/tmp/h40y-none", plan, resume, node) == []
    text = "".join(got) + capsys.readouterr().out
    assert "still: opening the tracker(s) wandb, mlflow (their imports take seconds) (" in text, text
