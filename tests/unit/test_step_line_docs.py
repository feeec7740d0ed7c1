"""The docs describe the step line as it is printed (issue 40): a step is folded at 100 columns into two lines,
fresh or resumed, three for a mixture of experts (``tests/unit/test_report.py`` checks the printing), and
``expert load`` is explained where the step line is."""
from __future__ import annotations

import os
import re

from npu_train.metrics.report import fold_fields

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return " ".join(f.read().split())


def test_a_moe_step_after_a_resume_folds_past_two_lines():
    """The progress fields of a 2-card MoE step after a resume (widths as the step line prints them) are
    wider than 100 columns, so with the details the step is three lines: "two lines" cannot be the rule."""
    head = ["step  3/20", "loss 3.7435 (avg since resume 3.8979)", "gnorm 3.058", "182 tok/s", "MFU 76.3%",
            "aux 0.0123", "expert load 1.42/1.37", "5.62 s (plan 6.27)"]
    assert len(" | ".join(head)) > 100
    assert fold_fields(head).count("\n") == 1


def test_docs_say_when_a_step_takes_more_than_two_lines_and_explain_expert_load():
    readme, job = _read("README.md"), _read("docs/default-job.md")
    assert not re.search(r"one step in two lines", readme), "README: a step is not always two lines"
    assert "two lines, fresh or resumed (three for a mixture of experts" in readme and "expert load" in readme
    assert "A step is two lines, fresh or resumed; a mixture of experts' is three" in job
    assert "avg since resume" in job and "`mem GiB max 2.70 (run 3.10, plan 3.39)`" in job
    assert re.search(r"`expert load` is one number per card: .*max/mean.*1\.00", job)


def test_readme_says_its_example_step_is_the_full_form_and_what_a_terminal_shows():
    """The README's example step carries the ``[fwd/bwd ...]`` breakdown and the ETA, which only ``run.log`` and
    plain output print: a terminal (live bar) shows a shorter step, and the README says so next to it."""
    readme = _read("README.md")
    example = readme[readme.index("step 3/20 | loss 3.7435"):]
    assert "[fwd/bwd" in example[:300] and "ETA" in example[:300]
    after = example[:700]
    assert "`run.log`" in after and "runtime.progress=plain" in after and "terminal" in after, after
    assert "leave out the `[fwd/bwd ...]` breakdown and the ETA" in after, after  # the terminal's step


def test_readme_shows_the_terminal_step_as_reporter_short_prints_it():
    """The README's 80-column terminal step is what the terminal's step line (``Reporter._short``: the progress,
    then the memory, folded by ``fit_progress`` and ``fold_fields``) prints for its example's fields."""
    from npu_train.metrics.report import fit_progress

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    shown = re.search(r"on 80 columns:\n\n```\n(.*?)\n```", readme, flags=re.S)
    assert shown, "README lost its 80-column terminal step"
    head = ["step  3/20", "loss 3.7435 (avg 3.8979)", "gnorm 3.058", "182 tok/s", "MFU 76.3%", "5.62 s (plan 6.27)"]
    head, rest = fit_progress(head, ["mem GiB 2.70/2.06 (plan 3.39/2.92)"], 80)
    assert shown.group(1) == fold_fields(head, 80) + "\n" + fold_fields(rest, 80, first_indent="  ")
