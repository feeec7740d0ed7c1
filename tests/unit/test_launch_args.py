"""``launch/run.py``'s checks of the raw command line before Hydra parses it (issue 40)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npu_train.errors import one_refusal

RUN = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "run.py")


@pytest.mark.parametrize("args, fix", [
    (["backend=cpu,", "cpu"], "backend=cpu,cpu"),
    (["backend=cpu", ",cpu"], "backend=cpu,cpu"),
    (["-m", "train.lr=1e-4,", "3e-4"], "train.lr=1e-4,3e-4"),
])
def test_space_after_a_comma_is_one_error_line(args, fix, tmp_path):
    """``backend=cpu, cpu`` (the shell's two arguments) is one ``error:`` line naming the list without spaces,
    exit status 2, not Hydra's ``no viable alternative at input '[cpu,]'``; nothing is written."""
    p = subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = one_refusal(p.stderr)
    assert err, p.stderr
    assert "no spaces inside a list" in err and f"write {fix}" in err and "viable" not in err, err
    assert os.listdir(tmp_path) == []  # before Hydra: no outputs/ directory


def test_lists_without_spaces_pass_the_check():
    sys.path.insert(0, os.path.dirname(RUN))
    try:
        from run import spaced_list_error
    finally:
        sys.path.pop(0)
    assert spaced_list_error(["backend=cpu,cpu", "-m", "train.lr=1e-4,3e-4", "plan=true"]) is None
    assert spaced_list_error(["backend=[cpu,cpu]", "hydra.run.dir=/tmp/x"]) is None


def test_a_comma_list_without_m_names_the_sweep(tmp_path):
    """rev4 POLISH 5: ``train.lr=1e-4,3e-4`` without ``-m`` passed Hydra's three-way message through, its quotes
    escaped (``key=\\'value1,value2\\'``): one line that leads with the sweep (``-m``), then the list and string
    forms for this key, each pasteable; nothing is written."""
    p = subprocess.run([sys.executable, RUN, "train.lr=1e-4,3e-4"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = " ".join(one_refusal(p.stderr).split())
    assert err == ("error: train.lr=1e-4,3e-4: values separated by commas are a sweep: add -m to run one job per "
                   "value (python launch/run.py -m train.lr=1e-4,3e-4); one value holding a comma: "
                   "train.lr=[1e-4,3e-4] for a list, \"train.lr='1e-4,3e-4'\" for a string"), err
    assert os.listdir(tmp_path) == []
