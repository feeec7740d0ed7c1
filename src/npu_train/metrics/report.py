"""Progress lines, JSONL metrics, tracker scalars (TensorBoard, W&B, MLflow) and the end-of-run summary with a
loss plot.

Start at :class:`Reporter` (fed by the coordinator; one record per step from :func:`merged_record`); the
trackers are :mod:`npu_train.metrics.trackers`.
Times in seconds, memory in GiB (2**30 bytes); the fields of the progress line and ``metrics.jsonl``
(``idle_share``, ``bubble_s``, ``*_cards``...) and the strict-JSON rule are in docs/design.md §17.
"""
from __future__ import annotations

import contextlib

import json
import math
import os
import re
import sys
import time
from typing import Optional

from npu_train.errors import console_columns, fmt_number
from npu_train.hardware import host_busy, host_load

GIB = 2 ** 30


def json_safe(obj):
    """``obj`` with every nan/inf float replaced by None, recursively (strict JSON writes ``null``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON (``allow_nan=False``) of :func:`json_safe` ``(obj)``."""
    return json.dumps(json_safe(obj), allow_nan=False, **kw)


#: what a launch writes into its run directory, moved aside together by :func:`rotate_previous_run` (with
#: ``card<k>.traceback.txt`` and the ``.part`` file of an atomic write a kill left), so ``previous-<k>/`` is
#: one whole earlier launch. In place stay: ``.hydra/`` (Hydra rewrites it before the job runs), ``run.log``
#: (every launch appends to it, by design), the run-dir lock ``.npt-run*.lock`` (this launch holds it),
#: ``checkpoints/`` (what a resume reads; ``checkpoint.existing`` decides) and the ``previous-<k>/`` dirs.
RUN_OUTPUTS = ("metrics.jsonl", "eval.jsonl", "summary.json", "loss.png", "tb", "wandb", "trace.json",
               "plan.json", "plan.txt", "job.json", "status.json")


def _is_run_output(fn: str) -> bool:
    """``fn`` (a name in a run directory) is one of a launch's outputs (:data:`RUN_OUTPUTS`)."""
    fn = fn[:-len(".part")] if fn.endswith(".part") else fn
    return fn in RUN_OUTPUTS or (fn.startswith("card") and fn.endswith(".traceback.txt"))


#: what runs once this launch is past its refusals and begins writing its records into the run directory
#: (:func:`launch_accepted`): the launcher's run.log lines held back while the run dir holds an earlier launch's
#: ``run.log`` (launch/run.py ``_HeldLog``), so a refused launch adds nothing to another run's log
LAUNCH_ACCEPTED: list = []


class ContinuedLaunch:
    """The earlier launch a resumed launch continues: its run directory (``run_dir``), the checkpoint
    (``checkpoint``, a path) and its step (``step``)."""

    __slots__ = ("run_dir", "checkpoint", "step")

    def __init__(self, run_dir: str, checkpoint: str, step: int) -> None:
        self.run_dir, self.checkpoint, self.step = run_dir, checkpoint, int(step)


#: this launch's :class:`ContinuedLaunch` (at most one), set by ``runtime/job.py`` once a resumed launch is past
#: its refusals: launch/run.py then marks that launch's ``status.json`` ``resumed`` however this one ends (done,
#: interrupted, a card failed), as the resume command into the same run directory rewrites its records; a
#: refused launch (exit 2) marks nothing
CONTINUED: list = []


def launch_accepted() -> None:
    """Run (and forget) the :data:`LAUNCH_ACCEPTED` callbacks; called by :func:`rotate_previous_run`'s caller
    in ``runtime/job.py`` before this launch writes its first record."""
    while LAUNCH_ACCEPTED:
        LAUNCH_ACCEPTED.pop(0)()


def rotate_previous_run(run_dir: str) -> Optional[str]:
    """Move an earlier launch's outputs in ``run_dir`` (:func:`_is_run_output`) into ``previous-<k>/``;
    returns it, or None when there was nothing. Call it before this launch writes any of them."""
    if not os.path.isdir(run_dir):
        return None
    return move_to_previous(run_dir, [fn for fn in os.listdir(run_dir) if _is_run_output(fn)])


def rotate_before_status(run_dir: str, started: float) -> Optional[str]:
    """A launch about to write ``status.json`` that never reached :func:`rotate_previous_run` (``plan=true``,
    interrupted or failed while it prepared): move an earlier launch's outputs aside first, so its
    ``status.json`` is not overwritten. ``started``: this launch's start (Unix time, s); a ``status.json``
    that finished after it belongs to a launch that ran alongside (another node of this job sharing the
    run directory) and is left alone. Returns the ``previous-<k>/`` dir, or None."""
    path = os.path.join(run_dir, "status.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            finished = float(json.load(f).get("finished") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        finished = 0.0  # unreadable: not this launch's (written atomically at its end)
    return None if finished >= started else rotate_previous_run(run_dir)


def carry_over(previous: str, run_dir: str, upto_step: int) -> int:
    """A resumed launch continues its records: copy ``previous``'s ``metrics.jsonl`` / ``eval.jsonl`` lines
    with ``step <= upto_step`` into ``run_dir``'s new files; returns the metrics lines copied."""
    n = 0
    for fn in ("metrics.jsonl", "eval.jsonl"):
        src = os.path.join(previous, fn)
        if not os.path.exists(src):
            continue
        with open(src) as f, open(os.path.join(run_dir, fn), "a") as out:
            for line in f:
                try:
                    keep = int(json.loads(line)["step"]) <= int(upto_step)
                except (ValueError, KeyError, TypeError):
                    keep = False  # a torn last line of a killed launch
                if keep:
                    out.write(line if line.endswith("\n") else line + "\n")
                    n += fn == "metrics.jsonl"
    return n


def newest_records(run_dir: str) -> Optional[str]:
    """The newest ``previous-<k>/`` of ``run_dir`` holding a ``metrics.jsonl`` (the last launch that trained
    there; a ``plan=true`` launch or one stopped while it prepared leaves only its status), or None."""
    ks = []
    if os.path.isdir(run_dir):
        for fn in os.listdir(run_dir):
            if fn.startswith("previous-") and fn[len("previous-"):].isdigit():
                ks.append(int(fn[len("previous-"):]))
    for k in sorted(ks, reverse=True):
        d = os.path.join(run_dir, f"previous-{k}")
        if os.path.isfile(os.path.join(d, "metrics.jsonl")):
            return d
    return None


def move_to_previous(parent: str, names: list[str]) -> Optional[str]:
    """Move ``names`` of ``parent`` into its first free ``previous-<k>/`` (created); returns it, or None if
    ``names`` is empty. Deletes nothing."""
    if not names:
        return None
    k = 1
    while os.path.exists(os.path.join(parent, f"previous-{k}")):
        k += 1
    dest = os.path.join(parent, f"previous-{k}")
    os.makedirs(dest)
    for fn in sorted(names):
        os.replace(os.path.join(parent, fn), os.path.join(dest, fn))
    return dest


def _busy(rep: dict) -> float:
    """Seconds of a card's step report spent computing or transferring (the rest of the step is idle)."""
    return rep["compute_s"] + rep["optimizer_s"] + rep["transfer_s"] + rep["send_s"]


def merged_record(reports: list[dict]) -> dict:
    """One step's ``metrics.jsonl`` record from the cards' reports (by rank): the last stage's loss and norm,
    the slowest card's times, every card's memory and times."""
    r0 = reports[-1]
    wall = max(r["time_s"] for r in reports)
    slow = max(reports, key=lambda r: r["time_s"])
    tokens = int(r0["tokens"])
    return {
        "step": int(r0["step"]), "loss": r0["loss"], "lr": r0["lr"], "grad_norm": r0["grad_norm"],
        "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0, "step_s": wall,
        "compute_s": slow["compute_s"], "optimizer_s": slow["optimizer_s"],
        "transfer_s": slow["transfer_s"] + slow["send_s"],
        "idle_s": max(0.0, wall - _busy(slow)),
        "idle_share": max(0.0, 1.0 - sum(_busy(r) for r in reports) / (len(reports) * wall)) if wall > 0 else 0.0,
        "mem_peak_bytes": [int(r["mem_peak"]) for r in reports],
        **phase_peaks([r.get("mem_phases") for r in reports]),
        **{k: slow[k] for k in ("bubble_s", "collective_s", "tied_s") if k in slow},
        # every card's view (list indexed by rank): which stage computes longest, which waits
        **{f"{k}_cards": [r[k] for r in reports] for k in ("compute_s", "bubble_s", "collective_s", "tied_s",
                                                          "cpu_s", "cpu_phases_s", "compute_cpu_s")
           if all(k in r for r in reports)},
        # the objective's per-step metrics (DPO: rewards/chosen, rewards/rejected, rewards/accuracies,
        # rewards/margins, logps/chosen, logps/rejected, named as TRL's DPOTrainer names them)
        **(r0.get("objective") or {}),
        **moe_fields(reports),
        "time": time.time(),
    }


def phase_peaks(per_card: list) -> dict:
    """``{"mem_run_peak_bytes": [per card], "mem_phase_peak_bytes": {phase family: [per card]}}`` from each card's
    ``{phase family: peak bytes}`` so far (load, reference, eval, steps, save, resume, shutdown; 0 where a card has
    no figure); ``{}`` when no card reported one."""
    if not any(per_card):
        return {}
    cards = [dict(m or {}) for m in per_card]
    fams = sorted({f for m in cards for f in m})
    return {"mem_run_peak_bytes": [int(max(m.values(), default=0)) for m in cards],
            "mem_phase_peak_bytes": {f: [int(m.get(f, 0)) for m in cards] for f in fams}}


def moe_fields(reports: list[dict]) -> dict:
    """Mixtures of experts: ``aux_loss`` (the load-balancing loss, mean over the step's micro-batches, as
    transformers' ``aux_loss``; unweighted; None when the loss is off) and ``expert_load_cards`` (per card: over its sparse layers, the
    largest max / mean of the top-k assignments per expert in the step; 1.0 = balanced, None = no sparse layer)."""
    moe = [r.get("moe") for r in reports]
    if not any(moe):
        return {}
    return {"aux_loss": next(m["aux_loss"] for m in moe if m),
            "expert_load_cards": [m.get("expert_load") if m else None for m in moe]}


def moe_text(rec: dict) -> list:
    """The step line's mixture-of-experts parts: ``aux <loss>`` (when on) and ``expert load <per card>``."""
    out = [f"aux {rec['aux_loss']:.4f}"] if rec.get("aux_loss") is not None else []
    if "expert_load_cards" in rec:
        out.append("expert load " + "/".join("-" if x is None else f"{x:.2f}" for x in rec["expert_load_cards"]))
    return out


def device_fields(reports: list[dict]) -> dict:
    """Optional per-device fields: RNGD compilation and CPU-fallback ops, free memory, the host update timeline."""
    rec = {}
    for key, merge in (("compile_s", max), ("cpu_fallbacks", sum), ("compiles", sum)):
        vals = [r[key] for r in reports if key in r]
        if vals:
            rec[key] = merge(vals)
    if any("card_free" in r for r in reports):
        rec["card_free_bytes"] = [int(r.get("card_free", -1)) for r in reports]
        rec["mem_quiet_bytes"] = [int(r.get("mem_quiet", -1)) for r in reports]
    if any((r.get("host") or {}).get("timeline") for r in reports):
        # offloaded layers: the previous step's host update per card (npu_train.optim.offload
        # HostUpdater.take_stats) and this step's marks [start, backward end, clip known]
        # (time.perf_counter s); host_hidden: share of the host update hidden behind other work
        rec["host_overlap_s"] = [float((r.get("host") or {}).get("overlap_s", 0.0)) for r in reports]
        rec["host_hidden"] = [float((r.get("host") or {}).get("hidden", 0.0)) for r in reports]
        rec["host"] = [r.get("host") for r in reports]
        rec["marks"] = [r.get("marks") for r in reports]
    return rec


#: a measured step over this multiple of the plan's step time is slow; :data:`SLOW_STEPS` slow steps (the first
#: step, with start-up and compilation, not counted) print :func:`slow_steps_note` once
SLOW_RATIO = 1.5
SLOW_STEPS = 3


def slow_steps_note(step_s: float, plan_s: float, n: int, load: Optional[tuple[float, int]]) -> str:
    """The one line for steps that run well over the plan: ``step_s`` the mean of the ``n`` slow steps and
    ``plan_s`` the plan's step (seconds), ``load`` :func:`host_load`'s figure. It names the host as busy only
    when the load says so (:func:`~npu_train.hardware.host_busy`); otherwise it says the load is not the
    cause and points at the plan's rates. A reviewer's default job ran 25-38 s steps against a 5.08 s plan
    (load average 8-12 on 2 cores from other jobs) and nothing said why."""
    scale, d, unit = step_time_unit(min(step_s, plan_s))  # the step line's unit (ms under 0.1 s)
    head = (f"note: {n} steps took {step_s / plan_s:.1f}x the plan on average ({step_s * scale:.{d}f} {unit} "
            f"against {plan_s * scale:.{d}f} {unit})")
    if load is None:
        return (f"{head}; this OS gives no load average: check with `top` whether other processes use the "
                "CPU (the plan assumes the cores are this job's)")
    avg, cores = load
    figure = f"load average {avg:.1f} on {cores} core{'s' if cores != 1 else ''}"
    if host_busy(avg, cores):
        return (f"{head}: the host is busy, {figure} (this job alone keeps about {cores} busy); other processes "
                "use the CPU (see `top`): stop them or run when the host is quieter, and the job will take about "
                "as much longer as its steps do")
    return (f"{head}, and the host is not busy ({figure}), so its load is not the cause: the plan's rates may "
            "not fit this host; `calibrate=true` measures them again (docs/calibration.md)")


class Reporter:
    """Collects the cards' per-step reports; writes ``metrics.jsonl``, the trackers and the summary.
    ``predicted_mem``: per-card predicted peak bytes; ``predicted_step_s``: the plan's step time (s);
    ``trackers``: started :class:`~npu_train.metrics.trackers.Guarded` trackers (None: TensorBoard into
    ``<run_dir>/tb`` when ``tensorboard``, as the default ``metrics.logger``); closed by :meth:`close`;
    ``model_flops``: model FLOPs of one step per card (rank order, :mod:`npu_train.metrics.mfu`): with the
    cards' reported ``peak_flops`` each step gets ``mfu`` (job) and ``mfu_cards``; ``live``: the terminal's
    :class:`~npu_train.metrics.live.LiveProgress` (the step line then goes to the log whole and to the terminal
    without the time breakdown); ``plain_phases``: without ``live``, print each card start-up phase once
    (:meth:`phase`; also in a sweep: its jobs were silent for 20-28 s before their first step); ``start_step``: the step a resumed launch
    starts after (the loss average continues over the losses ``metrics.jsonl`` carried over, and is printed
    as ``avg since resume`` when there were none); ``positions_per_step``: every position of a step's sequences
    (all replicas; the plan's ``tokens_per_step``): a step whose trained (target) tokens are fewer (chat data's
    assistant tokens, DPO's completions) also gets ``all_tokens`` and ``all_tokens_per_s``."""

    def __init__(self, run_dir: str, total_steps: int, predicted_mem: Optional[list[int]] = None,
                 predicted_step_s: Optional[float] = None, stream=None, tensorboard: bool = True,
                 trackers: Optional[list] = None, model_flops: Optional[list[float]] = None, live=None,
                 plain_phases: bool = False, start_step: int = 0, positions_per_step: Optional[int] = None):
        self.run_dir = run_dir
        self.positions = positions_per_step
        self.total = total_steps
        self.pred_mem = predicted_mem
        self.pred_step = predicted_step_s
        self.stream = stream or sys.stdout
        # O(1) per step beyond one (step, loss) pair for the plot: long runs must not grow the launcher
        self.losses: list[tuple[int, float]] = []
        self._n = 0
        self._sum_step_s = self._sum_tps = 0.0  # over steps after the first (start-up excluded)
        self._sum_all_tps, self._n_all = 0.0, 0  # all_tokens_per_s, over steps after the first that have it
        self._first_step_s: Optional[float] = None
        self._peak: list[int] = []
        self._phases: dict = {}  # the last step's run and per-phase peaks (summary.json)
        self.skipped = 0  # steps whose update was skipped (non-finite loss or grad norm)
        self._slow_s: list[float] = []  # steps (after the first) over SLOW_RATIO x the plan, seconds
        self._slow_said, self._slow_pending = False, ""  # slow_steps_note printed / to print after the step line
        self.evals: list[dict] = []
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if trackers is None:
            trackers = []
            if tensorboard:
                from npu_train.metrics.trackers import TrackerSetup, open_trackers

                trackers = open_trackers(["tensorboard"], TrackerSetup(run_dir, {}, {}), warn=self.note)
        self.trackers = list(trackers)
        self.live = live
        self.plain_phases, self._phases_said = bool(plain_phases), set()
        self.model_flops = list(model_flops) if model_flops else None
        self._sum_mfu, self._n_mfu, self.peak_sources = 0.0, 0, None
        # per card the most FLOP/s a step has shown (a floor under its peak); mfu_bound: a measured peak was
        # below it, so every MFU since is an upper bound (printed "MFU <=x%")
        self._peak_floor: list[float] = []
        self.mfu_bound = False
        self.t_start = time.time()
        self._said_at = self.t_start  # the last line printed (quiet_startup counts from it)
        self.trace = None  # npu_train.metrics.trace.TraceWriter, from the first step with actions (runtime.trace)
        self._n_ema = 0  # finite losses folded into the EMA
        self._ema = 0.0  # loss EMA (beta LOSS_EMA_BETA), bias-corrected as in Adam: ema / (1 - beta^n)
        self.records_failed: Optional[str] = None  # the first failed write into the run dir (a full disk)
        self._resume_ema()
        # a resumed launch whose run dir holds no earlier losses (a new hydra.run.dir) starts its average afresh:
        # the step line says so, or the jump in "avg" reads as the loss jumping
        self.avg_label = "avg since resume" if int(start_step) > 0 and self._n_ema == 0 else "avg"

    def _record(self, what: str, write) -> None:
        """Run ``write()`` (a write of ``what`` into the run directory). A write that fails (a full disk under
        ``hydra.run.dir``, a lost mount) must not stop training that checkpoints elsewhere: the first failure is
        one warning, and the run's records (metrics, evals, trackers) stop being written from then on."""
        if self.records_failed is not None:
            return
        try:
            write()
        except Exception as e:  # noqa: BLE001 - OSError, or a tracker's own error wrapping it
            self.records_failed = f"{what}: {type(e).__name__}: {e}"
            self.note(f"warning: cannot write {what} in {self.run_dir} ({type(e).__name__}: {e}); the run's "
                      f"records (metrics, evals, trackers) stop after step {self._n} here, training and its "
                      "checkpoints go on: free space there (the run dir), the records of the remaining steps "
                      "are lost")

    def _resume_ema(self) -> None:
        """Fold the carried-over losses into the EMA, so a resumed launch's average continues."""
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                lines = f.readlines()
        except OSError:
            return
        for line in lines:
            try:
                loss = json.loads(line).get("loss")
            except ValueError:
                continue
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                self._fold(float(loss))

    def _fold(self, loss: float) -> None:
        """One finite loss into the EMA (beta :data:`LOSS_EMA_BETA`)."""
        b = self.LOSS_EMA_BETA
        self._ema = b * self._ema + (1 - b) * loss
        self._n_ema += 1

    #: smoothing of the printed loss: exponential moving average with this beta, bias-corrected
    LOSS_EMA_BETA = 0.9

    def note(self, text: str) -> None:
        self._said_at = time.time()
        print(text, file=self.stream, flush=True)

    #: how :meth:`quiet_startup` says a phase whose name alone does not
    PHASE_WORDS = {"start": "process start (Python imports)", "rendezvous": "rendezvous (waits for the others)"}
    #: seconds of start-up without a printed line before :meth:`quiet_startup` says what the cards are doing
    STARTUP_QUIET_S = 10.0

    def quiet_startup(self, cards: list[tuple[str, str]], now: Optional[float] = None) -> None:
        """Plain output (:attr:`plain_phases`), before the first step line: when nothing was printed for
        :data:`STARTUP_QUIET_S` seconds, one line with each card's phase, ``cards``: ``(card label, phase)``
        in rank order, e.g. ``still: cpu:0 model load, cpu:1 rendezvous (waits for the others) (25 s)``
        (the first time a phase begins gets its own line, :meth:`phase`; the default job's layers load for
        10-25 s on a loaded 2-core host with no other line). ``now``: ``time.time()`` (tests pass their own)."""
        if self._n or self.live is not None or not self.plain_phases:
            return
        now = time.time() if now is None else now
        if now - self._said_at < self.STARTUP_QUIET_S:
            return
        what = ", ".join(f"{card} {self.PHASE_WORDS.get(phase, phase)}" for card, phase in cards)
        self.note(fold_long_line(f"still: {what} ({now - self.t_start:.0f} s)"))
        self._said_at = now

    def step(self, reports: list[dict]) -> dict:
        """Merge the reports of all cards for one step (list indexed by rank) and print the line."""
        rec = merged_record(reports)
        step, wall = rec["step"], rec["step_s"]
        if self.positions and rec["tokens"] != self.positions:  # not every position trained (chat, DPO)
            rec["all_tokens"] = int(self.positions)
            rec["all_tokens_per_s"] = self.positions / wall if wall > 0 else 0.0
        self._trace_step(step, reports)
        skipped = any(bool(r.get("skipped")) for r in reports)
        if skipped:
            rec["skipped"] = True
            self.skipped += 1
        if self.pred_mem:
            rec["mem_pred_bytes"] = list(self.pred_mem)
        rec.update(device_fields(reports))
        if self.pred_step:
            rec["step_s_pred"] = self.pred_step
        load = host_load()  # sampled every step: planner.fit skips the speed of a run on a busy host
        if load is not None:
            rec["host_load"] = [round(load[0], 2), int(load[1])]
        self._mfu(rec, reports, wall)
        self._track(rec, step, wall)
        self._slow(wall, load)
        self._record("metrics.jsonl", lambda: self._write_metrics(rec))
        self._record("the trackers' records", lambda: self._log_trackers(rec, step))
        line = self._line(rec, step, wall, skipped)
        if self.live is not None:
            self.live.step(rec)
            self.live.print(self._short(rec, step, wall, skipped), line)
        else:
            self.note(line)
        if self._slow_pending:
            self.note(self._slow_pending)
            self._slow_pending = ""
        return rec

    def _slow(self, wall: float, load: Optional[tuple[float, int]]) -> None:
        """Count a step after the first over :data:`SLOW_RATIO` x the plan; at :data:`SLOW_STEPS` of them print
        :func:`slow_steps_note` (once a run, with the step's :func:`host_load` sample ``load``), after the step's
        line."""
        if self._n <= 1 or not self.pred_step or wall <= SLOW_RATIO * self.pred_step or self._slow_said:
            return
        self._slow_s.append(wall)
        if len(self._slow_s) >= SLOW_STEPS:
            self._slow_said = True
            self._slow_pending = fold_long_line(slow_steps_note(sum(self._slow_s) / len(self._slow_s),
                                                                self.pred_step, len(self._slow_s), load))

    def phase(self, rank: Optional[int], text: str) -> None:
        """A card's phase before the first step line (model load, rendezvous, compilation, the evaluation before
        step 1...): the live display's; in plain output (:attr:`plain_phases`) one line the first time any card
        enters it, with the seconds since the reporter started (the job line), so the tens of seconds before
        the first eval or step line are not silent. A start-up phase (:func:`is_startup_phase`) is labelled
        ``start-up:``; one of a step already run (``checkpoint save of step 1`` after a Ctrl-C in step 1, before
        its step line) is printed without that label."""
        if self._n:
            return
        if self.live is not None:
            self.live.phase(text, rank)
        elif self.plain_phases and not text.startswith("step ") and text not in self._phases_said:
            self._phases_said.add(text)
            head = "start-up: " if is_startup_phase(text) else ""
            self.note(f"{head}{text} (card {rank}, {time.time() - self.t_start:.0f} s)")

    def _mfu(self, rec: dict, reports: list[dict], wall: float) -> None:
        """``mfu`` = all cards' model FLOPs / (step wall time x the sum of their peaks); ``mfu_cards`` per card
        (fractions). Nothing when the FLOPs or a card's peak are unknown."""
        from npu_train.metrics.mfu import mfu

        peaks = [r.get("peak_flops") for r in reports]
        if not self.model_flops or len(self.model_flops) != len(reports) or not all(peaks) or wall <= 0:
            return
        # a card's FLOPs over the step's wall time cannot exceed its true peak: a busy host that measured the
        # peak low shows here. That card's peak becomes the most it has done, and the MFU an upper bound.
        if len(self._peak_floor) != len(peaks):
            self._peak_floor = [0.0] * len(peaks)
        self._peak_floor = [max(lo, f / wall) for lo, f in zip(self._peak_floor, self.model_flops)]
        if any(lo > p for lo, p in zip(self._peak_floor, peaks)):
            self.mfu_bound = True
        peaks = [max(lo, p) for lo, p in zip(self._peak_floor, peaks)]
        job = mfu(sum(self.model_flops), wall, sum(peaks))
        if job is None:
            return
        rec["model_flops"] = sum(self.model_flops)
        rec["mfu"] = job
        if self.mfu_bound:
            rec["mfu_bound"] = True
        rec["mfu_cards"] = [mfu(f, wall, p) for f, p in zip(self.model_flops, peaks)]
        if self.peak_sources is None:
            self.peak_sources = [r.get("peak_source") for r in reports]
        if self._n > 0:  # the first step (start-up, compilation) is left out of the mean, as for step times
            self._sum_mfu += job
            self._n_mfu += 1

    def _trace_step(self, step: int, reports: list[dict]) -> None:
        """``runtime.trace``: the step's actions of every card into ``<run dir>/trace.json``."""
        if not any(r.get("actions") for r in reports):
            return
        if self.trace is None:
            from npu_train.metrics.trace import TraceWriter

            self.trace = TraceWriter(os.path.join(self.run_dir, "trace.json"),
                                     [int(r.get("rank", i)) for i, r in enumerate(reports)])
        self.trace.step(step, [r.get("actions") for r in reports])

    def _track(self, rec: dict, step: int, wall: float) -> None:
        """Running figures: losses (EMA), mean step time, throughput, ETA, peak memory per card."""
        if math.isfinite(float(rec["loss"])):
            self.losses.append((step, float(rec["loss"])))
            self._fold(float(rec["loss"]))
        rec["loss_smoothed"] = self._ema / (1 - self.LOSS_EMA_BETA ** self._n_ema) if self._n_ema else None
        if self._n == 0:
            self._first_step_s = wall
        else:
            self._sum_step_s += wall
            self._sum_tps += rec["tokens_per_s"]
            if "all_tokens_per_s" in rec:
                self._sum_all_tps += rec["all_tokens_per_s"]
                self._n_all += 1
        self._n += 1
        # ETA: remaining steps x mean step time (the first step, with start-up and compilation, excluded
        # once another step was measured)
        mean_s = self._sum_step_s / (self._n - 1) if self._n > 1 else wall
        rec["eta_s"] = max(0, self.total - step) * mean_s
        self._peak = [max(a, b) for a, b in zip(self._peak, rec["mem_peak_bytes"])] or list(rec["mem_peak_bytes"])
        if "mem_phase_peak_bytes" in rec:  # every phase so far, load included (the cards' own running peaks)
            self._phases = {"run_peak_mem_bytes": rec["mem_run_peak_bytes"],
                            "phase_peak_mem_bytes": rec["mem_phase_peak_bytes"]}

    def _log_trackers(self, rec: dict, step: int) -> None:
        """The step's scalars to every tracker: ``train/{loss,lr,grad_norm,tokens_per_s,step_s}`` (finite ones),
        ``memory/card{i}_peak_gib``."""
        if not self.trackers:
            return
        scalars = {f"train/{k}": float(rec[k]) for k in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s")
                   if math.isfinite(float(rec[k]))}
        scalars.update({f"memory/card{i}_peak_gib": m / GIB for i, m in enumerate(rec["mem_peak_bytes"])})
        if rec.get("mfu") is not None:
            scalars["train/mfu"] = rec["mfu"]
        scalars.update({f"train/{k}": float(v) for k, v in rec.items() if k.startswith(("rewards/", "logps/"))
                        and math.isfinite(float(v))})
        for t in self.trackers:
            t.log(scalars, step)

    def _line(self, rec: dict, step: int, wall: float, skipped: bool) -> str:
        """The progress text of one step, each line at most :func:`console_columns` wide: the progress (step, loss,
        grad norm, tokens/s, MFU, step time against the plan) on the first line, then, indented, the time
        breakdown (a mixture of experts': with ``aux`` and ``expert load``), memory per card against the plan
        with the ETA, and any flags (:func:`fit_step_lines`; the learning rate is in ``metrics.jsonl``)."""
        head, tail = self._fields(rec, step, wall, skipped)
        return "\n".join(fit_step_lines(head, tail, moe=bool(moe_text(rec)), width=console_columns()))

    def _short(self, rec: dict, step: int, wall: float, skipped: bool) -> str:
        """The step for a terminal under the live bar (which shows the ETA): the progress and the memory, folded
        between fields at the bar's width (``self.live.width``, :func:`console_columns`): a fresh-clone review saw
        it fitted to 100 columns on an 80-column terminal, which wrapped it mid-word (issue 40). One line where it
        fits, else the progress with the step time on the first (:func:`fit_progress`) and the rest indented."""
        head, tail = self._fields(rec, step, wall, skipped)
        width = getattr(self.live, "width", None) or console_columns()
        rest = moe_text(rec) + [f for f in tail if f.startswith(("mem ", "SKIPPED"))]
        if len(" | ".join(head + rest)) <= width:
            return " | ".join(head + rest)
        head, rest = fit_progress(head, rest, width)
        return fold_fields(head, width) + "\n" + fold_fields(rest, width, first_indent="  ")

    def _fields(self, rec: dict, step: int, wall: float, skipped: bool) -> tuple[list[str], list[str]]:
        """The step's fields: ``(progress, details)``."""
        mem = "/".join(f"{m / GIB:.2f}" for m in rec["mem_peak_bytes"])
        notes = []  # the run's peak over every phase (load, evaluation, saves ...) when above the step's
        if any(r > m for r, m in zip(rec.get("mem_run_peak_bytes", []), rec["mem_peak_bytes"])):
            notes.append("run " + "/".join(f"{m / GIB:.2f}" for m in rec["mem_run_peak_bytes"]))
        if self.pred_mem:
            notes.append("plan " + "/".join(f"{m / GIB:.2f}" for m in self.pred_mem))
        pred = f" ({', '.join(notes)})" if notes else ""
        scale, d, unit = step_time_unit(min(wall, self.pred_step) if self.pred_step else wall)  # both in one unit
        plan_s = f" (plan {self.pred_step * scale:.{d}f})" if self.pred_step else ""
        w = len(str(self.total))
        avg = f" ({self.avg_label} {rec['loss_smoothed']:.4f})" if rec.get("loss_smoothed") is not None else ""
        head = [f"step {step:>{w}}/{self.total}", f"loss {rec['loss']:.4f}{avg}", f"gnorm {rec['grad_norm']:.3f}",
                tok_text(rec)] + ([mfu_text(rec)[3:]] if mfu_text(rec) else [])
        if "rewards/accuracies" in rec:
            head.append(f"reward acc {rec['rewards/accuracies']:.2f} margin {rec['rewards/margins']:+.3f}")
        head.append(f"{wall * scale:.{d}f} {unit}{plan_s}")
        parts = " ".join(f"{k} {rec[f] * scale:.{d}f}" for k, f in (("fwd/bwd", "compute_s"), ("opt", "optimizer_s"),
                                                                    ("xfer", "transfer_s"), ("idle", "idle_s")))
        tail = [f"[{parts}{' ms' if unit == 'ms' else ''}]", *moe_text(rec), f"mem GiB {mem}{pred}",
                f"ETA {fmt_duration(rec['eta_s'])}"]
        if rec.get("compile_s"):
            tail.append(f"compiled before the step in {rec['compile_s']:.1f} s")
        if rec.get("cpu_fallbacks"):
            tail.append(f"{rec['cpu_fallbacks']} op(s) fell back to the CPU")
        if skipped:
            tail.append("SKIPPED: non-finite loss or grad norm, no update (train.nonfinite=skip)")
        return head, tail

    def eval(self, step: int, val_loss: float, tokens: int, extra: Optional[dict] = None) -> None:
        """Record a held-out evaluation after ``step`` optimizer steps: the objective's loss (SFT: mean token
        cross-entropy in nats; DPO: mean pair loss, with ``extra``'s reward metrics as ``val_rewards/...``)."""
        rec = {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "tokens": tokens,
               **{f"val_{k}": v for k, v in (extra or {}).items()}, "time": time.time()}
        if extra:  # a DPO loss: exp(loss) is no perplexity
            del rec["val_ppl"]
        self.evals.append(rec)

        def write() -> None:
            with open(os.path.join(self.run_dir, "eval.jsonl"), "a") as f:
                f.write(dumps(rec) + "\n")
            if math.isfinite(val_loss):
                for t in self.trackers:
                    t.log({"eval/loss": val_loss, **{f"eval/{k}": float(v) for k, v in (extra or {}).items()}}, step)

        self._record("eval.jsonl", write)
        if extra and "rewards/accuracies" in extra:
            self.note(f"eval after step {step}: val DPO loss {val_loss:.4f}, reward accuracy "
                      f"{extra['rewards/accuracies']:.2f}, margin {extra['rewards/margins']:+.3f} ({tokens:,} held-out "
                      "completion tokens)")
            return
        self.note(f"eval after step {step}: val loss {val_loss:.4f} (ppl {rec['val_ppl']:.2f}) on {tokens:,} held-out tokens")

    def finish(self, extra: Optional[dict] = None) -> dict:
        """Write ``summary.json`` and ``loss.png`` (if matplotlib is installed); return the summary."""
        n, losses = self._n, self.losses
        summ = {
            "steps_run": n,
            "first_loss": losses[0][1] if losses else None,
            "last_loss": losses[-1][1] if losses else None,
            "mean_step_s": self._sum_step_s / (n - 1) if n > 1 else self._first_step_s,
            "mean_tokens_per_s": self._sum_tps / (n - 1) if n > 1 else None,
            **({"mean_all_tokens_per_s": self._sum_all_tps / self._n_all} if self._n_all else {}),
            "peak_mem_bytes": self._peak,
            **self._phases,
            "wall_s": time.time() - self.t_start,
            "first_val_loss": self.evals[0]["val_loss"] if self.evals else None,
            "last_val_loss": self.evals[-1]["val_loss"] if self.evals else None,
            "skipped_steps": self.skipped,
        }
        if self._n_mfu or self.peak_sources:
            summ["mean_mfu"] = self._sum_mfu / self._n_mfu if self._n_mfu else None
            summ["peak_flops_sources"] = self.peak_sources
            if self.mfu_bound:
                summ["mfu_bound"] = True  # a measured peak was below what a step did: mean_mfu is an upper bound
        if extra:
            summ.update(extra)
        self._record("the trackers' summary", lambda: [t.summary(summ) for t in self.trackers])
        if self.trace is not None:
            text = self.trace.summary()
            self.trace.close()
            summ["trace"] = self.trace.path
            if text:
                self.note(text + f"\ntrace: {self.trace.path} (open in https://ui.perfetto.dev)")
        self._record("summary.json", lambda: self._write_summary(summ))
        if losses and self.records_failed is None:
            self._plot(losses)
        self.close()
        return summ

    def _plot(self, losses: list) -> None:
        """``loss.png``: the run's train and held-out losses (needs matplotlib; never raises)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            train, evals = self._run_points()
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot([a for a, _ in train], [b for _, b in train], marker="o" if len(train) <= 100 else None,
                    label="train")
            if evals:
                ax.plot([a for a, _ in evals], [b for _, b in evals], marker="s", label="held-out")
                ax.legend()
            first = losses[0][0]
            resumed = f" (this launch from step {first})" if train and train[0][0] < first else ""
            ax.set_title(f"{self.run_name()}{resumed}", fontsize=9)
            ax.set_xlabel("optimizer step")
            ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
            ax.set_ylabel("loss (nats/token)")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(os.path.join(self.run_dir, "loss.png"), dpi=100)
            plt.close(fig)
        except OSError:  # a full disk: no partial plot stays
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.run_dir, "loss.png"))
        except Exception:  # noqa: BLE001 - no plot (no matplotlib) is no error
            pass

    def _write_metrics(self, rec: dict) -> None:
        """One line of ``metrics.jsonl``; a failed write leaves no partial line (cut back to the last whole one)."""
        size = os.path.getsize(self.jsonl.name)
        try:
            self.jsonl.write(dumps(rec) + "\n")
            self.jsonl.flush()
        except OSError:
            with contextlib.suppress(OSError):
                os.truncate(self.jsonl.name, size)
            raise

    def _write_summary(self, summ: dict) -> None:
        path = os.path.join(self.run_dir, "summary.json")
        try:
            with open(path, "w") as f:
                f.write(dumps(summ, indent=1))
        except OSError:
            with contextlib.suppress(OSError):  # no partial file
                os.remove(path)
            raise

    def run_name(self) -> str:
        """The run directory's :func:`dir_label` (a sweep job: ``<time>/<job number>``)."""
        return dir_label(self.run_dir)

    def _run_points(self) -> tuple[list, list]:
        """``(step, loss)`` and ``(step, val_loss)`` of the whole run from ``metrics.jsonl`` / ``eval.jsonl``,
        which a resumed launch continues (:func:`carry_over`), so the plot shows the run, not the launch."""
        out = []
        for fn, key in (("metrics.jsonl", "loss"), ("eval.jsonl", "val_loss")):
            pts = {}
            for rec in _jsonl(os.path.join(self.run_dir, fn)):
                v = rec.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v) and isinstance(rec.get("step"), int):
                    pts[rec["step"]] = float(v)  # a repeated step (an eval at a resume point): the later one
            out.append(sorted(pts.items()))
        return out[0], out[1]

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if not self.jsonl.closed:
            with contextlib.suppress(OSError):  # its last flush on a full disk: warned about already
                self.jsonl.close()
        trackers, self.trackers = self.trackers, []  # closed once; each says where its run went
        for t in trackers:
            said = getattr(t, "on", True) and getattr(t, "where", None)
            try:
                t.close()
            except Exception:  # noqa: BLE001 - its files on a full disk
                continue
            where = said() if said else None
            if where:
                self.note(where)


#: the widest a printed line may be (a terminal's usual 100 columns; narrower on a narrower terminal,
#: :func:`console_columns`)
LINE_COLUMNS = 100

def fold_fields(fields: list[str], width: int = LINE_COLUMNS, first_indent: str = "", indent: str = "  ") -> str:
    """``fields`` joined by `` | ``, folded between fields so no line is wider than ``width`` (a field wider
    than a line gets a line of its own); lines after the first are indented by ``indent``."""
    lines, cur = [], first_indent
    for f in fields:
        if cur.strip() and len(cur) + 3 + len(f) > width:
            lines.append(cur)
            cur = indent + f
        else:
            cur = cur + " | " + f if cur.strip() else cur + f
    lines.append(cur)
    return "\n".join(lines)


#: seconds a launcher phase runs without a line before :func:`still_saying` says what it does, and between its lines
STILL_EVERY_S = 5.0


@contextlib.contextmanager
def still_saying(what: str, every: Optional[float] = None, out=None):
    """While the block runs, a ``still: <what> (N s)`` line every ``every`` seconds (none for a block that ends
    sooner; default :data:`STILL_EVERY_S`), folded at words; ``out`` writes one line (default: stdout in one write, flushed). The launcher's
    quiet phases before the card processes start (the GGUF header with its tokenizer vocabulary, tokenising the
    data, importing a tracker) left a fresh-clone review 11-13 s without a line on a loaded host (issue 40)."""
    import threading

    def write(text: str) -> None:
        sys.stdout.write(text + "\n")  # one write: the main thread may print meanwhile
        sys.stdout.flush()

    out, every = out or write, STILL_EVERY_S if every is None else float(every)
    done, t0 = threading.Event(), time.monotonic()

    def run() -> None:
        while not done.wait(every):
            out(fold_long_line(f"still: {what} ({time.monotonic() - t0:.0f} s)"))

    th = threading.Thread(target=run, name="still-saying", daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()


#: progress fields that move to the details' front, in this order, while the progress is wider than a line
MOVABLE_PROGRESS = ("gnorm ", "reward acc ", "MFU ", "")


def fit_progress(head: list[str], tail: list[str], width: int = LINE_COLUMNS) -> tuple[list[str], list[str]]:
    """A step line's ``(progress, details)`` fields (:meth:`Reporter._fields`: the step time last in the progress,
    the ``[fwd/bwd ...]`` breakdown first in the details) rearranged so the progress is one line of ``width``
    columns where it can be: the grad norm, then a DPO run's reward, the MFU and the tokens/s move to the
    details' front; the step and its loss stay first and the step time last. A resumed run's ``(avg since
    resume ...)`` otherwise put the step time alone on a line between the two (issue 40)."""
    head, moved = list(head), []
    for prefix in MOVABLE_PROGRESS:
        if len(" | ".join(head)) <= width:
            break
        hit = [f for f in head[2:-1] if (f.startswith(prefix) if prefix else " tok/s" in f)]
        head = [f for f in head if f not in hit]
        moved += hit
    return head, moved + list(tail)


def _max_of_cards(field: str) -> str:
    """``mem GiB 2.70/2.06 (run 3.10/2.20, plan 3.39/2.92)`` as ``mem GiB max 2.70 (run 3.10, plan 3.39)``,
    ``expert load 1.73/-/1.90`` as ``expert load max 1.90``: the per-card lists of a step's memory and expert
    load cut to their largest, for a step line that must stay short; other fields as they are."""
    if not field.startswith(("mem GiB ", "expert load ")):
        return field
    cut = re.sub(r"[\d.-]+(?:/[\d.-]+)+", lambda m: max((x for x in m.group(0).split("/") if x != "-"), key=float,
                                                           default="-"), field)
    return re.sub(r"^(mem GiB|expert load) ", r"\1 max ", cut) if cut != field else field


def fit_step_lines(head: list[str], tail: list[str], moe: bool = False, width: int = LINE_COLUMNS) -> list[str]:
    """A step's printed lines, each at most ``width`` columns: the progress (:func:`fit_progress`, the step time
    on it), then the details indented two spaces, the ETA kept with the memory: two lines in all for a dense
    step, three for a mixture of experts' (``moe``: its ``aux`` and ``expert load`` with the breakdown), flags
    (a compilation, CPU fallbacks, a skipped step) adding their own. When the details would take more, the
    memory's and the expert load's per-card lists are cut to their largest (``metrics.jsonl`` keeps each card's). A fresh-clone review
    saw a resumed dense step end with a line of ``  ETA 0s`` alone and an MoE step of four lines (issue 40)."""
    head, tail = fit_progress(head, tail, width)
    flags = [f for f in tail if f.startswith(("compiled ", "SKIPPED")) or f.endswith("fell back to the CPU")]
    details = [f for f in tail if f not in flags]

    def joined(fields: list[str]) -> list[str]:
        out = []
        for f in fields:  # the ETA joins the memory: never a line of its own
            if f.startswith("ETA ") and out and out[-1].startswith("mem GiB "):
                out[-1] += " | " + f
            else:
                out.append(f)
        return out

    def fold(fields: list[str]) -> list[str]:
        fields = joined(fields)
        if not moe:
            return fold_fields(fields, width, first_indent="  ").split("\n")
        k = next((i for i, f in enumerate(fields) if f.startswith("mem GiB ")), len(fields))  # its own line
        return [ln for part in (fields[:k], fields[k:]) if part
                for ln in fold_fields(part, width, first_indent="  ").split("\n")]

    lines = fold(details)
    if len(lines) > (2 if moe else 1):
        lines = fold([_max_of_cards(f) for f in details])
    if flags:
        lines += fold_fields(flags, width, first_indent="  ").split("\n")
    return [fold_fields(head, width)] + lines


def is_startup_phase(text: str) -> bool:
    """Whether a card's phase ``text`` (``Trainer.enter``) belongs to the start-up, before step 1: not a step's
    own phases, a checkpoint save, the shutdown, or an evaluation after step N >= 1."""
    if text.startswith(("step ", "checkpoint save", "shutdown")):
        return False
    m = re.match(r"evaluation after step (\d+)", text)
    return not (m and int(m.group(1)) > 0)


#: a line of a label and one value: ``  checkpoint: /a/long/path``
_LABELLED = re.compile(r"^ *[A-Za-z][\w-]*: \S+$")


def shell_lines(words: list[str], width: int = LINE_COLUMNS, indent: str = "") -> list[str]:
    """A shell command as printed lines that paste: ``words`` (each already quoted for the shell,
    :func:`shlex.quote`) joined by spaces, broken only between words, each line but the last ending in a line
    continuation `` \\`` and the lines after the first indented two spaces deeper than ``indent``; every line at
    most ``width`` columns, except a word wider than that (a long path), which stands whole on a line of its
    own. Pasted, all its lines run the command; :func:`fold_long_line` never folds a line ending in `` \\``.
    A fresh-clone review copied the first line of a generate command the console had folded, and ran it
    without its checkpoint path."""
    lines, cur = [], indent + words[0]
    for w in words[1:]:
        if len(cur) + 1 + len(w) + 2 > width:  # 2: the " \\" a line that goes on ends with
            lines.append(cur + " \\")
            cur = indent + "  " + w
        else:
            cur += " " + w
    return lines + [cur]


def resume_lines(words: list[str], width: int) -> list[str]:
    """A resume command's lines after the line that names its checkpoint (the ``stopped:`` block, the
    launcher's ``error:`` and ``interrupted`` lines): ``  resume with:`` on a line of its own, then ``words``
    (:func:`shell_lines`) indented four spaces, each line within ``width`` columns but a word wider alone."""
    return ["  resume with:", *shell_lines(words, width, indent="    ")]


def fold_long_line(line: str, width: Optional[int] = None) -> str:
    """``line`` (no newline) folded at words so that no piece is wider than ``width`` columns (default: the
    console's, :func:`console_columns`: folded at 100 and again by the launcher's 80-column
    :class:`LineFolder`, a note read as two interleaved paragraphs, issue 40), the pieces after
    the first indented two spaces deeper than the line's own indent; unchanged when it fits. A word wider
    than a line (a long path) stays whole on a line of its own; a ``label: <value>`` line (one word each,
    ``checkpoint: <path>``) stays whole, running past ``width``: folding it would only cut the label from
    its value (issue 40); so does a shell line that goes on on the next (:func:`shell_lines`: ending in
    `` \\``; folded, the command would end there)."""
    from npu_train.errors import wrap_words  # never between a number and its unit

    width = console_columns() if width is None else int(width)
    if len(line) <= width or _LABELLED.match(line) or line.endswith(" \\"):
        return line
    indent = line[:len(line) - len(line.lstrip(" "))]
    return "\n".join(wrap_words(line[len(indent):], width, initial_indent=indent, subsequent_indent=indent + "  ")) or line


class LineFolder:
    """Folds written text line by line (:func:`fold_long_line`): :meth:`feed` returns the text of the complete
    lines so far, folded; the unfinished last line waits for its newline or :meth:`drain`. Every line the
    launcher prints to stdout goes through one (the console, ``run.log``: a redirected output has no terminal
    that would fold it, and a line of 349 columns was unreadable)."""

    def __init__(self, width: int = LINE_COLUMNS) -> None:
        self.width, self.part = int(width), ""

    def feed(self, s: str) -> str:
        *lines, self.part = (self.part + s).split("\n")
        return "".join(fold_long_line(ln, self.width) + "\n" for ln in lines)

    def drain(self) -> str:
        """The unfinished line as it is (a flush: the text must reach the console now)."""
        out, self.part = self.part, ""
        return out


def tok_text(rec: dict) -> str:
    """A step's throughput: ``182 tok/s`` where every position of its sequences is trained (text), else the
    trained (target) tokens a second and every position's, ``14 trained tok/s (87 all)`` (chat data trains its
    assistant tokens only; the plan's tokens/s and the MFU count every position)."""
    trained = f"{rec['tokens_per_s']:,.0f}"
    if rec.get("all_tokens_per_s") is None:
        return f"{trained} tok/s"
    return f"{trained} trained tok/s ({rec['all_tokens_per_s']:,.0f} all)"


def mfu_text(rec: dict) -> str:
    """`` | MFU 41.2%`` of a step record (``""`` without one); `` | MFU <=98.0%`` when the MFU is an upper bound
    (``mfu_bound``: a card did more FLOP/s than the peak measured for it, so its peak was raised to that)."""
    if rec.get("mfu") is None:
        return ""
    return f" | MFU {'<=' if rec.get('mfu_bound') else ''}{100 * rec['mfu']:.1f}%"


def dir_label(path: str) -> str:
    """A directory's last two parts, how runs and sweeps are named to people and trackers
    (``outputs/2026-12-03/10-00-00.123456`` -> ``2026-12-03/10-00-00.123456``)."""
    return "/".join(os.path.normpath(os.path.abspath(str(path))).split(os.sep)[-2:])


def _jsonl(path: str) -> list[dict]:
    """The records of a JSONL file (unreadable lines, e.g. a killed launch's torn last line, skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except OSError:
        pass
    return out


def step_time_unit(step_s: float) -> tuple[float, int, str]:
    """``(scale, decimals, unit)`` of a step line's times for a step of ``step_s`` seconds: seconds with two
    decimals from :data:`~npu_train.planner.spec.MS_BELOW_S` (the plan's switch), else milliseconds, one decimal
    from 10 ms and two below (a tiny model's step read ``0.02 s (plan 0.02)`` and ``[fwd/bwd 0.02 opt 0.00 ...]``)."""
    from npu_train.planner.spec import MS_BELOW_S

    if step_s >= MS_BELOW_S or step_s <= 0:
        return 1.0, 2, "s"
    return 1e3, 1 if step_s >= 0.01 else 2, "ms"


def fmt_duration(seconds: float) -> str:
    """``75.3`` -> ``"1m15s"``, ``4000`` -> ``"1h06m"``, ``8`` -> ``"8s"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_loss(x: Optional[float]) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


#: a float literal as Hydra writes an override's value back (``0.0001``, ``3e-05``, ``1.5``): not an int
_FLOAT_VALUE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][+-]?\d+)$")


def fmt_override(override: str) -> str:
    """``key=value`` with a float ``value`` as :func:`fmt_number` writes it (``train.lr=0.0001`` ->
    ``train.lr=1e-4``); any other override as it is."""
    key, eq, value = override.partition("=")
    return f"{key}={fmt_number(float(value))}" if eq and _FLOAT_VALUE.match(value.strip()) else override
