"""rev4 CONFUSING 3: a key given twice on the command line (a copy-paste slip appending to a long command) was
taken in silence, last value winning, and echoed twice into the printed resume command. The launcher now says
so in a note naming both values, and the resume command carries each key once, with the value the run used."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

from scripts import LAUNCH_RUN, load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launcher():
    return load_script(LAUNCH_RUN, "_npt_launcher_repeated_keys")


def test_the_note_names_each_repeated_key_and_its_values():
    run = _launcher()
    assert run.repeated_keys_note(["train.steps=2", "train.lr=1e-4"]) is None
    assert run.repeated_keys_note(["train.steps=0", "train.lr=1e-4", "train.steps=2"]) == (
        "note: train.steps given twice (0, then 2): using 2")
    assert run.repeated_keys_note(["train.lr=1", "+train.lr=2", "train.lr=3", "backend=[cpu,cpu]", "backend=cpu"]) == (
        "note: train.lr given 3 times (1, then 2, then 3): using 3; backend given twice ([cpu,cpu], then cpu): "
        "using cpu")


def test_the_resume_command_carries_each_key_once_with_the_last_value():
    run = _launcher()
    words = shlex.split(run.resume_command(["train.steps=0", "data.seq_len=64", "train.steps=2",
                                            "checkpoint.dir=/old", "train.resume=auto"], "/ck"))
    args = words[words.index(os.path.abspath(LAUNCH_RUN)) + 1:]
    assert [a for a in args if a.startswith("train.steps=")] == ["train.steps=2"], words
    assert args[-4:] == ["data.seq_len=64", "train.steps=2", "train.resume=latest", "checkpoint.dir=/ck"], words


def test_a_launch_with_a_key_given_twice_says_so_first():
    """Through the launcher: the note is printed before the launch is refused for the value it used."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, LAUNCH_RUN, "train.steps=5", "train.steps=0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stdout.startswith("note: train.steps given twice (5, then 0): using 0\n"), p.stdout
    assert "train.steps=0 must be a positive integer" in p.stderr, p.stderr

