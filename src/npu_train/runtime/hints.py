"""What to try after the default job: a few commands printed when it ends (issue 40: a first run ended on its
``done:`` line with no word of what comes next).

Printed only after the default job (the embedded model on the shipped text, full fine-tuning, SFT) ran to its
last step and saved a checkpoint: a header naming what each command shows, then each command on its own line,
pasteable as it is: this interpreter as it is reached from here (``python`` where that is it: an activated
virtual environment; else its path, relative under the working directory), the launcher's path from here, the
run's checkpoint root. A command wider than :data:`~npu_train.metrics.report.LINE_COLUMNS` is left out (the
console would fold it, and a folded command does not paste)."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

from npu_train.metrics.report import LINE_COLUMNS

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


def next_steps(cfg, ckpt_root: Optional[str], width: int = LINE_COLUMNS) -> list[str]:
    """The lines to print after the default job ``cfg`` ended with a checkpoint under ``ckpt_root`` (None: no
    checkpoint): ``[]`` after any other job. Each command line is at most ``width`` columns; where none fits, one
    line naming the docs instead."""
    if not _is_default_job(cfg) or not ckpt_root:
        return []
    py, run = interpreter(), launcher_path()
    cmds = [f"{py} -m npu_train.generate {_here(ckpt_root)} --prompt {PROMPT}"]
    if run is not None:
        cmds += [f"{py} {run} train.mode=lora data.format=chat data.source=botchan-chat",
                 f"{py} {run} plan=true model.path=llama-3.1-8b backend=furiosa:auto,furiosa:auto"]
    whats = ["see what it says", "LoRA on chat rows", "an 8B plan for 2 RNGD cards"]
    kept = [(w, c) for w, c in zip(whats, cmds) if len(c) <= width]
    if not kept:  # paths too long for a command line that pastes: where the same is written down
        return ["next: what to try (your data, a real model, LoRA, export, a plan for your cards): docs/usage.md"]
    head = f"next: {', '.join(w for w, _ in kept)}; your own data: docs/data.md"
    return [head, *(c for _, c in kept)]
