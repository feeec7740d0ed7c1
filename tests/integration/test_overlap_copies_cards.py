"""The stage-boundary copies in copy threads (``runtime.overlap_copies=true``, ``runtime/copies.py``) in real card
processes: the losses and masters equal the single-process reference (tests/integration/reference.py, written from
the formulas), as the synchronous copies' do (tolerances as test_zbv_equivalence.py's: losses 1e-6, masters 1e-5).
That the copies overlap and change nothing bit for bit is tests/unit/test_overlap_copies.py's."""
from __future__ import annotations

import pytest

from conftest import cached_reference, check_against_reference, run_pipeline

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]


@pytest.mark.parametrize("P,schedule,tied", [(3, "1f1b", False), (2, "zbv", True)])
def test_copy_threads_match_reference(tiny_model, tiny_model_untied, tmp_path, capfd, P, schedule, tied):
    model = tiny_model if tied else tiny_model_untied
    ref_losses, ref_w = cached_reference(model)
    losses, reader = run_pipeline(model, str(tmp_path), "backend=[" + ",".join(["cpu"] * P) + "]",
                                  f"train.schedule={schedule}", "runtime.overlap_copies=true")
    check_against_reference(losses, reader, ref_losses, ref_w)
    out, err = capfd.readouterr()
    assert (out + err).count("stage-boundary copies: copy thread on") == P  # each card's log line

