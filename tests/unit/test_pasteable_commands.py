"""The commands the launcher prints for a user to paste (issue 40: a fresh-clone review at 80 columns copied the
first line of a generate command the console had folded and ran it without its checkpoint path): the
default job's next steps (``runtime/hints.py``) and the interrupt's resume command (``launch/run.py``), at 80
and 100 columns, each line within the width (a word wider than a line alone on its own), every line but a
command's last ending in a `` \\`` continuation that the console's folding keeps whole, and all its lines, pasted
into a shell, the intended argv: the shell removes each backslash-newline before it splits the words (POSIX
2.2.1), then :func:`shlex.split`."""
from __future__ import annotations

import os
import shlex
import signal
import sys

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.metrics.report import LineFolder, fold_long_line, shell_lines
from scripts import LAUNCH_RUN, load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "/srv/" + "experiments-of-a-long-name/" * 3 + "outputs/2026-12-07/05-31-02.123456/checkpoints"


def pasted(lines: list[str]) -> list[str]:
    """What a shell runs from ``lines`` pasted: continuations joined, then split as a shell splits words."""
    return shlex.split("\n".join(lines).replace("\\\n", ""))


def _commands(lines: list[str]) -> list[list[str]]:
    """The commands among printed ``lines`` (those starting with an interpreter), each with its continuations."""
    out, cur = [], None
    for ln in lines:
        if cur is not None:
            cur.append(ln)
        elif "python" in ln.split(" ")[0] or ln.lstrip().startswith("env "):
            cur = [ln]
        if cur is not None and not ln.endswith(" \\"):
            out.append(cur)
            cur = None
    return out


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("root", ["outputs/2026-12-06/12-13-25.123456/checkpoints", LONG, "/tmp/a b/it's"])
def test_next_steps_paste_as_the_intended_commands(monkeypatch, width, root):
    from npu_train.runtime.hints import next_steps

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    lines = next_steps(OmegaConf.structured(Config), root, width=width)
    # what the console prints: the launcher's folding changes none of them
    assert LineFolder(width).feed("\n".join(lines) + "\n") == "\n".join(lines) + "\n"
    cmds = _commands(lines)
    assert [pasted(c) for c in cmds] == [
        ["python", "-m", "npu_train.generate", root, "--prompt", "Hi"],
        ["python", "launch/run.py", "train.mode=lora", "data.format=chat", "data.source=botchan-chat"],
        ["python", "launch/run.py", "plan=true", "model.path=llama-3.1-8b", "backend=furiosa:auto,furiosa:auto"]]
    for ln in lines:
        assert len(ln) <= width or (ln.strip().removesuffix(" \\").count(" ") == 0
                                    and ln.strip().removesuffix(" \\") == shlex.quote(root)), (width, ln)
    assert not any(ln.endswith("--prompt \\") for ln in lines), lines  # an option on the line of its value
    for c in cmds:  # a single line where it fits
        assert len(c) == 1 or len(" ".join(x.removesuffix(" \\").strip() for x in c)) > width - 2, c


def test_shell_lines_break_only_between_words():
    words = ["python", "launch/run.py"] + [f"train.arg{i}=value{i}" for i in range(12)]
    lines = shell_lines(words, 40, indent="  ")
    assert len(lines) > 3 and all(len(ln) <= 40 for ln in lines)
    assert all(ln.endswith(" \\") for ln in lines[:-1]) and not lines[-1].endswith("\\")
    assert lines[0].startswith("  python") and all(ln.startswith("    ") for ln in lines[1:])
    assert pasted(lines) == words
    assert shell_lines(["a", "b"], 40) == ["a b"]
    assert shell_lines(["python", "x" * 30, "--prompt Hi"], 40) == ["python " + "x" * 30 + " \\", "  --prompt Hi"]
    # folding keeps a continued line whole even past the width (a long path): folded, the command ends there
    assert fold_long_line("  " + "x" * 90 + " \\", 80) == "  " + "x" * 90 + " \\"


def _quiet_launcher(monkeypatch, width):
    """launch/run.py loaded as a module with a console ``width`` columns wide, no pre-import checks and a fixed
    starting line; with npu_train.runtime.job (whose ``run_job`` the tests replace) and npu_train.errors."""
    run = load_script(LAUNCH_RUN, "_npt_launcher_for_paste_test")
    import npu_train.errors as errors
    import npu_train.runtime.job as job

    monkeypatch.delenv("NPT_CACHE", raising=False)
    monkeypatch.setattr(errors, "console_columns", lambda stream=None: width)
    monkeypatch.setattr(run, "check_before_imports", lambda cfg: None)
    monkeypatch.setattr(run, "starting_line", lambda cfg: "starting")
    return run, job, errors


@pytest.mark.parametrize("width", [80, 100])
def test_the_interrupt_prints_the_whole_resume_command(monkeypatch, capsys, width):
    run, job, errors = _quiet_launcher(monkeypatch, width)
    ck = LONG + "/step_000002"

    def interrupted(cfg, run_dir, resume_with=None):
        raise errors.Interrupted(signal.SIGINT, "checkpoint ... saved; resume by rerunning the same command with "
                                 "...", checkpoint=ck, checkpoint_dir=LONG)

    monkeypatch.setattr(job, "run_job", interrupted)
    overrides = ["hydra.run.dir=/tmp/a b/run", "train.steps=50", "data.seq_len=256"]
    report: dict = {}
    code = run.main(OmegaConf.structured(Config), "/tmp/x", report,
                    resume_with=lambda root: run.resume_words(overrides, root))
    assert code == 128 + signal.SIGINT and report["checkpoint"] == ck
    err = capsys.readouterr().err.splitlines()
    head = [i for i, ln in enumerate(err) if ln.endswith("resume with:")]
    assert head and err[0].startswith("interrupted by SIGINT"), err
    cmd = err[head[0] + 1:]
    assert pasted(cmd) == [sys.executable, os.path.abspath(LAUNCH_RUN), *overrides, "train.resume=latest",
                           f"checkpoint.dir={LONG}"], cmd
    assert shlex.split(run.resume_command(overrides, LONG)) == pasted(cmd)  # status.json's resume: the same
    assert all(len(ln) <= width or ln.strip().removesuffix(" \\").count(" ") == 0 for ln in err), err
    # status.json's error: the lines joined, the continuations gone
    tee = run._ErrorLineTee(open(os.devnull, "w"))
    tee.write("\n".join(err) + "\n")
    assert tee.last.endswith("resume with: " + run.resume_command(overrides, LONG)), tee.last


@pytest.mark.parametrize("width", [80, 100])
def test_a_failed_card_prints_the_whole_resume_command(monkeypatch, capsys, width):
    """A card process failed after a checkpoint: the ``error:`` line names the failure and the last complete
    checkpoint, then the whole command that resumes from it (not "rerun the same command with ...")."""
    run, job, errors = _quiet_launcher(monkeypatch, width)
    ck = LONG + "/step_000002"
    failure = "card cpu1 (stage 1, layers 2-3) failed during step 3: process killed by signal SIGKILL"

    def failed(cfg, run_dir, resume_with=None):
        raise errors.JobFailed(f"{failure}; last complete checkpoint {ck}; resume by rerunning the same command "
                               "with ...", checkpoint=ck, checkpoint_dir=LONG, failure=failure)

    monkeypatch.setattr(job, "run_job", failed)
    overrides = ["hydra.run.dir=/tmp/a b/run", "train.steps=50", "data.seq_len=256"]
    report: dict = {}
    code = run.main(OmegaConf.structured(Config), "/tmp/x", report,
                    resume_with=lambda root: run.resume_words(overrides, root))
    assert code == 1 and report["checkpoint"] == ck and report["checkpoint_dir"] == LONG
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: card cpu1 (stage 1, layers 2-3) failed during step 3"), err
    assert not any("the same command" in ln for ln in err), err
    head = [i for i, ln in enumerate(err) if ln.endswith("resume with:")]
    assert head, err
    cmd = err[head[0] + 1:]
    assert pasted(cmd) == [sys.executable, os.path.abspath(LAUNCH_RUN), *overrides, "train.resume=latest",
                           f"checkpoint.dir={LONG}"], cmd
    assert all(len(ln) <= width or ln.strip().removesuffix(" \\").count(" ") == 0 for ln in err), err
    # status.json's error: one line, the failure, the checkpoint and the command
    tee = run._ErrorLineTee(open(os.devnull, "w"))
    tee.write("\n".join(err) + "\n")
    assert tee.last == (f"error: {failure}; last complete checkpoint {ck}; resume with: "
                        + run.resume_command(overrides, LONG)), tee.last


def test_a_failed_card_without_a_checkpoint_says_a_rerun_starts_again(monkeypatch, capsys):
    run = load_script(LAUNCH_RUN, "_npt_launcher_for_paste_test")
    import npu_train.errors as errors
    import npu_train.runtime.job as job
    from npu_train.runtime.saving import NO_CHECKPOINT_YET

    monkeypatch.setattr(run, "check_before_imports", lambda cfg: None)
    monkeypatch.setattr(run, "starting_line", lambda cfg: "starting")

    def failed(cfg, run_dir, resume_with=None):
        raise errors.JobFailed(f"card cpu0 failed during start: boom; {NO_CHECKPOINT_YET}", failure="boom")

    monkeypatch.setattr(job, "run_job", failed)
    code = run.main(OmegaConf.structured(Config), "/tmp/x", {}, resume_with=lambda root: ["python", "x"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and f"error: card cpu0 failed during start: boom; {NO_CHECKPOINT_YET}" in err, err
    assert "resume with" not in err


@pytest.mark.parametrize("width", [80, 100])
def test_the_stopped_line_prints_the_whole_resume_command(monkeypatch, width):
    """``train.stop_after`` ended the launch early: the ``stopped:`` lines end with the whole command that goes on
    (launch/run.py's, handed to ``run_job``), each line within the width, pasting as that command."""
    from types import SimpleNamespace

    from npu_train.runtime.job import fold_words
    from npu_train.runtime.saving import end_of_run_line

    run = load_script(LAUNCH_RUN, "_npt_launcher_for_paste_test")
    monkeypatch.delenv("NPT_CACHE", raising=False)
    overrides = ["hydra.run.dir=/tmp/a b/run", "train.steps=50", "train.stop_after=2", "data.seq_len=256"]
    words = run.resume_words(overrides, LONG)
    summ = {"steps_run": 2, "first_loss": 4.0, "last_loss": 3.5, "mean_tokens_per_s": 100.0, "wall_s": 12.0}
    train = SimpleNamespace(steps=50, stop_after=2, offload_update="sync")
    text = end_of_run_line(summ, 2, train, LONG + "/step_000002", LONG, True, "/tmp/a b/run", resume_words=words,
                           width=width)
    lines = fold_words(text, width).splitlines()
    assert LineFolder(width).feed("\n".join(lines) + "\n") == "\n".join(lines) + "\n"  # the console's folding
    assert " ".join(text.split()).startswith("stopped: 2 steps of this launch (train.stop_after=2), at step 2 of "
                                             "train.steps=50"), text
    at = lines.index("  resume with:")
    assert pasted(lines[at + 1:]) == [sys.executable, os.path.abspath(LAUNCH_RUN), *overrides,
                                      "train.resume=latest", f"checkpoint.dir={LONG}"], lines
    assert not any("the same command" in ln for ln in lines), lines
    assert all(len(ln) <= width or ln.strip().removesuffix(" \\").count(" ") == 0 or ln.startswith("  checkpoint: ")
               for ln in lines), lines
    # without the launcher's command (a library caller): what to add to "the same command"
    plain = end_of_run_line(summ, 2, train, LONG + "/step_000002", LONG, True, "/r")
    assert "resume by rerunning the same command with train.resume=latest" in plain, plain


def test_the_launcher_hands_its_resume_command_to_the_job(monkeypatch):
    """launch/run.py's ``main`` gives ``run_job`` the command it prints (the ``stopped:`` line's)."""
    run = load_script(LAUNCH_RUN, "_npt_launcher_for_paste_test")
    import npu_train.runtime.job as job

    monkeypatch.setattr(run, "check_before_imports", lambda cfg: None)
    monkeypatch.setattr(run, "starting_line", lambda cfg: "starting")
    seen = []

    def fake(cfg, run_dir, resume_with=None):
        seen.append(resume_with("/ck"))
        return {}

    monkeypatch.setattr(job, "run_job", fake)
    assert run.main(OmegaConf.structured(Config), "/tmp/x", {}, resume_with=lambda root: ["cmd", root]) == 0
    assert seen == [["cmd", "/ck"]]
