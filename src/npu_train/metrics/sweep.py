"""Hydra multirun sweeps: :class:`SweepCallback` (``conf/config.yaml``) checks before the jobs start how
many fit at once (:func:`check_concurrency` over :class:`JobNeeds`) and pins it into every job; after the
sweep it writes ``summary.md``, ``summary.csv`` and ``loss_curves.png``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from npu_train.errors import UserError

GIB = 2 ** 30
STATUS_FILE = "status.json"


class SweepError(UserError):
    """The sweep's concurrent jobs do not fit the host (cores, RAM) or would share a card."""


@dataclass
class JobNeeds:
    """One job's host needs: ``card_procs`` (a core each), ``accel_cards`` (cpu excluded), ``host_bytes`` (0:
    unknown)."""

    card_procs: int
    accel_cards: list[str] = field(default_factory=list)
    host_bytes: int = 0


#: ``cfg -> JobNeeds | None`` (None: the job is invalid and will fail by itself); installed by the
#: entry point (``launch/run.py``) so this module does not depend on the runtime layer.
needs_hook: Optional[Callable[[Any], Optional[JobNeeds]]] = None

#: ``sweep_dir -> lock`` (an object with ``release()``): takes the sweep directory for this sweep, raising a
#: UserError naming the live sweep that holds it; installed by the entry point (``runtime/dirlock.py``'s lock)
lock_hook: Optional[Callable[[str], Any]] = None

#: rows of the last summarised sweep (set in the process that ran ``on_multirun_end``)
last_rows: Optional[list[dict]] = None


def host_cores() -> int:
    """CPU cores this process may run on (``sched_getaffinity``, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def host_available_ram() -> int:
    """Available host RAM in bytes (``psutil.virtual_memory().available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_concurrency(needs: list[Optional[JobNeeds]], n_jobs: int, cores: int, ram_bytes: int) -> int:
    """Jobs to run at once (>= 1): ``n_jobs`` if it fits, else (``n_jobs`` < 1) the most that fit ``cores`` and
    ``ram_bytes``. Raises :class:`SweepError` when an explicit ``n_jobs`` > 1 oversubscribes or shares a card."""
    valid = [n for n in needs if n is not None]
    total = max(1, len(needs))
    if not valid:
        return 1 if n_jobs < 1 else min(n_jobs, total)
    per_cores = max(n.card_procs for n in valid)
    per_ram = max(n.host_bytes for n in valid)
    limits = {"cores": max(1, cores // max(1, per_cores))}
    if per_ram > 0:
        limits["RAM"] = max(1, ram_bytes // per_ram)
    seen: dict[str, int] = {}
    shared = None
    for i, n in enumerate(needs):
        for c in (n.accel_cards if n else []):
            if c in seen and shared is None:
                shared = (c, seen[c], i)
            seen.setdefault(c, i)
    if shared:
        limits["cards"] = 1
    fit = min([total] + list(limits.values()))
    if n_jobs < 1:
        return fit
    want = min(n_jobs, total)
    if want <= fit:
        return want
    if shared and want > 1:
        c, a, b = shared
        raise SweepError(f"hydra.launcher.n_jobs={n_jobs}: jobs {a + 1} and {b + 1} of the sweep both use card {c}, and a "
                         "card cannot be shared by two concurrent jobs; use hydra.launcher.n_jobs=1, or give each job "
                         "its own cards (explicit indices, e.g. backend=furiosa:0 / backend=furiosa:1)")
    why = []
    if want > limits["cores"]:
        why.append(f"{want} jobs x {per_cores} card process(es) need {want * per_cores} cores, the host has {cores}")
    if "RAM" in limits and want > limits["RAM"]:
        why.append(f"{want} jobs x {per_ram / GIB:.2f} GiB host RAM exceed the {ram_bytes / GIB:.2f} GiB available")
    raise SweepError(f"hydra.launcher.n_jobs={n_jobs}: {'; '.join(why)}; use hydra.launcher.n_jobs={fit} "
                     "(or -1 = as many as fit)")


def _job_config(sweep_cfg):
    """A job's config as Hydra hands it to the task: ``load_sweep_config`` also holds Hydra's own ``hydra`` node,
    which the job's config validation refuses as an unknown key (so every job's needs read as invalid and a
    shared card went unnoticed)."""
    from omegaconf import open_dict

    with open_dict(sweep_cfg):
        sweep_cfg.pop("hydra", None)
    return sweep_cfg


def pin_concurrency(hydra_overrides: list[str], jobs_at_once: int) -> list[str]:
    """The overrides with ``hydra.launcher.n_jobs=<jobs_at_once>`` replacing the user's."""
    import re

    keep = [o for o in hydra_overrides if not re.match(r"^[+~]{0,2}hydra\.launcher\.n_jobs(=|$)", str(o))]
    return [*keep, f"hydra.launcher.n_jobs={int(jobs_at_once)}"]


def job_threads(backend: Any, jobs_at_once: int, cores: int) -> Optional[int]:
    """Threads per card process: ``max(1, cores // (jobs_at_once * cpu cards))``; None for one job at a time."""
    if jobs_at_once <= 1:
        return None
    cards = [backend] if isinstance(backend, str) else list(backend)
    n_cpu = max(1, sum(1 for b in cards if str(b).strip().lower() == "cpu"))
    return max(1, int(cores) // (jobs_at_once * n_cpu))


def sweep_job_overrides(task_overrides: list[str]) -> list[list[str]]:
    """Expand a multirun command line into the override list of every job (Hydra's basic sweep order)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


# ============================================================================ summary
def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_jsonl(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.endswith("}"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def _job_dirs(sweep_dir: str) -> list[str]:
    """Job directories under ``sweep_dir`` (any depth <= 3): those holding ``.hydra/overrides.yaml``."""
    out = []
    base = os.path.normpath(sweep_dir)
    for root, dirs, files in os.walk(base):
        if os.path.isfile(os.path.join(root, ".hydra", "overrides.yaml")) and root != base:
            out.append(root)
            dirs[:] = []
        elif root[len(base):].count(os.sep) >= 3:
            dirs[:] = []
        dirs[:] = [d for d in dirs if d not in (".hydra", "checkpoints", "tb")]
    return out


def _error_from_files(job_dir: str) -> str:
    for fn in sorted(os.listdir(job_dir)):
        if fn.startswith("card") and fn.endswith(".traceback.txt"):
            try:
                with open(os.path.join(job_dir, fn)) as f:
                    lines = [l.strip() for l in f if l.strip()]
                if lines:
                    return f"{fn}: {lines[-1]}"
            except OSError:
                pass
    return "no status.json: the job process died before it could report"


def collect(sweep_dir: str) -> list[dict]:
    """One row per job directory, by job number: ``num``, ``dir``, ``overrides``, ``status`` (ok | stopped |
    interrupted | failed), ``exit_code``, ``error`` (one line), ``train_loss``/``val_loss`` (nats/token or
    None), ``tokens_per_s`` (after step 1), ``peak_mem_gib`` (per card), ``losses`` ``[(step, loss)]``."""
    rows = []
    for d in _job_dirs(sweep_dir):
        overrides, num = _hydra_job(d)
        st = _read_json(os.path.join(d, STATUS_FILE))
        if st and isinstance(st.get("overrides"), list):  # what the job recorded itself (.hydra/ is rewritten by
            overrides = [str(o) for o in st["overrides"]]  # any later launch into its directory, refused or not)
        summ = _read_json(os.path.join(d, "summary.json")) or {}
        metrics = _read_jsonl(os.path.join(d, "metrics.jsonl"))
        evals = _read_jsonl(os.path.join(d, "eval.jsonl"))
        status, code, error = _outcome(d, st)
        tps = summ.get("mean_tokens_per_s")
        if tps is None and metrics:
            tps = sum(m["tokens_per_s"] for m in metrics) / len(metrics)
        peak = summ.get("peak_mem_bytes") or (metrics[-1].get("mem_peak_bytes") if metrics else None) or []
        rows.append({
            "num": int(num) if num is not None else len(rows), "dir": d, "overrides": overrides,
            "status": status, "exit_code": code, "error": error,
            "train_loss": summ.get("last_loss", metrics[-1]["loss"] if metrics else None),
            "val_loss": summ.get("last_val_loss", evals[-1]["val_loss"] if evals else None),
            "tokens_per_s": tps, "peak_mem_gib": [p / GIB for p in peak],
            "losses": [(m["step"], m["loss"]) for m in metrics],
        })
    rows.sort(key=lambda r: r["num"])
    return rows


def _hydra_job(job_dir: str) -> tuple[list[str], Optional[int]]:
    """A job directory's Hydra overrides and job number (None when Hydra did not record one)."""
    import yaml

    try:
        with open(os.path.join(job_dir, ".hydra", "overrides.yaml")) as f:
            overrides = [str(o) for o in (yaml.safe_load(f) or [])]
    except (OSError, ValueError):
        overrides = []
    hyd = {}
    try:
        with open(os.path.join(job_dir, ".hydra", "hydra.yaml")) as f:
            hyd = yaml.safe_load(f) or {}
    except (OSError, ValueError):
        pass
    return overrides, ((hyd.get("hydra") or {}).get("job") or {}).get("num")


def _outcome(job_dir: str, st: Optional[dict]) -> tuple[str, Optional[int], str]:
    """``(status, exit code, error line)`` of a job from its ``status.json`` ``st`` (None: none written)."""
    code = st.get("exit_code") if st else None
    ok = code == 0
    error = "" if ok else ((st or {}).get("error") or (f"exit status {code}" if st else _error_from_files(job_dir)))
    error = error[len("error: "):] if error.startswith("error: ") else error
    stopped = ok and (st or {}).get("stopped_at") is not None
    if stopped:
        error = (f"stopped at step {st['stopped_at']} of {st.get('steps', '?')} (train.stop_after); "
                 + ("resume: 'resume' in status.json" if st.get("resume") else "no checkpoint to resume from"))
    status = ("stopped" if stopped else "ok") if ok else ("interrupted" if code in (129, 130, 143) else "failed")
    return status, code, error


def swept_overrides(rows: list[dict]) -> list[list[str]]:
    """Per row, only the overrides that differ between jobs (all of them when there is one job)."""
    if len(rows) <= 1:
        return [r["overrides"] for r in rows]
    common = set(rows[0]["overrides"]).intersection(*[set(r["overrides"]) for r in rows[1:]])
    return [[o for o in r["overrides"] if o not in common] or r["overrides"] for r in rows]


def _sweep_jobs(sweep_dir: str) -> list[list[str]]:
    """Each job's overrides of the sweep in ``sweep_dir``, from its ``multirun.yaml`` (Hydra's sweeper writes it
    before any job starts); ``[]`` when the file is missing or unreadable."""
    from omegaconf import OmegaConf

    try:
        master = OmegaConf.load(os.path.join(sweep_dir, "multirun.yaml"))
        return sweep_job_overrides(OmegaConf.to_container(master.hydra.overrides.task, resolve=False))
    except Exception:  # noqa: BLE001 - an unreadable record
        return []


def job_header(sweep_dir: str, num: int, overrides: list[str]) -> str:
    """The line that begins job ``num`` (Hydra's 0-based ``hydra.job.num``) of the sweep in ``sweep_dir``:
    ``sweep job 2/2: train.lr=3e-4``, with only the overrides that differ between the sweep's jobs (all of the
    job's when it is alone), floats as written (:func:`~npu_train.metrics.report.fmt_override`). The jobs
    come from the sweep's ``multirun.yaml`` (:func:`_sweep_jobs`); without it the count is left out
    (``sweep job 2: ...``)."""
    jobs = _sweep_jobs(sweep_dir)  # [] unreadable: the job's own overrides, no count
    swept = {o.split("=", 1)[0] for j in swept_overrides([{"overrides": j} for j in jobs]) for o in j}
    shown = [o for o in overrides if o.split("=", 1)[0] in swept] if len(jobs) > 1 else list(overrides)
    count = f"/{len(jobs)}" if jobs else ""
    from npu_train.metrics.report import fmt_override  # train.lr=1e-4, as written (Hydra gives 0.0001)

    return f"sweep job {num + 1}{count}: {' '.join(fmt_override(o) for o in shown) or '(no overrides)'}"


def job_tag(sweep_dir: str, num: int, at_a_time: int) -> str:
    """``"[job 2/3] "``, the prefix of every console line of job ``num`` (0-based ``hydra.job.num``; shown 1-based
    as :func:`job_header`'s) when ``at_a_time`` > 1 jobs of a sweep of more than one job share the console: a
    fresh-clone review saw two ``step 4/4 | loss ...`` and two ``done:`` lines with nothing saying whose. ``""``
    when the jobs run one after another (each begins with its ``sweep job i/n:`` line) or the sweep's
    ``multirun.yaml`` cannot be read."""
    if at_a_time <= 1:
        return ""
    jobs = _sweep_jobs(sweep_dir)  # [] unreadable: no tag (job_header leaves its count out too)
    return f"[job {num + 1}/{len(jobs)}] " if len(jobs) > 1 else ""


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


HEADER = ["job", "overrides", "train loss", "val loss", "tokens/s", "peak mem GiB per card", "status", "error"]


def table_rows(rows: list[dict], plain: bool = False) -> list[list[str]]:
    """The summary table as strings, one list per job, columns :data:`HEADER` (``plain``: no thousands separators);
    jobs numbered from 1, as the ``sweep job i/n:`` lines count them (Hydra's ``num`` + 1; its job directories
    keep Hydra's names: :func:`job_dirs_note`)."""
    from npu_train.metrics.report import fmt_override  # train.lr=1e-4, as written (Hydra gives 0.0001)

    out = []
    for r, ov in zip(rows, swept_overrides(rows)):
        out.append([str(r["num"] + 1), " ".join(fmt_override(o) for o in ov), _fmt(r["train_loss"]), _fmt(r["val_loss"]),
                    _fmt(r["tokens_per_s"], ".0f" if plain else ",.0f"), "/".join(f"{m:.2f}" for m in r["peak_mem_gib"]) or "n/a",
                    r["status"], r["error"]])
    return out


def console_summary(md: str, rows: list[dict], width: int = 100) -> str:
    """The summary as the console prints it: the Markdown of :func:`write_summary` when every line fits ``width``
    columns, else its title, the table without the overrides and error columns and, under it, each job's
    overrides and error on lines of their own folded at words (``summary.md`` keeps the wide table: a file).
    A one-job sweep on a model under /tmp printed a 114-column row (issue 40)."""
    from npu_train.metrics.report import fold_long_line

    if max(len(ln) for ln in md.splitlines()) <= width:
        return md
    keep = [k for k, h in enumerate(HEADER) if h not in ("overrides", "error")]
    body = table_rows(rows)
    out = ["| " + " | ".join(HEADER[k] for k in keep) + " |", "|" + "---|" * len(keep)]
    out += ["| " + " | ".join(row[k] for k in keep) + " |" for row in body]
    for row in body:
        out.append(fold_long_line(f"job {row[0]}: {row[1]}", width))
        if row[7]:
            out.append(fold_long_line(f"job {row[0]} error: {row[7]}", width))
    return md.split("\n", 1)[0] + "\n\n" + "\n".join(out) + "\n"


def job_dirs_note(sweep_dir: str, rows: list[dict]) -> str:
    """Which directory holds which job: the table counts jobs from 1, Hydra names their directories from 0
    (``hydra.sweep.subdir=${hydra.job.num}``): ``job k's directory: <sweep_dir>/<k-1>``, else (another subdir)
    each job's directory. ``""`` without rows."""
    if not rows:
        return ""
    names = [os.path.relpath(r["dir"], sweep_dir) for r in rows]
    if all(n == str(r["num"]) for n, r in zip(names, rows)):
        return f"job k's directory: {os.path.join(sweep_dir, '<k-1>')} (Hydra numbers its job directories from 0)"
    return "job directories: " + ", ".join(f"job {r['num'] + 1} in {os.path.join(sweep_dir, n)}" for n, r in zip(names, rows))


def write_summary(sweep_dir: str, rows: list[dict]) -> str:
    """Write ``summary.md``, ``summary.csv`` and, when a job trained a step, ``loss_curves.png`` into
    ``sweep_dir``; return the Markdown."""
    body = table_rows(rows)
    esc = [[c.replace("|", "\\|") for c in row] for row in body]
    md = "| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER) + "\n"
    md += "".join("| " + " | ".join(row) + " |\n" for row in esc)
    n_ok, n_stop, n_int = (sum(r["status"] == s for r in rows) for s in ("ok", "stopped", "interrupted"))
    md = (f"# Sweep summary: {n_ok} ok, " + (f"{n_stop} stopped (train.stop_after), " if n_stop else "")
          + (f"{n_int} interrupted, " if n_int else "") + f"{len(rows) - n_ok - n_stop - n_int} failed\n\n" + md)
    with open(os.path.join(sweep_dir, "summary.md"), "w") as f:
        f.write(md)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(HEADER)
    w.writerows(table_rows(rows, plain=True))
    with open(os.path.join(sweep_dir, "summary.csv"), "w", newline="") as f:
        f.write(buf.getvalue())
    if any(r["losses"] for r in rows):  # a plan-only sweep (plan=true) trains nothing: no empty figure
        plot_losses(os.path.join(sweep_dir, "loss_curves.png"), rows)
    return md


def summary_files_line(sweep_dir: str, rows: list[dict]) -> str:
    """The console's line naming the summary's files: ``loss_curves.png`` only where a job trained a step
    (:func:`write_summary` draws it then; a plan-only sweep drew an empty figure and named it, issue 40)."""
    plot = ", loss_curves.png" if any(r["losses"] for r in rows) else ""
    return f"summary: {os.path.join(sweep_dir, 'summary.md')} (and summary.csv{plot})"


def plot_losses(path: str, rows: list[dict]) -> None:
    """One figure with every job's per-step train loss (nats/token), labelled by its swept overrides (the caller
    draws it only when a job recorded a step)."""
    import matplotlib

    from npu_train.metrics.report import fmt_override

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r, ov in zip(rows, swept_overrides(rows)):
        if r["losses"]:
            ax.plot([a for a, _ in r["losses"]], [b for _, b in r["losses"]], marker="o" if len(r["losses"]) <= 50 else None,
                    label=f"#{r['num'] + 1} {' '.join(fmt_override(o) for o in ov)}"[:60] + ("" if r["status"] == "ok" else f" ({r['status']})"))
    ax.set_xlabel("optimizer step")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    ax.set_ylabel("train loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def exit_status(rows: list[dict]) -> int:
    """0 when every job finished or stopped as asked; else 130/143 for an interrupt; else 1 (also for no jobs)."""
    if rows and all(r["status"] in ("ok", "stopped") for r in rows):
        return 0
    for sig in (130, 143, 129):
        if any(r["exit_code"] == sig for r in rows):
            return sig
    return 1


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object


def swept_modes(config, jobs: list[list[str]]) -> str:
    """The ``train.mode`` values of a sweep's jobs (``jobs``: :func:`sweep_job_overrides` of ``config``'s
    ``hydra.overrides.task``), comma-separated, when they differ (``full,lora``), else "": a ``full`` job of
    such a sweep ignores the ``lora.*`` settings meant for its LoRA jobs
    (:func:`~npu_train.config.lora_for_a_mode_sweep`) instead of being refused."""
    modes: list[str] = []
    for ov in jobs:
        set_here = [str(o).split("=", 1)[1] for o in ov if re.match(r"^[+]{0,2}train\.mode=", str(o))]
        mode = set_here[-1] if set_here else str(config.train.mode)
        if mode not in modes:
            modes.append(mode)
    return ",".join(modes) if len(modes) > 1 else ""


def modes_of_this_sweep(sweep_dir: str) -> str:
    """:func:`swept_modes` as a job of the sweep sees them: from ``<sweep_dir>/multirun.yaml``, the sweep's own
    config that Hydra's sweeper writes before it launches any job (the job's own config holds only its
    overrides, not the sweep's). "" when the file is missing or unreadable (then nothing is ignored and the
    job's ``lora.*`` check refuses as a single launch does)."""
    from omegaconf import OmegaConf

    try:
        master = OmegaConf.load(os.path.join(sweep_dir, "multirun.yaml"))
        task = OmegaConf.to_container(master.hydra.overrides.task, resolve=False)
        return swept_modes(master, sweep_job_overrides(task))
    except Exception:  # noqa: BLE001 - an unreadable record: no sweep over modes is assumed
        return ""


class SweepCallback(_HydraCallback):
    """Hydra callback (``hydra.callbacks.sweep`` in conf/config.yaml): concurrency check, then summary."""

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        self._lock_sweep_dir(str(config.hydra.sweep.dir))
        try:
            self._start(config)
        except BaseException:  # refused (SystemExit 2): no lock file stays
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            raise

    def _start(self, config) -> None:
        import sys

        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf

        from npu_train.config import lora_for_a_mode_sweep

        launcher = config.hydra.launcher
        jobs = sweep_job_overrides(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
        modes = swept_modes(config, jobs)
        if "n_jobs" not in launcher:  # a sequential launcher (hydra/launcher=basic)
            print(f"sweep: {len(jobs)} job(s), 1 at a time", flush=True)
            return
        n_jobs = int(launcher.n_jobs)
        if n_jobs == 1 or len(jobs) <= 1:
            if n_jobs != 1:  # one job: it runs alone, whatever n_jobs said
                self._pin(config, 1)
            print(f"sweep: {len(jobs)} job(s), 1 at a time", flush=True)
            return
        # planning every job takes seconds (the first imports torch): say so before the concurrency line
        print(f"sweep: {len(jobs)} job(s): planning each to see how many can run at a time ...", flush=True)
        loader = GlobalHydra.instance().config_loader()
        needs = []
        for ov in jobs:
            try:
                job_cfg = _job_config(loader.load_sweep_config(config, ov))
                lora_for_a_mode_sweep(job_cfg, modes)
                needs.append(needs_hook(job_cfg) if needs_hook else None)
            except Exception:  # noqa: BLE001 - an invalid job fails (and is reported) by itself
                needs.append(None)
        try:
            fit = check_concurrency(needs, n_jobs, host_cores(), host_available_ram())
        except SweepError as e:
            from npu_train.errors import refusal_text

            print(refusal_text(str(e)), file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        self._pin(config, fit)
        print(f"sweep: {len(jobs)} job(s), {fit} at a time", flush=True)

    def _lock_sweep_dir(self, sweep_dir: str) -> None:
        """One sweep per ``hydra.sweep.dir``: a second one into the directory of a live sweep is refused before it
        writes anything (its jobs' refused launches rewrote the first's ``.hydra/overrides.yaml``, and its summary
        counted the first's jobs). Exit 2 with one line naming the live sweep."""
        import sys

        self.lock = None
        if lock_hook is None:
            return
        try:
            self.lock = lock_hook(sweep_dir)
        except UserError as e:
            from npu_train.errors import refusal_text

            print(refusal_text(str(e)), file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    @staticmethod
    def _pin(config, fit: int) -> None:
        """The launcher runs ``fit`` jobs at a time, and every job's config says so (``n_jobs``)."""
        from omegaconf import flag_override

        with flag_override(config, ["readonly", "struct"], [False, False]):
            config.hydra.launcher.n_jobs = fit
            config.hydra.overrides.hydra = pin_concurrency(list(config.hydra.overrides.hydra), fit)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        try:
            self._summarise(config)
        finally:
            if getattr(self, "lock", None) is not None:
                self.lock.release()
                self.lock = None

    def _summarise(self, config) -> None:
        global last_rows
        sweep_dir = str(config.hydra.sweep.dir)
        rows = collect(sweep_dir) if os.path.isdir(sweep_dir) else []
        last_rows = rows
        if os.path.isdir(sweep_dir):
            from npu_train.errors import console_columns
            from npu_train.metrics.report import fold_long_line

            md, width = write_summary(sweep_dir, rows), console_columns()
            print("\n" + console_summary(md, rows, width) + "\n"
                  + fold_long_line(summary_files_line(sweep_dir, rows), width), flush=True)
            if rows:
                print(fold_long_line(job_dirs_note(sweep_dir, rows), width), flush=True)
