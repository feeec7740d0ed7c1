#!/usr/bin/env python
"""npu-train launcher (Hydra app): ``python launch/run.py [key=value ...]``; usage in README.md and docs/launch.md.

Rewrites ``backend=a,b`` to ``backend=[a,b]`` (one job, two cards) before Hydra parses the command line, runs
the job (:func:`run_one`), writes ``<run dir>/status.json`` and ``run.log``, and maps how it ended to the exit
status (``npu_train.errors``). Multirun jobs run concurrently (``npu_train.metrics.sweep``)."""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")))

# OpenMP threads that sleep when idle, in the launcher and (inherited) its card processes, unless the user chose
# (npu_train.hostmem.USER_WAIT_SETTINGS; card_wait_env says why): read once, when torch loads, so here
if not any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

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


def spaced_list_error(argv: list[str]) -> "str | None":
    """The error for a list override split by the shell at a space after a comma (``backend=cpu, cpu`` arrives
    as ``backend=cpu,`` and ``cpu``; ``backend=cpu ,cpu`` as ``backend=cpu`` and ``,cpu``), which Hydra would
    refuse as ``no viable alternative at input '[cpu,]'``; None when there is no such argument."""
    def bare(x: str) -> bool:  # a piece of a value, not an override or an option
        return "=" not in x and not x.startswith("-")

    for i, a in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if "=" in a and a.endswith(","):
            parts = [a] + ([nxt] if bare(nxt) else [])
        elif "=" in a and nxt.startswith(",") and bare(nxt):
            parts = [a, nxt]
        else:
            continue
        joined = "".join(parts).rstrip(",")
        return f"{' '.join(parts)!r}: no spaces inside a list: write {joined}"
    return None


def _one_line_hydra_error(text: str) -> str:
    """Hydra's multi-line composition error (e.g. ``Value 'abc' could not be converted to Integer``) as one line."""
    # (Hydra's "+key=value to append" hint is wrong for our structured config: unknown keys are errors)
    skip = ("Set the environment variable HYDRA_FULL_ERROR", "reference_type=", "object_type=",
            "To append to your config use")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith(skip)]
    from npu_train.config import REMOVED_KEYS

    lines += [f"{k} was removed: {why}" for k, why in REMOVED_KEYS.items() if k in text]  # name what replaced it
    return "; ".join(lines) if lines else "invalid command line"


def _unknown_key_line(text: str) -> "str | None":
    """Hydra's refusal of an override whose key the config does not have (``trian.accum=4``: ``Could not
    override 'trian.accum'`` ... ``Key 'trian' not in 'Config'``) as one line with the closest key
    (:func:`npu_train.config.unknown_key_error`); None for any other error."""
    m = re.search(r"Could not override '([^']+)'", text)
    if not m or not re.search(r"Key '[^']*' not in '", text):
        return None
    from npu_train.config import unknown_key_error

    return unknown_key_error(m.group(1))


_EXPECTED = {"Float": "a number (float)", "Integer": "a whole number (integer)"}


def _override_value_line(text: str) -> "str | None":
    """Hydra's refusal of an override's value as one line in the project's words: a value of the wrong type
    (``train.lr=abc`` -> ``train.lr=abc: expected a number (float)``, with the default as an example) or an
    override Hydra's grammar cannot parse (``backend=cpu;cpu``: cards are separated by commas); None for any
    other error. A comma-separated value without ``-m`` (``train.lr=1e-4,3e-4``) is named as the sweep it most
    likely meant."""
    m = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if m:
        ov = m.group(1)
        key, _, val = ov.partition("=")
        return (f"{ov}: values separated by commas are a sweep: add -m to run one job per value (python "
                f"launch/run.py -m {ov}); one value holding a comma: {key}=[{val}] for a list, \"{key}='{val}'\" "
                "for a string")
    m = re.search(r"LexerNoViableAltException: (\S+)", text)
    if m:
        ov = m.group(1)
        key, _, val = ov.partition("=")
        if key.lstrip("+~") == "backend" and ";" in val:
            return f"{ov}: cannot be parsed; separate cards with commas: backend={val.replace(';', ',')}"
        return (f"{ov}: cannot be parsed (Hydra's override grammar); quote a value that holds special "
                f"characters: \"{key}='{val}'\"")
    m = re.search(r"Error merging override (\S+)\n.*?(?:could not be converted to (\w+)|(is not a valid bool))",
                  text, flags=re.S)
    if not m or not (m.group(3) or m.group(2) in _EXPECTED):
        return None
    ov = m.group(1)
    key = ov.partition("=")[0].lstrip("+~")
    from omegaconf import OmegaConf

    from npu_train.config import Config

    default = OmegaConf.select(OmegaConf.structured(Config), key, default=None)
    shown = str(default).lower() if isinstance(default, bool) else default
    example = f", e.g. {key}={shown}" if default is not None else ""
    return f"{ov}: expected {'true or false (boolean)' if m.group(3) else _EXPECTED[m.group(2)]}{example}"


def _output_dir_error(text: str) -> "str | None":
    """The OS error of Hydra's ``mkdir`` of the run/sweep directory, or of its first write into it
    (``run.log``, ``multirun.yaml``, ``.hydra/``): a path through a file, no permission, a read-only
    filesystem; from the traceback Hydra prints before our code runs, as ``"[Errno 20] Not a
    directory: '/x/run'"``; None for any other failure."""
    m = re.findall(r"^(?:NotADirectoryError|FileNotFoundError|PermissionError|FileExistsError|IsADirectoryError|"
                   r"OSError): (.+)$", text, flags=re.M)
    if not m:
        return None
    # Hydra's own writes into the directory: its mkdir, the job's log file, multirun.yaml, .hydra/
    ours = re.search(r"[/'](run\.log|multirun\.yaml|\.hydra)(/[^']*)?'$", m[-1].strip())
    full = "No space left on device" in m[-1]  # Hydra's writes of .hydra/*.yaml on a full disk name no file
    return m[-1].strip() if "mkdir" in text or ours or full else None


def print_error(message: str, stream=None) -> None:
    """The launcher's ``error:`` line for ``message``, folded at words within 100 columns, the message's own
    lines indented under it (:func:`npu_train.errors.refusal_text`), to ``stream`` (stderr)."""
    from npu_train.errors import refusal_text

    print(refusal_text(message), file=stream or sys.stderr, flush=True)


def check_before_imports(cfg) -> None:
    """Refuse a malformed ``backend`` list (an unknown kind, ``cpu:1``, a card named twice: BackendSpecError,
    torch-free) and a ``data.seq_len`` over the model's limits (read from its config.json, GGUF header or preset:
    :func:`npu_train.model.limits.check_seq_len_early`) before ``run_job`` and its imports: torch alone is 1.4 s
    of CPU, and a fresh-clone review on a loaded 2-core host waited 19 s for a bad backend's one line and 14 s for
    ``data.seq_len=100000``'s. CUDA cards that certainly do not exist here (a CPU-only torch, no NVIDIA driver,
    an index past the driver's GPUs: :func:`npu_train.backends.spec.check_cuda_early`; not for ``plan=true``,
    which may plan for another machine) are refused here too; the others are checked when the job starts. A
    training run's ``model.path`` that does not exist is refused here as well (it waited for the torch import)."""
    from npu_train.backends.spec import check_cuda_early, parse_backend_list
    from npu_train.model.limits import check_seq_len_early

    cards = parse_backend_list(cfg.backend)
    if not cfg.plan:
        check_cuda_early(cards)
    if not cfg.plan and not getattr(cfg, "calibrate", False):  # training reads it: a missing one is refused
        from npu_train.model.files import check_exists, resolve_model_path  # before 'still: ... torch import'

        check_exists(os.path.abspath(resolve_model_path(str(cfg.model.path))))
    check_seq_len_early(int(cfg.data.seq_len), str(cfg.model.path))


def check_resume_early(cfg, run_dir: str) -> None:
    """Refuse ``train.resume=latest`` without ``checkpoint.dir`` when this launch's run directory holds no
    checkpoints directory at all (a new default directory: the user forgot checkpoint.dir), before the plan
    search, naming the newest run directories beside it that hold complete checkpoints (torch-free: a
    checkpoint is complete once its ``manifest.json`` is written). A ``checkpoints`` directory with only
    interrupted saves is left to the job, whose refusal names them."""
    import glob

    from npu_train.errors import ConfigError

    if cfg.plan or str(cfg.train.resume) != "latest" or cfg.checkpoint.dir:
        return
    ck = os.path.join(os.path.abspath(run_dir), "checkpoints")
    if os.path.isdir(ck) and os.listdir(ck):
        return
    base = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))  # outputs/ of outputs/<date>/<time>
    runs: dict = {}
    for m in glob.glob(os.path.join(glob.escape(base), "*", "*", "checkpoints", "*", "manifest.json")):
        root = os.path.dirname(os.path.dirname(m))
        runs[root] = max(runs.get(root, 0.0), os.path.getmtime(m))
    newest = sorted(runs, key=runs.get, reverse=True)[:3]
    where = (f"; the newest with checkpoints under {base}: {', '.join(newest)}" if newest else
             f"; no run under {base} holds one")
    raise ConfigError(f"train.resume=latest without checkpoint.dir resumes from this launch's run directory, "
                      f"{os.path.abspath(run_dir)}, which holds no checkpoint: set checkpoint.dir=<the run's "
                      f"checkpoints directory>{where}; or drop train.resume (train.resume=auto starts fresh when "
                      "there is none)")


def starting_line(cfg) -> str:
    """The launcher's first line, printed before the heavy imports (torch, the job modules: seconds on a loaded
    host, where a fresh-clone review waited 13-14 s for a first line): what it runs and on which cards, folded at
    words within the console's width (``min(terminal columns, 100)``; a list of 8 cards, ``furiosa:auto,...`` as
    one word, was 114 columns: it is then spelled with spaces after the commas so that it folds)."""
    from npu_train.errors import console_columns, refusal_text

    backend = cfg.backend
    what = ("plan=true (a dry run)" if cfg.plan else
            "calibrate=true" if getattr(cfg, "calibrate", False) else "training")
    for sep in (",", ", "):
        cards = sep.join(str(c) for c in backend) if not isinstance(backend, str) else backend
        width = console_columns(sys.stdout)
        text = refusal_text(f"{what}, model.path={cfg.model.path} on backend={cards}: loading the model, planning ...",
                            prefix="npu-train: ", width=width)
        if max(len(ln) for ln in text.splitlines()) <= width:
            break
    return text


def quiet_torch_logs() -> None:
    """torch's loggers at WARNING unless set otherwise: torch sets that itself at the end of its import, but a
    Ctrl-C during the import (``interrupted by SIGINT while preparing``) skips it, and Hydra's root logger is at
    INFO, so torch's atexit hook printed ``FakeTensor cache stats:`` / ``cache_hits: 0`` lines after the
    interrupted line, on the console and in run.log. Warnings still show; ``TORCH_LOGS`` still applies (torch's
    import sets the levels it names)."""
    import logging

    log = logging.getLogger("torch")
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)


def main(cfg, run_dir: str, report: "dict | None" = None, resume_with=None) -> int:
    """Run one job and map how it ended to the exit status (``npu_train.errors``: 0 ok, 1 a card
    process failed, 2 bad input, 130/143 SIGINT/SIGTERM), printing one ``error:`` line for 1 and 2.
    An interrupted job puts ``checkpoint`` (saved by this launch, or None) and ``checkpoint_dir``
    (its checkpoint root) into ``report`` when given (for ``status.json``); a launch that
    ``train.stop_after`` ended early puts ``stopped_at`` (its last step), ``steps`` and
    ``checkpoint_dir`` (None without a checkpoint); a failed card process, ``checkpoint`` (the run's
    latest complete checkpoint, or None) and ``checkpoint_dir``; ``train.resume=auto`` on a finished
    run, ``complete_at`` (its checkpoint's step), ``steps`` and ``checkpoint``. ``resume_with``: the words of
    the command that resumes from a checkpoint root (:func:`resume_words`), printed whole after an interrupt
    that left a checkpoint, one word-boundary ``\\`` continuation per line where it is wider than the console
    (a folded command pastes only its first line: a fresh-clone review ran it without its checkpoint path)."""
    import logging
    import signal

    from npu_train.errors import Interrupted, JobFailed, UserError, exit_code_for, out_of_space

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.raiseExceptions = False  # a log record run.log cannot take (a full disk): no "Logging error" traceback
    quiet_torch_logs()
    try:
        try:
            check_before_imports(cfg)
            check_resume_early(cfg, run_dir)
            print(starting_line(cfg), flush=True)
            from npu_train.runtime.job import run_job

            summ = run_job(cfg, run_dir, resume_with=resume_with)
        finally:  # the outcome is decided: a signal from now on is only noted (_hold_signals)
            _SIGNALS_HELD_FOR_JOB[0] = False
        if report is not None and isinstance(summ, dict) and summ.get("stopped_at") is not None:
            report.update(stopped_at=summ["stopped_at"], steps=int(cfg.train.steps),
                          checkpoint_dir=summ.get("checkpoint_dir"))
        if report is not None and isinstance(summ, dict) and summ.get("complete_at") is not None:
            report.update(complete_at=summ["complete_at"], steps=int(cfg.train.steps),
                          checkpoint=summ.get("checkpoint"))
        return 0
    except JobFailed as e:  # the message names the last complete checkpoint and the resume command, if any
        if report is not None:
            report.update(checkpoint=e.checkpoint, checkpoint_dir=e.checkpoint_dir)
        cmd = _resume_lines(resume_with, e.checkpoint_dir if e.checkpoint else None)
        if cmd:  # the whole command, pasteable, in place of "rerun the same command with ..."
            print_error(f"{e.failure}; last complete checkpoint {e.checkpoint};")
            print("\n".join(cmd), file=sys.stderr, flush=True)
        else:
            print_error(str(e))
        return exit_code_for(e)
    except KeyboardInterrupt as e:  # Ctrl-C (130) or SIGTERM (143), see npu_train.errors.Interrupted
        extra = getattr(e, "message", "")
        ck, ck_dir = getattr(e, "checkpoint", None), getattr(e, "checkpoint_dir", None)
        if ck is None and not extra:  # stopped before this launch trained or saved: the run's own latest one
            ck, ck_dir, extra = _latest_checkpoint(cfg, run_dir)
        if report is not None:
            report.update(checkpoint=ck, checkpoint_dir=ck_dir)
        head = e.headline() if isinstance(e, Interrupted) else f"interrupted by {signal.Signals(exit_code_for(e) - 128).name}"
        from npu_train.errors import console_columns
        from npu_train.runtime.job import fold_words

        # folded at words to the terminal, at most 100 columns (redirected too: a log has no terminal to fold
        # it); status.json gets it whole (_ErrorLineTee joins the folded lines)
        cmd = _resume_lines(resume_with, ck_dir if ck else None)
        if cmd:  # the whole command, pasteable, in place of "rerun the same command with ..."
            extra = f"{'checkpoint' if getattr(e, 'checkpoint', None) else 'last complete checkpoint'} {ck}" + (
                " saved" if getattr(e, "checkpoint", None) else "") + ";"
        print(fold_words(head + (f"; {extra}" if extra else ""), console_columns(sys.stderr)), file=sys.stderr,
              flush=True)
        if cmd:
            print("\n".join(cmd), file=sys.stderr, flush=True)
        return exit_code_for(e)
    except (UserError, FileNotFoundError) as e:
        msg = str(e)
        if isinstance(e, FileNotFoundError) and e.filename and msg.startswith("[Errno"):
            msg = f"file not found: {e.filename}"
        print_error(msg)
        return exit_code_for(e)
    except OSError as e:
        if not out_of_space(e):
            raise
        ck, ck_dir, note = _latest_checkpoint(cfg, run_dir)
        if report is not None:
            report.update(checkpoint=ck, checkpoint_dir=ck_dir)
        where = f"writing {e.filename} " if e.filename else ""
        cmd = _resume_lines(resume_with, ck_dir if ck else None)
        if cmd:  # the whole command (status.json, which names it too, may not be written on a full disk)
            note = f"last complete checkpoint {ck};"
        print_error(f"no space left on device {where}(hydra.run.dir={run_dir}): free disk space there or set "
                    f"hydra.run.dir to a directory on a larger disk" + (f"; {note}" if note else ""))
        if cmd:
            print("\n".join(cmd), file=sys.stderr, flush=True)
        return 1


def _resume_lines(resume_with, checkpoint_dir: "str | None") -> "list[str] | None":
    """The lines printed on stderr after an ``error:`` / ``interrupted`` line that ends naming a checkpoint:
    :func:`~npu_train.metrics.report.resume_lines` of the command that resumes from ``checkpoint_dir``
    (``resume_with``: :func:`main`'s) at the console's width; None without a checkpoint or a command.
    Joined by :class:`_ErrorLineTee`, the message ends ``...; resume with: <the command>`` (``status.json``)."""
    if not checkpoint_dir or resume_with is None:
        return None
    from npu_train.errors import console_columns
    from npu_train.metrics.report import resume_lines

    return resume_lines(resume_with(checkpoint_dir), console_columns(sys.stderr))


class _StderrCapture:
    """Holds Hydra's composition errors until the job starts (see ``_main``); inert in joblib workers."""

    def __init__(self) -> None:
        import io

        self.real, self.buf, self.started = sys.stderr, io.StringIO(), False

    def __reduce__(self):
        return (_StderrCapture._inert, ())

    @staticmethod
    def _inert() -> "_StderrCapture":
        c = _StderrCapture.__new__(_StderrCapture)
        c.real, c.buf, c.started = None, None, True
        return c

    def release(self) -> None:
        if not self.started:
            self.started = True
            sys.stderr = self.real
            self.real.write(self.buf.getvalue())


class _ErrorLineTee:
    """Wraps stderr: passes everything through and remembers the last ``error:``/``interrupted`` line."""

    def __init__(self, inner) -> None:
        self.inner, self.last, self._part, self._open = inner, "", "", False

    def write(self, s: str) -> int:
        self._part += s
        *lines, self._part = self._part.split("\n")
        for line in lines:
            if line.startswith(("error:", "interrupted")):
                self.last, self._open = line, True
            elif self._open and line.startswith("  "):  # a folded line (refusal_text, fold_words, shell_lines)
                self.last += " " + line.strip().removesuffix(" \\")
            else:
                self._open = False
        return self.inner.write(s)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _LogTee:
    """Wraps stdout or stderr for one job: passes everything through to the console and appends it
    to the job's log file (``log``, a line-buffered text file), so the file holds the console output.
    ``fold`` (stdout): a line wider than the console (``min(terminal columns, 100)``; 100 redirected) is folded at words on the way
    (:class:`~npu_train.metrics.report.LineFolder`: a log or a pipe has no terminal to fold it; stderr's
    ``error:`` / ``warning:`` lines stay whole, one line each, for status.json and grep).
    A failing log write (a full disk) stops the copy, never the console output; a failing console write (the
    terminal closed: SIGHUP, then EIO) stops the console output, never the log or the job."""

    def __init__(self, inner, log, fold: bool = False, tag: str = "") -> None:
        from npu_train.errors import console_columns
        from npu_train.metrics.report import LineFolder

        self.inner, self.log = inner, log
        # the terminal's width, at most 100 (a file or a pipe: 100), less the tag's columns (reserved by the
        # caller, errors.reserve_console_columns): the width the job folds its own text to
        self.folder = LineFolder(console_columns(inner)) if fold else None
        # ``tag``: put before every console line (a concurrent sweep job's ``[job 1/2] ``), not in the log
        self.tag, self._line_start = tag, True

    def write(self, s: str) -> int:
        n = len(s)
        self._put(self.folder.feed(s) if self.folder is not None else s)
        return n

    def _tagged(self, s: str) -> str:
        if not self.tag:
            return s
        out = []
        for piece in re.findall(r"[^\n]*\n|[^\n]+", s):
            out.append(self.tag + piece if self._line_start else piece)
            self._line_start = piece.endswith("\n")
        return "".join(out)

    def _put(self, s: str) -> None:
        if not s:
            return
        if self.inner is not None:
            try:
                self.inner.write(self._tagged(s))
            except (OSError, ValueError):
                self.inner = None
        if self.log is not None:
            try:
                self.log.write(s)
            except (OSError, ValueError):
                self.log = None

    def flush(self) -> None:
        if self.folder is not None:
            self._put(self.folder.drain())
        if self.inner is not None:
            try:
                self.inner.flush()
            except (OSError, ValueError):
                self.inner = None
        if self.log is not None:
            try:
                self.log.flush()
            except (OSError, ValueError):
                self.log = None

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _HeldLog:
    """The job's log file (``f``) while the run directory holds an earlier launch's ``run.log`` (a reused
    ``hydra.run.dir``): this launch's lines wait in memory until it is past its refusals (:meth:`release`, via
    ``npu_train.metrics.report.launch_accepted`` when it begins writing its records), then go to the file in
    order and later ones straight after. A launch refused before that (exit 2: bad input, another run's
    checkpoints in the checkpoint dir) drops them (:meth:`drop`): nothing it printed is mixed into the earlier run's
    log (the console had every line). Issue 40: a refused launch appended its plan and ``error:`` lines."""

    def __init__(self, f) -> None:
        self.f, self.parts = f, []

    def write(self, s: str) -> int:
        if self.parts is None:
            return self.f.write(s)
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        if self.parts is None:
            self.f.flush()

    def release(self) -> None:
        """Write the held lines and stop holding."""
        if self.parts is not None:
            held, self.parts = "".join(self.parts), None
            self.f.write(held)

    def drop(self) -> None:
        """Forget the held lines of a launch refused before :meth:`release` (after it, nothing changes)."""
        if self.parts is not None:
            self.parts = []

    def close(self) -> None:
        self.release()
        self.f.close()


def hold_if_reused(log):
    """``log`` (the job's log file, or None) as a :class:`_HeldLog` when the file already holds an earlier
    launch's lines, registered to be released once the launch is accepted; else ``log`` itself."""
    if log is None:
        return None
    try:
        reused = os.path.getsize(log.name) > 0
    except (OSError, AttributeError, TypeError):
        reused = False
    if not reused:
        return log
    from npu_train.metrics.report import LAUNCH_ACCEPTED

    held = _HeldLog(log)
    LAUNCH_ACCEPTED.append(held.release)
    _log_records_through(held, log.name)
    return held


def _log_records_through(held: "_HeldLog", path: str) -> None:
    """Hydra's file logger into ``path`` (log records: library warnings) replaced by one writing through
    ``held``, so a refused launch's records stay out of the earlier run's ``run.log`` as its lines do."""
    import logging

    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and os.path.abspath(h.baseFilename) == os.path.abspath(path):
            repl = logging.StreamHandler(held)
            repl.setLevel(h.level)
            repl.setFormatter(h.formatter)
            root.removeHandler(h)
            h.close()
            root.addHandler(repl)


def open_job_log(run_dir: str, job_name: str):
    """The job's log file for appending (line-buffered): the file of Hydra's file logger in ``run_dir``
    (``hydra/job_logging`` default: ``<run dir>/<job name>.log``, i.e. ``run.log``), so log records and
    the console output land in one file, in order (both append); ``<run_dir>/<job_name>.log`` when
    Hydra's file logging is off. Returns None when it cannot be opened (the console still works)."""
    import logging

    path = os.path.join(run_dir, f"{job_name}.log")
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and os.path.dirname(h.baseFilename) == os.path.abspath(run_dir):
            path = h.baseFilename
            break
    try:
        os.makedirs(run_dir, exist_ok=True)
        return open(path, "a", buffering=1, encoding="utf-8", errors="backslashreplace")
    except OSError:
        return None


def _override_key(o: str) -> "str | None":
    """The key an override ``[+|++]key=value`` sets, or None (``~key``, a bare word)."""
    m = re.match(r"^\+{0,2}([^=~+][^=]*)=", o)
    return m.group(1) if m else None


def last_of_each_key(overrides: list) -> list:
    """``overrides`` with each key once: its last value (Hydra's, which takes the last), at its last place."""
    last = {k: i for i, k in enumerate(map(_override_key, overrides)) if k is not None}
    return [o for i, o in enumerate(overrides) if _override_key(o) is None or last[_override_key(o)] == i]


def repeated_keys_note(overrides: list) -> "str | None":
    """``note: train.steps given twice (0, then 2): using 2`` for each key given more than once (a copy-paste
    slip when appending to a long command: Hydra takes the last value in silence), or None."""
    seen: dict = {}
    for o in overrides:
        k = _override_key(o)
        if k is not None:
            seen.setdefault(k, []).append(o.split("=", 1)[1])
    said = [f"{k} given {len(v)} times ({', then '.join(v)}): using {v[-1]}".replace(" 2 times", " twice")
            for k, v in seen.items() if len(v) > 1]
    return f"note: {'; '.join(said)}" if said else None


def resume_words(overrides: list, checkpoint_dir: str) -> list:
    """The shell command that continues an interrupted job, as its words (each quoted for the shell): this
    launcher with the job's overrides, ``train.resume=latest`` and ``checkpoint.dir=<checkpoint_dir>``
    (replacing any given before); ``train.offload_update=delayed`` becomes ``sync`` (a delayed-update run does
    not resume exactly). It starts with this run's ``NPT_`` variables that change a run (``env NPT_CACHE=...``,
    :func:`npu_train.env.resume_env_prefix`), so the resumed run uses the same cache and plan."""
    import shlex

    from npu_train.env import run_environment

    keep = [o for o in last_of_each_key(overrides) if not re.match(r"^\+{0,2}(train\.resume|checkpoint\.dir)=", o)]
    # a delayed-update run cannot resume exactly (refused by the job): it continues with the synchronous update
    keep = ["train.offload_update=sync" if re.match(r"^\+{0,2}train\.offload_update=delayed$", o) else o for o in keep]
    from npu_train.config import hydra_value

    # Hydra's quoting first (a path with a space or an apostrophe), then the shell's
    argv = [sys.executable, os.path.abspath(__file__), *keep, "train.resume=latest",
            f"checkpoint.dir={hydra_value(checkpoint_dir)}"]
    env = run_environment()
    return ((["env"] + [f"{k}={shlex.quote(v)}" for k, v in env.items()]) if env else []) + [shlex.quote(a) for a in argv]


def resume_command(overrides: list, checkpoint_dir: str) -> str:
    """:func:`resume_words` as one line (``status.json``'s ``resume``)."""
    return " ".join(resume_words(overrides, checkpoint_dir))


def _resume_dir_overrides(run_dir: str, multirun: bool, hc) -> list:
    """The ``hydra.run.dir=`` a resume command keeps: the user's, or a sweep job's own directory (resumed as a
    single run, it writes beside its earlier records); ``[]`` for a run in its default directory."""
    from npu_train.config import hydra_value

    return ([f"hydra.run.dir={hydra_value(os.path.abspath(run_dir))}"] if multirun else
            [o for o in hc.overrides.hydra if o.startswith("hydra.run.dir=")])


def _latest_checkpoint(cfg, run_dir: str) -> tuple:
    """``(checkpoint, root, note)`` of an interrupt before this launch saved, as after a failed card
    (:func:`~npu_train.runtime.saving.last_checkpoint_note`): the newest complete checkpoint under the run's
    checkpoint root, its root and the note naming it and the resume command; without one ``(None, None,
    note)`` saying a rerun starts again (``""`` for ``plan=true`` / ``calibrate=true``, which train nothing),
    and ``(None, None, "")`` when the root cannot be read."""
    try:
        from npu_train.runtime.job import checkpoint_root
        from npu_train.runtime.saving import NO_CHECKPOINT_YET, last_checkpoint_note

        root = checkpoint_root(cfg, run_dir)
        ck, note = (last_checkpoint_note(root, str(cfg.train.offload_update), run_dir) if os.path.isdir(root)
                    else (None, NO_CHECKPOINT_YET))
        if ck is None and (cfg.plan or cfg.calibrate):
            note = ""
        return ck, root if ck else None, note
    except Exception:  # an interrupt must end with its message, whatever the checkpoint root holds
        return None, None, ""


def write_status(run_dir: str, code: int, error: str, overrides: list, started: float,
                 report: "dict | None" = None, run_dir_overrides: list = ()) -> None:
    """``<run_dir>/status.json``: exit code, status, the error line, the job's overrides and its
    start/end (Unix time, seconds); read by the sweep summary (npu_train.metrics.sweep).

    ``status``: ``ok`` (exit 0), ``interrupted`` (130/143: SIGINT/SIGTERM; then ``checkpoint``, the
    checkpoint this launch saved, else the run's latest complete one when this launch saved none and said
    nothing of it (stopped while it prepared), or null, and ``resume``, the command that continues it or null) or
    ``failed`` (any other exit status; exit 1, a failed card process: with ``checkpoint``, the run's
    latest complete checkpoint or null, and ``resume``). A launch that ``train.stop_after`` ended before
    ``train.steps`` is ``ok`` with ``stopped_at`` (its last step), ``steps`` and ``resume``;
    ``train.resume=auto`` on a run already at ``train.steps`` is ``ok`` with ``already_complete`` (true),
    ``step``, ``steps`` and ``checkpoint`` (nothing was run). ``report``: what
    :func:`main` reported of how the job ended; the resume command keeps ``run_dir_overrides`` (the
    run's ``hydra.run.dir=...``), so the continued run writes into the same directory."""
    import json
    import signal
    import time

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "status.json")
    rec = {"exit_code": int(code), "status": "ok" if code == 0 else "failed", "error": error}
    rep = report or {}
    root = rep.get("checkpoint_dir")
    resume = resume_command([*run_dir_overrides, *overrides], root) if root else None
    if code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        ck = rep.get("checkpoint")
        rec.update(status="interrupted", checkpoint=ck, resume=resume if ck else None)
    elif code == 1 and "checkpoint" in rep:  # a card process failed: where the run can go on from
        ck = rep.get("checkpoint")
        rec.update(checkpoint=ck, resume=resume if ck else None)
    elif code == 0 and rep.get("stopped_at") is not None:  # train.stop_after: ok, not complete
        rec.update(stopped_at=rep["stopped_at"], steps=rep.get("steps"), resume=resume)
    elif code == 0 and rep.get("complete_at") is not None:  # train.resume=auto on a finished run: nothing run
        rec.update(already_complete=True, step=rep["complete_at"], steps=rep.get("steps"),
                   checkpoint=rep.get("checkpoint"))
    rec.update(overrides=list(overrides), started=started, finished=time.time(), pid=os.getpid())
    try:
        with open(path + ".part", "w") as f:
            json.dump(rec, f, indent=1)
        os.replace(path + ".part", path)
    except OSError:
        if os.path.exists(path + ".part"):  # no partial file stays
            os.remove(path + ".part")
        raise


#: the statuses of a launch that a later one can continue (``ok`` with ``stopped_at``: ``train.stop_after``)
CONTINUABLE = ("interrupted", "failed", "resumed")


def mark_resumed(earlier_dir: str, run_dir: str, checkpoint, step) -> "str | None":
    """After a resumed launch in ``run_dir`` ended past its refusals (done, interrupted or a card failed: the
    launch it continued is now continued there, as a resume into the same directory rewrites its records;
    issue 40: the interrupted first launch kept saying ``interrupted`` at its step): the ``status.json`` of the launch it continued, in
    ``earlier_dir``, gets ``status`` ``resumed`` with ``resumed_in`` (``run_dir``), ``resumed_from`` (the
    checkpoint), ``resumed_at_step`` and ``resumed_finished`` (Unix time, s); its first status stays in
    ``status_before`` and every other field as it was. Only a status this launcher wrote (``exit_code`` and a
    :data:`CONTINUABLE` status, or ``ok`` with ``stopped_at``) in another directory is changed, atomically;
    returns its path, or None when nothing was changed (no such file, the same directory, unreadable)."""
    import json
    import time

    if os.path.realpath(earlier_dir) == os.path.realpath(run_dir):
        return None  # resumed in place: the earlier launch's records were moved to previous-<k>/
    path = os.path.join(earlier_dir, "status.json")
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or "exit_code" not in rec:
        return None
    was = rec.get("status")
    if was not in CONTINUABLE and not (was == "ok" and rec.get("stopped_at") is not None):
        return None
    rec.setdefault("status_before", was)
    rec.update(status="resumed", resumed_in=os.path.abspath(run_dir), resumed_from=checkpoint,
               resumed_at_step=step, resumed_finished=time.time())
    try:
        with open(path + ".part", "w") as f:
            json.dump(rec, f, indent=1)
        os.replace(path + ".part", path)
    except OSError:
        if os.path.exists(path + ".part"):
            os.remove(path + ".part")
        return None
    return path


def _sweep_threads(cfg, n_jobs: int) -> None:
    """Concurrent sweep jobs share the host: ``runtime.threads=null`` becomes cores // (jobs x cpu cards)
    (:func:`npu_train.metrics.sweep.job_threads`); ``n_jobs``: the jobs at a time the sweep worked
    out (the callback pins it into every job's ``hydra.launcher.n_jobs``)."""
    from omegaconf import open_dict

    from npu_train.metrics.sweep import host_cores, job_threads

    if cfg.runtime.threads is not None:
        return
    threads = job_threads(cfg.backend, n_jobs, host_cores())
    if threads is not None:
        with open_dict(cfg):
            cfg.runtime.threads = threads


def _plain_start_method() -> None:
    """In a joblib (loky) worker the default start method is 'loky', which the launcher's spawned
    card processes cannot restore (``cannot find context for 'loky'``): use the platform's default."""
    import multiprocessing as mp

    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        mp.set_start_method(mp.get_all_start_methods()[0], force=True)


#: directories that existed before Hydra made the run directory (:func:`note_dirs_before`, from ``_main``): a
#: refused or plan-only launch removes only directories it created; None until noted (then nothing is removed)
_DIRS_BEFORE: "set | None" = None


def note_dirs_before(argv: list) -> None:
    """Note which directories exist before Hydra creates the run directory: along ``hydra.run.dir`` when given,
    else along the default ``outputs/<date>/<time>`` (``outputs/`` and its entries)."""
    global _DIRS_BEFORE
    given = [a.split("=", 1)[1].strip("'\"") for a in argv if re.match(r"^\+{0,2}hydra\.run\.dir=", a)]
    found = set()
    for start in [*given[-1:], os.path.join("outputs", "date", "time")]:
        d = os.path.abspath(os.path.expanduser(start))
        while True:
            if os.path.isdir(d):
                found.add(d)
            if os.path.dirname(d) == d:
                break
            d = os.path.dirname(d)
    if os.path.isdir("outputs"):
        found.update(os.path.abspath(os.path.join("outputs", n)) for n in os.listdir("outputs"))
    _DIRS_BEFORE = found


def made_by_this_launch(run_dir: str) -> bool:
    """True when ``run_dir`` did not exist before this launch (:data:`_DIRS_BEFORE`) and holds nothing but
    Hydra's empty ``run.log``: a launch that is refused may remove it again."""
    d = os.path.abspath(run_dir)
    if _DIRS_BEFORE is None or d in _DIRS_BEFORE:
        return False
    try:
        names = set(os.listdir(d))
        return names <= {"run.log"} and all(os.path.getsize(os.path.join(d, n)) == 0 for n in names)
    except OSError:
        return False


def remove_launch_dir(run_dir: str) -> None:
    """Remove the run directory this launch created (refused, or ``plan=true`` in the default directory: nothing
    a user would keep), with the parents it created that are empty now (``outputs/<date>/``); Hydra's file
    logger into it is closed first. Never raises."""
    import logging
    import shutil

    d = os.path.abspath(run_dir)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and os.path.dirname(h.baseFilename) == d:
            root.removeHandler(h)
            h.close()
    shutil.rmtree(d, ignore_errors=True)
    d = os.path.dirname(d)
    while _DIRS_BEFORE is not None and d not in _DIRS_BEFORE and os.path.dirname(d) != d:
        try:
            os.rmdir(d)  # only an empty one
        except OSError:
            break
        d = os.path.dirname(d)


def write_hydra_files(cfg, run_dir: str) -> None:
    """Hydra's record of the launch, ``<run dir>/.hydra/{config,hydra,overrides}.yaml``, written by the launcher
    (``hydra.output_subdir: null`` in conf/config.yaml) once the launch is not refused, so a refused launch into
    an earlier run's directory leaves that run's ``.hydra/`` as it was. A write that fails (a full disk) is
    skipped: the run's own records say more."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import _save_config

    out = Path(run_dir) / ".hydra"
    try:
        _save_config(cfg, "config.yaml", out)
        _save_config(HydraConfig.instance().cfg, "hydra.yaml", out)
        _save_config(HydraConfig.get().overrides.task, "overrides.yaml", out)
    except OSError:
        pass


def _hydra_files_when_accepted(cfg, run_dir: str, multirun: bool) -> None:
    """A sweep job writes ``.hydra/`` at once (the sweep summary finds its jobs by it); a single launch when it
    is past its refusals (:data:`~npu_train.metrics.report.LAUNCH_ACCEPTED`), else at its end unless refused."""
    if multirun:
        write_hydra_files(cfg, run_dir)
        return
    from npu_train.metrics.report import LAUNCH_ACCEPTED

    LAUNCH_ACCEPTED.append(lambda: write_hydra_files(cfg, run_dir))


def run_one(cfg) -> int:
    """Hydra task: run one job, write its ``status.json`` (not for rejected input), return its exit status.

    Single run: the status becomes the process's. Multirun: it is returned, never raised, because Hydra 1.3's
    ``run_job`` lets ``sys.exit`` escape and its ``BasicSweeper`` re-raises a job's exception, which would
    skip the remaining jobs and the sweep summary."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    import time

    t0 = time.time()
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    # the job's console output (plan table, step lines, evals, errors) also goes into its log file
    real_out, real_err = sys.stdout, sys.stderr
    made = not multirun and made_by_this_launch(run_dir)  # removed again if refused (or plan=true, default dir)
    explicit = any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra)
    _hydra_files_when_accepted(cfg, run_dir, multirun)
    log = hold_if_reused(open_job_log(run_dir, hc.job.name))
    tag = ""
    if multirun:  # jobs at a time share the console: each of this job's lines says whose it is
        from npu_train.errors import reserve_console_columns
        from npu_train.metrics.sweep import job_tag

        tag = job_tag(str(hc.sweep.dir), int(hc.job.num), int(hc.launcher.get("n_jobs", 1) or 1))
        reserve_console_columns(len(tag))  # the job folds its text so that the tag and a line fit the console
    out_tee = _LogTee(real_out, log, fold=True, tag=tag)
    sys.stdout = out_tee
    tee = _ErrorLineTee(_LogTee(real_err, log, tag=tag))
    sys.stderr = tee
    report: dict = {}
    code = None
    continued: list = []
    # a signal outside run_job's own handlers must not kill the launcher before status.json is written: one
    # before run_job installed them is held for it (it stops at once), a later one only noted
    held = _hold_signals()
    try:
        if multirun:
            from npu_train.metrics.sweep import job_header

            print(job_header(str(hc.sweep.dir), int(hc.job.num), overrides), flush=True)
            _sweep_threads(cfg, int(hc.launcher.get("n_jobs", 1) or 1))
            _plain_start_method()
            from npu_train.config import lora_for_a_mode_sweep
            from npu_train.metrics.sweep import modes_of_this_sweep

            # a full job of a sweep over train.mode: lora.* are its LoRA jobs'
            ignored = lora_for_a_mode_sweep(cfg, modes_of_this_sweep(str(hc.sweep.dir)))
            if ignored:
                print(ignored, flush=True)
        twice = repeated_keys_note(overrides)
        if twice:
            print(twice, flush=True)
        code = main(cfg, run_dir, report, resume_with=lambda root: resume_words([*_resume_dir_overrides(
            run_dir, multirun, hc), *overrides], root))
    except BaseException as e:  # noqa: BLE001 - multirun: any job error is this job's status
        if not multirun:
            if log is not None:  # Hydra prints the traceback on the console after this returns
                import traceback

                log.write(traceback.format_exc())
            raise
        code = 130 if isinstance(e, KeyboardInterrupt) else (e.code if isinstance(e, SystemExit) and
                                                            isinstance(e.code, int) and e.code else 1)
        tee.last = tee.last or f"error: {type(e).__name__}: {e}".splitlines()[0]
        print(tee.last, file=tee.inner, flush=True)
    finally:
        _SIGNALS_HELD_FOR_JOB[0] = False
        out_tee.flush()  # a last line without its newline
        sys.stdout, sys.stderr = real_out, real_err
        if tag:  # a loky worker runs the sweep's next job too: it reserves its own
            from npu_train.errors import reserve_console_columns

            reserve_console_columns(0)
        from npu_train.metrics.report import CONTINUED, LAUNCH_ACCEPTED

        LAUNCH_ACCEPTED.clear()  # (a sweep's next job in this process registers its own)
        continued, CONTINUED[:] = CONTINUED[:], []  # the launch this one resumed, once it was accepted
        if isinstance(log, _HeldLog) and code == 2:  # refused: the earlier launch's run.log stays as it was
            log.drop()
        if log is not None:
            try:
                log.close()
            except OSError:  # its last flush on a full disk: the console had every line
                pass
    if made and (code == 2 or (cfg.plan and not explicit)):  # nothing under outputs/: the dir goes again
        remove_launch_dir(run_dir)
    elif multirun or code != 2:
        write_hydra_files(cfg, run_dir)
        # the resume command continues in this run's directory: the user's hydra.run.dir, or a sweep
        # job's own directory (resumed as a single run, it writes beside its earlier records)
        here = _resume_dir_overrides(run_dir, multirun, hc)
        from npu_train.metrics.report import rotate_before_status

        # plan=true, or a launch stopped before it trained: the earlier launch's records go to previous-<k>
        # first; except train.resume=auto on a finished run (``complete_at``), which moves nothing and keeps
        # the status.json of the launch that finished the run (it writes one only into a directory without)
        complete = report.get("complete_at") is not None
        moved = None if complete else rotate_before_status(run_dir, t0)
        if moved:  # folded at words within 100 columns, as a training launch's console lines are
            from npu_train.errors import refusal_text

            print(refusal_text(f"{run_dir} held the records of an earlier launch; moved them to {moved}",
                               prefix="note: "), flush=True)
        if not (complete and os.path.exists(os.path.join(run_dir, "status.json"))):
            try:
                write_status(run_dir, code, tee.last, overrides, t0, report, run_dir_overrides=here)
            except OSError as e:  # a full run dir: say where the run stands instead (once: main may have said it)
                if "no space left on device" not in tee.last:
                    _status_lost(run_dir, code, e, report, [*here, *overrides])
        if continued and code != 2:  # done, interrupted or failed: it continued that launch, which says where
            marked = mark_resumed(continued[0].run_dir, run_dir, continued[0].checkpoint, continued[0].step)
            if marked:
                from npu_train.metrics.report import fold_long_line

                print(fold_long_line(f"note: {marked} now says status resumed, continued in "
                                     f"{os.path.abspath(run_dir)}"), flush=True)
    if multirun:  # the sweep goes on (its next job, its summary): Ctrl-C stops it again
        _release_signals(held)
    return code  # a single run exits now: a late signal cannot turn its exit status into a kill


def _status_lost(run_dir: str, code: int, e: OSError, report: dict, overrides: list) -> None:
    """``status.json`` could not be written (a full disk): one line naming the directory, the run's last
    checkpoint and the resume command (what ``status.json`` would have held)."""
    ck, root = report.get("checkpoint"), report.get("checkpoint_dir")
    how = (f"; the run's last complete checkpoint is {ck}; resume with: {resume_command(overrides, root)}"
           if ck and root else "")
    print(f"{'error' if code else 'warning'}: cannot write {os.path.join(run_dir, 'status.json')} ({e.strerror or e}): "
          f"free disk space there (hydra.run.dir){how}", file=sys.stderr, flush=True)


#: ``[True]`` until :func:`main` has the job's outcome: a signal meanwhile is held for ``run_job``
_SIGNALS_HELD_FOR_JOB = [True]


def _hold_signals() -> dict:
    """SIGINT/SIGTERM outside ``run_job``'s own handlers (main thread only): never fatal here, so
    ``status.json`` is always written. Before the job's outcome is decided (``run_job``'s module and torch
    import for seconds) a signal is held in :data:`~npu_train.errors.PENDING_SIGNALS`, and ``run_job`` stops
    with it as soon as it starts (``interrupted by ... while preparing``); afterwards it is only noted.
    Returns the previous handlers."""
    import signal
    import threading

    from npu_train.errors import PENDING_SIGNALS

    if threading.current_thread() is not threading.main_thread():
        return {}
    _SIGNALS_HELD_FOR_JOB[0] = True
    PENDING_SIGNALS.clear()

    def handle(signum, frame):
        if _SIGNALS_HELD_FOR_JOB[0]:
            PENDING_SIGNALS.append(signum)
            return
        print(f"note: {signal.Signals(signum).name} received while the launcher was writing its records: ignored",
              file=sys.stderr, flush=True)

    return {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def _release_signals(held: dict) -> None:
    import signal

    for s, h in held.items():
        signal.signal(s, h)


def _needs(cfg):
    """Sweep concurrency check: what one job takes from the host, from the placement plan (or None). The
    planning's own lines (``train.schedule=auto: ...``) are not printed: each job prints them when it plans
    (they came once per job here, then again from each job)."""
    import contextlib
    import io

    from npu_train.metrics.sweep import JobNeeds
    from npu_train.runtime.job import prepare

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            prep = prepare(cfg, "", probe=False)
    except Exception:  # noqa: BLE001 - an invalid job fails (and is reported) by itself
        return None
    stages = prep.plan.stages
    host = sum(s.host_bytes + (s.mem["total"] if s.card.kind == "cpu" else 0) for s in stages)
    return JobNeeds(card_procs=len(stages), host_bytes=int(host),
                    accel_cards=[f"{c.kind}:{c.index}" for c in prep.cards if c.kind != "cpu"])


def _lock_sweep_dir(sweep_dir: str):
    """The sweep directory's lock (``runtime/dirlock.py``: ``<sweep dir>/.npt-sweep.lock``, an owner record), held
    by the sweep's main process until its summary is written. Raises DirInUseError naming a live sweep."""
    from npu_train.runtime.dirlock import lock_dir

    os.makedirs(sweep_dir, exist_ok=True)
    lock = lock_dir(sweep_dir, "sweep", "hydra.sweep.dir", "use another hydra.sweep.dir (the default is a new "
                    "directory per sweep)")
    lock.set_job("sweep")
    return lock


def _stop_before_the_run(signum, frame) -> None:
    """SIGINT/SIGTERM while Hydra composes the config (before :func:`run_one`): one line, exit ``128 + signum``,
    nothing written (no run directory of ours yet), instead of a KeyboardInterrupt traceback."""
    import signal

    print(f"interrupted by {signal.Signals(signum).name} before the run started: nothing was written",
          file=sys.__stderr__, flush=True)
    raise SystemExit(128 + signum)


def _main() -> None:
    import signal

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # replaced by run_one's (_hold_signals) once the job starts
        signal.signal(s, _stop_before_the_run)
    spaced = spaced_list_error(sys.argv[1:])
    if spaced:  # before Hydra's "no viable alternative at input '[cpu,]'"
        print_error(spaced)
        raise SystemExit(2)
    sys.argv = [sys.argv[0]] + rewrite_backend_args(sys.argv[1:])
    note_dirs_before(sys.argv[1:])  # a refused launch removes only the directories it created
    # a launcher that seems stuck: `kill -USR1 <pid>` prints every thread's Python stack to stderr
    # (card processes do the same, runtime/worker.py) and the job goes on
    from npu_train.stackdump import install_stack_dump

    install_stack_dump("the launcher")

    import hydra

    from npu_train.config import register
    from npu_train.metrics import sweep

    register()
    sweep.needs_hook = _needs
    sweep.lock_hook = _lock_sweep_dir
    # Bad overrides (train.accum=abc, unknown keys) fail while Hydra composes the config, before
    # our code runs; Hydra prints a multi-line message and exits 1. Capture stderr until the job
    # starts, so such errors follow the launcher's bad-input convention: one "error:" line, exit 2.
    cap = _StderrCapture()

    @hydra.main(version_base=None, config_path="../conf", config_name="config")
    def app(cfg) -> int:
        cap.release()
        code = run_one(cfg)
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if code and HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(code)
        return code

    real_stderr, captured = cap.real, cap.buf
    sys.stderr = captured
    try:
        app()
    except SystemExit as e:
        sys.stderr, text = real_stderr, captured.getvalue()
        bad_dir = None if cap.started or e.code != 1 else _output_dir_error(text)
        if bad_dir:
            print_error(f"cannot create or write the run directory: {bad_dir} -- set hydra.run.dir (hydra.sweep.dir "
                        "with -m) to a directory you can write", real_stderr)
            sys.exit(2)
        if cap.started or e.code != 1 or "Traceback (most recent call last)" in text:
            if not cap.started:
                real_stderr.write(text)
            raise
        line = _unknown_key_line(text) or _override_value_line(text) or (f"{_one_line_hydra_error(text)} -- fix the key=value override (each "
                                           "key's type and meaning: src/npu_train/config.py; list them with --cfg job)")
        print_error(line, real_stderr)
        sys.exit(2)
    finally:
        if sys.stderr is captured:
            sys.stderr = real_stderr
            if not cap.started:
                real_stderr.write(captured.getvalue())
    if sweep.last_rows is not None:  # a multirun: 0 when every job finished (rule: sweep.exit_status)
        sys.exit(sweep.exit_status(sweep.last_rows))


if __name__ == "__main__":
    _main()
