"""Commands we print for the user to run (the ``resume`` command) parse back in Hydra to the paths we meant,
also for paths with a space, an apostrophe, a comma, brackets or quotes (issue 41, fault 20)."""
from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from npu_train.config import hydra_value

PATHS = ["/runs/plain-1.2/ck", "/runs/Bob's run/ck", "/runs/a,b/ck", "/runs/[x]/ck", '/runs/q"uote/ck',
         "/runs/back\\slash\\", "/runs/a=b c/ck"]


@pytest.mark.parametrize("path", PATHS)
def test_hydra_value_parses_back_to_the_path(path):
    o = OverridesParser.create().parse_override(f"checkpoint.dir={hydra_value(path)}")
    assert o.value() == path


@pytest.mark.parametrize("path", PATHS)
def test_resume_command_parses_back_in_the_shell_and_in_hydra(path):
    from scripts import LAUNCH_RUN, load_script

    run = load_script(LAUNCH_RUN, "npt_launch_run_quoting")
    cmd = run.resume_command([f"hydra.run.dir={hydra_value(path)}", "train.steps=5"], path)
    argv = shlex.split(cmd)
    i = argv.index(LAUNCH_RUN) if LAUNCH_RUN in argv else [k for k, a in enumerate(argv) if a.endswith("run.py")][0]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(argv[i + 1:])}
    assert parsed["checkpoint.dir"] == path and parsed["hydra.run.dir"] == path
    assert parsed["train.resume"] == "latest" and parsed["train.steps"] == 5
