"""Floats the console echoes back to the user (a swept ``train.lr``, the warm-up note) read as a user writes
them: ``1e-4``, not Python's ``0.0001``; ``3e-5``, not ``3e-05`` (issue 40). The expected strings are written
by hand, and each parses back to the same float."""
from __future__ import annotations

import pytest

from npu_train.errors import fmt_number
from npu_train.metrics.report import fmt_override


@pytest.mark.parametrize("x,text", [(1e-4, "1e-4"), (3e-5, "3e-5"), (2.5e-5, "2.5e-5"), (3e-4, "3e-4"),
                                    (1e-3, "0.001"), (2e-3, "0.002"), (0.05, "0.05"), (2.5, "2.5"), (6.0, "6"),
                                    (1e5, "100000"), (1e6, "1e6"), (-1e-4, "-1e-4"), (0.0, "0"),
                                    (1.23456789e-7, "1.23456789e-7"), (0.1 + 0.2, "0.30000000000000004")])
def test_fmt_number(x, text):
    assert fmt_number(x) == text and float(text) == x


def test_fmt_override_changes_only_float_values():
    assert fmt_override("train.lr=0.0001") == "train.lr=1e-4"
    assert fmt_override("train.lr=3e-05") == "train.lr=3e-5"
    for same in ("train.steps=100", "data.source=a.txt", "train.lr=abc", "backend=cpu,cpu", "plan=true",
                 "model.path=/m/1e-4"):
        assert fmt_override(same) == same


def test_the_warmup_note_prints_its_rates_as_written():
    from npu_train.optim.lr import warmup_note

    note = warmup_note(lr=1e-4, warmup_steps=10, total_steps=2)
    assert "of train.lr=1e-4)" in note and "peaks at 2e-5 " in note, note


@pytest.mark.parametrize("n,text", [(1.95e9, "1.95 GB"), (10**8, "0.10 GB"), (10**8 - 1, "100.0 MB"),
                                    (5 << 20, "5.2 MB"), (0, "0.0 MB")])
def test_sizes_on_disk_are_decimal(n, text):
    """Checkpoint and export sizes and free space: GB = 1e9 bytes from 0.1 GB on, else MB = 1e6 (memory is GiB)."""
    from npu_train.errors import fmt_disk_bytes

    assert fmt_disk_bytes(n) == text
