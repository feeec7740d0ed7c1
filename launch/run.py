#!/usr/bin/env python
"""npu-train launcher (Hydra app): ``python launch/run.py [key=value ...]``.

Examples::

    python launch/run.py                                   # default: SmolLM2-135M on Botchan, backend=cpu,cpu
    python launch/run.py backend=furiosa:auto,furiosa:auto # two RNGD cards
    python launch/run.py plan=true model.path=llama-3.1-8b backend=furiosa:auto,furiosa:auto  # dry-run plan
    python launch/run.py -m train.lr=1e-4,3e-4             # Hydra multirun sweep (one job per value)
    python launch/run.py -m 'backend=choice([cpu],[cpu,cpu])'  # sweep over card lists

``backend=a,b`` (without brackets) always means ONE job with the cards a and b: the launcher
rewrites it to ``backend=[a,b]`` before Hydra parses the command line (plain Hydra would read it
as an ambiguous sweep). To sweep over card lists in multirun mode use ``choice(...)`` of lists.
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

_SWEEP_FUNCS = ("choice(", "range(", "glob(", "interval(", "sort(", "shuffle(", "tag(")


def rewrite_backend_args(argv: list[str]) -> list[str]:
    """Turn ``backend=a,b`` into ``backend=[a,b]`` (one job, two cards); leave lists and sweep functions alone."""
    out = []
    for a in argv:
        m = re.match(r"^(\+{0,2}backend)=(.*)$", a)
        if m:
            val = m.group(2).strip()
            if val.startswith(("'", '"')) and val.endswith(val[0]) and len(val) >= 2:
                val = val[1:-1]
            if "," in val and not val.startswith("[") and not val.startswith(_SWEEP_FUNCS):
                a = f"{m.group(1)}=[{val}]"
        out.append(a)
    return out


def _one_line_hydra_error(text: str) -> str:
    """Hydra's multi-line composition error (e.g. ``Value 'abc' could not be converted to Integer``) as one line."""
    # (Hydra's "+key=value to append" hint is wrong for our structured config: unknown keys are errors)
    skip = ("Set the environment variable HYDRA_FULL_ERROR", "reference_type=", "object_type=",
            "To append to your config use")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith(skip)]
    return "; ".join(lines) if lines else "invalid command line"


def main(cfg, run_dir: str) -> int:
    """Run one job and map how it ended to the exit status (``npu_train.errors``: 0 ok, 1 a card
    process failed, 2 bad input, 130/143 SIGINT/SIGTERM), printing one ``error:`` line for 1 and 2."""
    import logging
    import signal

    from npu_train.errors import JobFailed, UserError, exit_code_for
    from npu_train.runtime.job import run_job

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        run_job(cfg, run_dir)
        return 0
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return exit_code_for(e)
    except KeyboardInterrupt as e:  # Ctrl-C (130) or SIGTERM (143), see npu_train.errors.Interrupted
        extra = getattr(e, "message", "")
        print(f"interrupted by {signal.Signals(exit_code_for(e) - 128).name}: all card processes stopped"
              + (f"; {extra}" if extra else ""), file=sys.stderr, flush=True)
        return exit_code_for(e)
    except (UserError, FileNotFoundError) as e:
        msg = str(e)
        if isinstance(e, FileNotFoundError) and e.filename and msg.startswith("[Errno"):
            msg = f"file not found: {e.filename}"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return exit_code_for(e)


def _main() -> None:
    sys.argv = [sys.argv[0]] + rewrite_backend_args(sys.argv[1:])
    import io

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from npu_train.config import register

    register()
    # Bad overrides (train.accum=abc, unknown keys) fail while Hydra composes the config, before
    # our code runs; Hydra prints a multi-line message and exits 1. Capture stderr until the job
    # starts, so such errors follow the launcher's bad-input convention: one "error:" line, exit 2.
    real_stderr, captured, started = sys.stderr, io.StringIO(), [False]

    @hydra.main(version_base=None, config_path="../conf", config_name="config")
    def app(cfg) -> None:
        if not started[0]:
            started[0] = True
            sys.stderr = real_stderr
            real_stderr.write(captured.getvalue())
        code = main(cfg, HydraConfig.get().runtime.output_dir)
        if code:
            sys.exit(code)

    sys.stderr = captured
    try:
        app()
    except SystemExit as e:
        sys.stderr, text = real_stderr, captured.getvalue()
        if started[0] or e.code != 1 or "Traceback (most recent call last)" in text:
            if not started[0]:
                real_stderr.write(text)
            raise
        print(f"error: {_one_line_hydra_error(text)} -- fix the key=value override (each key's type and "
              "meaning: src/npu_train/config.py; list them with --cfg job)", file=real_stderr, flush=True)
        sys.exit(2)
    finally:
        if sys.stderr is captured:
            sys.stderr = real_stderr
            if not started[0]:
                real_stderr.write(captured.getvalue())


if __name__ == "__main__":
    _main()
