"""What to try after the default job: a few commands printed when it ends (issue 40: a first run ended on its
``done:`` line with no word of what comes next).

Printed only after the default job (the embedded model on the shipped text, full fine-tuning, SFT) ran to its
last step and saved a checkpoint: a header naming what each command shows, then each command on its own line,
pasteable as it is: this interpreter as it is reached from here (``python`` where that is it: an activated
virtual environment; else its path, relative under the working directory), the launcher's path from here, the
run's checkpoint root. A command wider than the console is broken between its words with shell line
continuations (:func:`~npu_train.metrics.report.shell_lines`): a folded command does not paste."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

__all__ = ["next_steps", "interpreter", "launcher_path"]

#: the prompt of the generate hint (short: the line must fit 100 columns with a default run directory)
PROMPT = "Hi"


def _here(path: str) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def interpreter() -> str:
    """This Python as a command: ``python`` when that name on ``PATH`` is this interpreter, else its path."""
    found = shutil.which("python")
    if found and os.path.realpath(found) == os.path.realpath(sys.executable) \
            and os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(sys.executable)):
        return "python"
    return _here(sys.executable)


def launcher_path() -> Optional[str]:
    """``launch/run.py`` of this source tree as reached from here, or None (an installed package has none)."""
    import npu_train

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(npu_train.__file__)))),
                        "launch", "run.py")
    return _here(path) if os.path.isfile(path) else None


def _is_default_job(cfg) -> bool:
    return (str(cfg.model.path) == "embedded" and str(cfg.data.source) == "botchan"
            and str(getattr(cfg.train, "mode", "full")) == "full" and str(getattr(cfg.train, "objective", "sft")) == "sft")


def next_steps(cfg, ckpt_root: Optional[str], width: Optional[int] = None) -> list[str]:
    """The lines to print after the default job ``cfg`` ended with a checkpoint under ``ckpt_root`` (None: no
    checkpoint): ``[]`` after any other job. A header, then each command as :func:`~npu_train.metrics.report.
    shell_lines` prints it within ``width`` columns (default :func:`~npu_train.errors.console_columns`): whole
    on one line where it fits, else broken between its words with `` \\`` line continuations, so that pasting
    its lines runs it (a fresh-clone review at 80 columns copied the first line of a folded generate command
    and ran it without its checkpoint path)."""
    import shlex

    from npu_train.errors import console_columns, wrap_words
    from npu_train.metrics.report import shell_lines

    if not _is_default_job(cfg) or not ckpt_root:
        return []
    width = console_columns() if width is None else int(width)
    py, run = interpreter(), launcher_path()
    cmds = [[py, "-m", "npu_train.generate", _here(ckpt_root), "--prompt", PROMPT]]
    if run is not None:
        cmds += [[py, run, "train.mode=lora", "data.format=chat", "data.source=botchan-chat"],
                 [py, run, "plan=true", "model.path=llama-3.1-8b", "backend=furiosa:auto,furiosa:auto"]]
    whats = ["see what it says", "LoRA on chat rows", "an 8B plan for 2 RNGD cards"][:len(cmds)]
    head = wrap_words(f"next: {', '.join(whats)}; your own data: docs/data.md", width)

    def units(argv: list[str]) -> list[str]:  # shell-quoted; an option stays on the line of its value
        out = []
        for a in argv:
            if out and out[-1].startswith("--") and " " not in out[-1]:
                out[-1] += " " + shlex.quote(a)
            else:
                out.append(shlex.quote(a))
        return out

    return [*head, *(ln for argv in cmds for ln in shell_lines(units(argv), width))]
