"""A launch that writes ``status.json`` without training (``plan=true``) into a run directory an earlier launch
used moves that launch's records to ``previous-<k>/`` first instead of overwriting its exit status (review of
2026-12-03; the training path's rotation is checked by ``test_resume_auto.py``)."""
from __future__ import annotations

import json
import os

from conftest import launch_to_end


def test_dry_run_into_a_used_run_dir_keeps_the_earlier_status(tiny_model, tmp_path):
    first = launch_to_end(tmp_path, tiny_model, "plan=true", "train.lr=1e-4", name="same")
    again = launch_to_end(tmp_path, tiny_model, "plan=true", "train.lr=2e-4", name="same")
    prev = os.path.join(again.run_dir, "previous-1")
    assert again.run_dir == first.run_dir
    assert f"held the records of an earlier launch; moved them to {prev}" in again.flat_stdout, again.tail()
    lines = again.stdout.splitlines()  # the note folded within 100 columns (a review saw 139 under plan=true)
    notes = []
    for k, ln in enumerate(lines):
        if ln.startswith("note: "):
            rest = lines[k + 1:]
            notes.append([ln] + rest[:next((i for i, r in enumerate(rest) if not r.startswith("  ")), len(rest))])
    note = next(n for n in notes if "held the records" in " ".join(n))
    assert all(len(ln) <= 100 for ln in note), note
    with open(os.path.join(prev, "status.json")) as f:
        assert "train.lr=1e-4" in json.load(f)["overrides"]
    with open(os.path.join(again.run_dir, "status.json")) as f:
        assert "train.lr=2e-4" in json.load(f)["overrides"]
    assert {".hydra", "run.log"} <= set(os.listdir(again.run_dir))  # Hydra's and the appended log stay
