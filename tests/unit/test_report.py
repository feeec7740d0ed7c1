"""Reporter: progress line fields, JSONL records, summary aggregates, held-out evals."""
from __future__ import annotations

import io
import itertools
import json
import os
import re

import pytest

from npu_train.metrics.report import Reporter


def _rep(step, loss, t, mem):
    return {"step": step, "loss": loss, "lr": 1e-4, "grad_norm": 0.5, "tokens": 1000, "time_s": t,
            "compute_s": 0.5, "optimizer_s": 0.1, "transfer_s": 0.0, "send_s": 0.0, "mem_peak": mem}


def test_reporter_lines_records_and_summary(tmp_path):
    out = io.StringIO()
    r = Reporter(str(tmp_path), 3, predicted_mem=[2 ** 30, 2 ** 30], predicted_step_s=1.5, stream=out,
                 tensorboard=False)
    r.eval(0, 3.0, 64)
    for i, (t, m) in enumerate([(4.0, 10), (1.0, 30), (2.0, 20)], start=1):
        r.step([_rep(i, 4.0 - i, t, m), _rep(i, 4.0 - i, t / 2, 2 * m)])
    r.eval(3, 2.0, 64)
    summ = r.finish()
    text = out.getvalue()
    assert "step 2/3 | loss 2.0000 (avg 2.4737) | gnorm 0.500 | 1,000 tok/s | 1.00 s (plan 1.50)\n" in text
    assert "eval after step 3: val loss 2.0000" in text
    assert summ["steps_run"] == 3 and summ["first_loss"] == 3.0 and summ["last_loss"] == 1.0
    assert summ["mean_step_s"] == 1.5  # steps after the first: (1 + 2) / 2
    assert summ["peak_mem_bytes"] == [30, 60]
    assert summ["first_val_loss"] == 3.0 and summ["last_val_loss"] == 2.0
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in rows] == [1, 2, 3] and rows[0]["step_s"] == 4.0
    assert len(open(tmp_path / "eval.jsonl").readlines()) == 2
    assert os.path.exists(tmp_path / "summary.json")


def test_smoothed_loss_and_eta(tmp_path):
    """avg = bias-corrected EMA (beta 0.9) of the step losses; ETA = steps left x mean step time after step 1."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 10, stream=out, tensorboard=False)
    losses, times = [5.0, 3.0, 4.0], [30.0, 2.0, 4.0]
    recs = [r.step([_rep(i + 1, l, t, 1)]) for i, (l, t) in enumerate(zip(losses, times))]
    ema = 0.0
    for n, (l, rec) in enumerate(zip(losses, recs), start=1):
        ema = 0.9 * ema + 0.1 * l
        assert abs(rec["loss_smoothed"] - ema / (1 - 0.9 ** n)) < 1e-12
    assert recs[0]["eta_s"] == 9 * 30.0           # only the first step known
    assert recs[2]["eta_s"] == 7 * (2.0 + 4.0) / 2  # start-up step excluded
    assert "ETA 21s" in out.getvalue().splitlines()[-1]


def test_cpu_seconds_per_card_and_phase(tmp_path):
    """Each card's CPU seconds of the step and of its schedule / collectives / optimizer phases reach
    metrics.jsonl by rank (the trainer's ``cpu_s`` / ``cpu_phases_s``)."""
    r = Reporter(str(tmp_path), 1, stream=io.StringIO(), tensorboard=False)
    reps = [dict(_rep(1, 2.0, 3.0, 1), cpu_s=2.5, cpu_phases_s=[2.0, 0.3, 0.2]),
            dict(_rep(1, 2.0, 2.0, 1), cpu_s=1.5, cpu_phases_s=[1.2, 0.2, 0.1])]
    rec = r.step(reps)
    assert rec["cpu_s_cards"] == [2.5, 1.5]
    assert rec["cpu_phases_s_cards"] == [[2.0, 0.3, 0.2], [1.2, 0.2, 0.1]]
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["cpu_phases_s_cards"][1] == [1.2, 0.2, 0.1]
    assert "cpu_s_cards" not in r.step([_rep(2, 2.0, 1.0, 1)])  # older cards without the fields


def test_loss_plot_shows_the_whole_run_after_a_resume(tmp_path):
    """A resumed launch's metrics.jsonl starts with the earlier launch's steps (carry_over): the plot's points
    are the whole run's, and its title names the run and where this launch started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = tmp_path / "2026-12-03" / "10-00-00"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:  # what carry_over copied from the first launch
        for s, loss in ((1, 4.0), (2, 3.5)):
            f.write(json.dumps({"step": s, "loss": loss}) + "\n")
    with open(run / "eval.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "val_loss": 4.2}) + "\n")
    r = Reporter(str(run), 4, stream=io.StringIO(), tensorboard=False)
    for s, loss in ((3, 3.0), (4, 2.5)):
        r.step([_rep(s, loss, 1.0, 10)])
    r.eval(4, 2.8, 64)
    titles = []
    real_savefig = plt.Figure.savefig
    def savefig(fig, *a, **k):  # record what is plotted, then write the file
        titles.append(fig.axes[0].get_title())
        titles.append([ln.get_xydata().tolist() for ln in fig.axes[0].lines])
        return real_savefig(fig, *a, **k)

    plt.Figure.savefig = savefig
    try:
        r.finish()
    finally:
        plt.Figure.savefig = real_savefig
    assert titles[0] == "2026-12-03/10-00-00 (this launch from step 3)"
    assert titles[1] == [[[1, 4.0], [2, 3.5], [3, 3.0], [4, 2.5]], [[0, 4.2], [4, 2.8]]]
    assert os.path.getsize(run / "loss.png") > 0


def test_step_line_and_summary_show_the_run_peak_of_every_phase(tmp_path):
    """Issue 43: a card's load (or evaluation, save) peak above its step peak shows on the step line as ``run``,
    and summary.json keeps each card's peak per phase and over the run (the cards' running ``mem_phases``)."""
    G = 2 ** 30
    out = io.StringIO()
    r = Reporter(str(tmp_path), 2, predicted_mem=[4 * G, 4 * G], stream=out, tensorboard=False)
    phases = [{"load": 3 * G, "steps": 2 * G}, {"load": G, "steps": 2 * G}]  # card 0 peaked in its load
    r.step([dict(_rep(1, 3.0, 1.0, 2 * G), mem_phases=phases[0]), dict(_rep(1, 3.0, 1.0, 2 * G), mem_phases=phases[1])])
    # two cards' lists with the breakdown and the ETA pass 100 columns: the largest card's (issue 40)
    assert "mem GiB max 2.00 (run 3.00, plan 4.00) | ETA" in out.getvalue()
    later = [dict(phases[0], save=G // 2), dict(phases[1], save=G // 2)]
    r.step([dict(_rep(2, 2.0, 1.0, G), mem_phases=later[0]), dict(_rep(2, 2.0, 1.0, G), mem_phases=later[1])])
    summ = r.finish()
    assert summ["run_peak_mem_bytes"] == [3 * G, 2 * G]
    assert summ["phase_peak_mem_bytes"] == {"load": [3 * G, G], "save": [G // 2, G // 2], "steps": [2 * G, 2 * G]}
    rec = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")][-1]
    assert rec["mem_run_peak_bytes"] == [3 * G, 2 * G]
    # no phase above the step's peak: the line stays as before
    (tmp_path / "b").mkdir()
    r2 = Reporter(str(tmp_path / "b"), 1, predicted_mem=[4 * G], stream=(o2 := io.StringIO()), tensorboard=False)
    r2.step([dict(_rep(1, 3.0, 1.0, 2 * G), mem_phases={"load": G, "steps": 2 * G})])
    assert "mem GiB 2.00 (plan 4.00)" in o2.getvalue()


def test_step_lines_fit_a_hundred_columns_folded_between_fields(tmp_path):
    """A step line was ~135 columns (190 with 2 cards' memory): the progress fields come first, the time
    breakdown, memory and ETA on an indented second line, folded between fields (``|``) so no line is wider
    than 100 columns, 8 cards included; the terminal under the live bar gets the progress and the memory."""
    from npu_train.metrics.report import fold_fields

    assert fold_fields(["a" * 40, "b" * 40, "c" * 40]) == "a" * 40 + " | " + "b" * 40 + "\n  " + "c" * 40
    assert fold_fields(["x" * 120, "y"]) == "x" * 120 + "\n  y"  # a field wider than a line stays whole
    out = io.StringIO()
    r = Reporter(str(tmp_path), 1000, predicted_mem=[3 * 2 ** 30] * 8, predicted_step_s=6.27, stream=out,
                 tensorboard=False)
    rec = r.step([_rep(1, 3.7435, 5.62, 2 ** 31) for _ in range(8)])
    text = out.getvalue().rstrip("\n")
    lines = text.splitlines()
    assert max(len(l) for l in lines) <= 100 and len(lines) >= 2, text
    assert lines[0] == "step    1/1000 | loss 3.7435 (avg 3.7435) | gnorm 0.500 | 178 tok/s | 5.62 s (plan 6.27)"
    assert all(l.startswith("  ") for l in lines[1:])
    assert lines[1].startswith("  [fwd/bwd 0.50 opt 0.10 xfer 0.00 idle ") and "ETA 1h33m" in text
    # 8 cards' memory lists would take a third line: the largest card's (metrics.jsonl keeps each, issue 40)
    assert len(lines) == 2 and lines[1].endswith("| mem GiB max 2.00 (plan 3.00) | ETA 1h33m"), text
    short = r._short(rec, 1, 5.62, False)
    assert short.startswith(lines[0]) and "mem GiB 2.00/" in short and "ETA" not in short and "fwd/bwd" not in short
    assert max(len(l) for l in short.splitlines()) <= 100


def test_the_live_bar_shows_the_reporters_eta_never_dashes(monkeypatch):
    """rich's TimeRemainingColumn showed ``-:--:--`` whenever a step took longer than its 30 s speed window: the
    bar shows the reporter's ETA (steps left x mean step time)."""
    from rich.console import Console

    from npu_train.metrics.live import LiveProgress

    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.setattr("sys.stderr", io.StringIO())
    live = LiveProgress(20, 0, io.StringIO()).start()
    try:
        live.step({"step": 3, "loss": 3.7, "tokens_per_s": 182.0, "mem_peak_bytes": [2 ** 31], "eta_s": 97.0})
        buf = io.StringIO()
        Console(file=buf, width=200, color_system=None).print(live.progress.make_tasks_table(live.progress.tasks))
    finally:
        live.stop()
    assert "3/20 ETA 1m37s" in buf.getvalue() and "-:--" not in buf.getvalue(), buf.getvalue()


def test_done_and_interrupt_lines_fold_at_words_on_a_terminal():
    """The ``done:`` and ``interrupted`` lines ran past the terminal and broke mid-word: on a terminal they
    fold at words (paths stay whole), and ``status.json``'s message still gets the whole interrupt line."""
    from npu_train.runtime.job import fold_words
    from scripts import LAUNCH_RUN, load_script

    line = ("done: 20 steps, loss 3.9005 -> 3.2410; checkpoint /home/user/npu-train/outputs/2026-12-06/05-00-00/"
            "checkpoints/step_000020; metrics /home/user/npu-train/outputs/2026-12-06/05-00-00/metrics.jsonl")
    folded = fold_words(line, 80)
    assert fold_words(line, 0) == line
    assert all(len(l) <= 80 or " " not in l.strip() for l in folded.splitlines())
    assert " ".join(l.strip() for l in folded.splitlines()) == line  # broken only between words
    assert "/home/user/npu-train/outputs/2026-12-06/05-00-00/metrics.jsonl" in folded.splitlines()[-1]

    run = load_script(LAUNCH_RUN, "npt_launch_run_fold")
    tee = run._ErrorLineTee(io.StringIO())
    stop = "interrupted by SIGINT at step 3; the run continues from checkpoint step_000003 with train.resume=latest"
    tee.write(fold_words(stop, 40) + "\nnext line\n")
    assert tee.last == stop


def test_plain_output_names_each_start_up_phase_once(tmp_path):
    """Plain output was silent for ~39 s between the job line and the first eval line (the cards loading,
    meeting, measuring, evaluating): each start-up phase prints once, from whichever card enters it first;
    nothing once steps run, nothing per step phase, nothing with ``plain_phases=False`` (the live display's)."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 2, stream=out, tensorboard=False, plain_phases=True)
    for rank, text in [(0, "model load"), (1, "model load"), (1, "rendezvous"), (0, "rendezvous"),
                       (0, "evaluation after step 0"), (0, "step 1 forward/backward")]:
        r.phase(rank, text)
    r.step([_rep(1, 3.0, 1.0, 1)])
    r.phase(0, "checkpoint save of step 1")
    said = [l for l in out.getvalue().splitlines() if l.startswith("start-up:")]
    assert [l.split(" (card")[0] for l in said] == ["start-up: model load", "start-up: rendezvous",
                                                    "start-up: evaluation after step 0"]
    assert said[1].startswith("start-up: rendezvous (card 1, ")
    (tmp_path / "q").mkdir()
    quiet = io.StringIO()
    Reporter(str(tmp_path / "q"), 2, stream=quiet, tensorboard=False).phase(0, "model load")
    assert quiet.getvalue() == ""


def test_average_after_a_resume_into_a_new_run_dir_says_since_resume(tmp_path):
    """A resumed launch in a run dir with no earlier losses (a new ``hydra.run.dir``, the default) restarts the
    loss average: the step line says ``avg since resume`` (it printed ``avg`` and the figure jumped with no word);
    with the earlier records carried over (the same run dir) it is the run's ``avg``, continued."""
    fresh, same = tmp_path / "fresh", tmp_path / "same"
    fresh.mkdir()
    same.mkdir()
    (same / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n" for s in (1, 2)))
    lines = {}
    for name, d in (("fresh", fresh), ("same", same)):
        out = io.StringIO()
        r = Reporter(str(d), 4, stream=out, tensorboard=False, start_step=2)
        r.step([_rep(3, 2.0, 1.0, 10)])
        lines[name] = out.getvalue().splitlines()[0]
    # EMA (beta 0.9), bias-corrected: one loss of 2.0 alone; 3.0, 3.0, 2.0 continued
    cont = (0.9 * (0.9 * 0.1 * 3.0 + 0.1 * 3.0) + 0.1 * 2.0) / (1 - 0.9 ** 3)
    assert "loss 2.0000 (avg since resume 2.0000)" in lines["fresh"], lines["fresh"]
    assert f"loss 2.0000 (avg {cont:.4f})" in lines["same"], lines["same"]
    out = io.StringIO()
    Reporter(str(tmp_path / "fresh"), 4, stream=out, tensorboard=False).step([_rep(1, 2.0, 1.0, 10)])
    assert "(avg 2.0000)" in out.getvalue()  # a first launch: plain avg


def test_every_launcher_line_fits_100_columns_folded_at_words():
    """Redirected output (``run.log``, a pipe) had ``rates``/``memory``/``job`` lines up to 349 columns: the
    launcher's tee folds each line wider than 100 columns at words; nothing is lost or reordered, indented
    lines keep their indent, a word longer than a line (a path) stays whole, short lines are untouched."""
    from npu_train.metrics.report import LineFolder, fold_long_line

    words = [f"w{i}" + "x" * (i % 13) for i in range(120)]
    long = "rates cpu: " + " ".join(words)
    path = "/" + "p" * 130
    text = f"short line\n{long}\n    {long}\nsee {path} there\n"
    f = LineFolder()
    got = f.feed(text[:50]) + f.feed(text[50:]) + f.drain()  # written in pieces, as print() does
    lines = got.splitlines()
    assert lines[0] == "short line"
    assert all(len(ln) <= 100 for ln in lines if path not in ln), [len(ln) for ln in lines]
    assert " ".join(ln.strip() for ln in lines) == " ".join(ln.strip() for ln in text.splitlines())
    indented = [ln for ln in lines if ln.startswith("    ")]
    assert indented[0].startswith("    rates cpu:") and all(ln.startswith("      ") for ln in indented[1:])
    assert any(ln.strip() == path for ln in lines)
    assert fold_long_line("x" * 100) == "x" * 100
    assert f.feed("partial") == "" and f.drain() == "partial"


def test_a_tiny_step_line_says_milliseconds(tmp_path):
    """A tiny model's step of 20.9 ms against a plan of 18.4 ms (it read ``0.02 s (plan 0.02)`` and ``[fwd/bwd
    0.02 opt 0.00 ...]``, issue 40): the step, the plan and the breakdown in ms, one decimal from 10 ms."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 2, predicted_mem=[2 ** 30], predicted_step_s=0.0184, stream=out, tensorboard=False)
    rec = dict(_rep(1, 2.0, 0.0209, 10), compute_s=0.0172, optimizer_s=0.0009, transfer_s=0.0001)
    r.step([rec])
    text = out.getvalue()
    assert "| 20.9 ms (plan 18.4)" in text, text
    assert "[fwd/bwd 17.2 opt 0.9 xfer 0.1 idle " in text and " ms] |" in text, text
    assert " 0.02 " not in text and "0.00" not in text.split("mem GiB")[0], text


def test_a_resumed_step_is_two_lines_with_its_time_on_the_first(tmp_path):
    """After a resume ``(avg since resume ...)`` widened the progress past 100 columns and the step time took a
    line of its own between the progress and the breakdown (three lines, issue 40): the grad norm moves to the
    details' line instead, and where the progress is still too wide the time joins its breakdown."""
    from npu_train.metrics.report import fit_progress

    out = io.StringIO()
    r = Reporter(str(tmp_path), 300, predicted_mem=[2 ** 30], predicted_step_s=0.10, stream=out, tensorboard=False,
                 start_step=80)
    r.step([dict(_rep(81, 6.2576, 0.15, 2 ** 29), compute_s=0.12, optimizer_s=0.0)])
    lines = out.getvalue().rstrip("\n").splitlines()
    assert len(lines) == 2 and max(len(ln) for ln in lines) <= 100, lines
    assert lines[0] == "step  81/300 | loss 6.2576 (avg since resume 6.2576) | 6,667 tok/s | 0.15 s (plan 0.10)"
    assert lines[1].startswith("  gnorm 0.500 | [fwd/bwd 0.12 opt 0.00 "), lines


def _steps(tmp_path, cards, start_step, moe=False, eta_steps=300):
    """The printed lines of one step on ``cards`` cards (peaks of 2.70 GiB, an earlier phase's of 3.10 GiB,
    a plan of 3.39 GiB), optionally resumed and of a mixture of experts."""
    out = io.StringIO()
    tmp_path.mkdir(exist_ok=True)
    r = Reporter(str(tmp_path), eta_steps, predicted_mem=[int(3.39 * 2 ** 30)] * cards, predicted_step_s=6.27,
                 stream=out, tensorboard=False, start_step=start_step)
    reps = []
    for k in range(cards):
        rep = dict(_rep(start_step + 1, 3.7435, 5.62, int(2.70 * 2 ** 30)), compute_s=4.95, optimizer_s=0.05,
                   transfer_s=0.01, mem_phases={"load": int(3.10 * 2 ** 30)})
        if moe:
            rep["moe"] = {"aux_loss": 2.2644, "expert_load": 1.73 + k / 100}
        reps.append(rep)
    r.step(reps)
    return out.getvalue().rstrip("\n").splitlines()


@pytest.mark.parametrize("cards", [1, 2, 4, 8])
@pytest.mark.parametrize("start_step", [0, 80])
def test_a_step_is_two_lines_three_for_experts_with_the_time_first(tmp_path, cards, start_step):
    """Fresh or resumed, on 1-8 cards: a dense step is two lines, a mixture of experts' three, each within
    100 columns; the step time ends the first line, ``expert load`` is with the breakdown and the ETA with
    the memory. A fresh-clone review saw an MoE step of four lines and a resumed dense step whose third line
    was ``  ETA 0s`` alone (issue 40)."""
    for moe, n in ((False, 2), (True, 3)):
        lines = _steps(tmp_path / f"{moe}", cards, start_step, moe=moe)
        assert len(lines) == n and max(len(ln) for ln in lines) <= 100, lines
        assert lines[0].startswith(f"step {start_step + 1:>3}/300 | loss 3.7435 ("), lines
        assert lines[0].endswith("5.62 s (plan 6.27)"), lines
        assert lines[1].startswith("  ") and "[fwd/bwd 4.95 opt 0.05 xfer 0.01 idle " in lines[1], lines
        assert re.search(r"mem GiB .* \| ETA \S+$", lines[-1]), lines
        if moe:
            assert "aux 2.2644" in lines[1] and re.search(r"expert load (1\.73|max 1\.80)", lines[1]), lines


def test_a_step_and_its_plan_share_a_unit(tmp_path):
    """A tiny model's step of 0.21 s against a plan the plan table prints as ``step 75.1 ms`` read ``0.21 s
    (plan 0.08)`` (issue 40): when either is below 0.1 s both (and the breakdown) are in ms."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 2, predicted_mem=[2 ** 30], predicted_step_s=0.0751, stream=out, tensorboard=False)
    r.step([dict(_rep(1, 2.0, 0.21, 10), compute_s=0.18, optimizer_s=0.01, transfer_s=0.0)])
    text = out.getvalue()
    assert "| 210.0 ms (plan 75.1)" in text, text
    assert "[fwd/bwd 180.0 opt 10.0 xfer 0.0 idle " in text and " ms] |" in text, text


def _slow_run(tmp_path, monkeypatch, walls, load):
    """A 2-card run with a 5 s plan whose steps took ``walls`` seconds on a host of 2 cores at 1-minute load
    average ``load``: the printed text."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = io.StringIO()
    r = Reporter(str(tmp_path), len(walls), predicted_step_s=5.0, stream=out, tensorboard=False)
    for i, t in enumerate(walls, start=1):
        r.step([_rep(i, 3.0, t, 10), _rep(i, 3.0, t, 10)])
    r.close()
    return out.getvalue()


def test_steps_well_over_the_plan_on_a_busy_host_say_so_once(tmp_path, monkeypatch):
    """Issue (fresh-clone review): steps of 25-38 s against a 5.08 s plan on a 2-core host at load 8-12 printed
    no reason. Three steps over 1.5x the plan (the first step, start-up, not counted) print one note after the
    third's line: the mean of the slow steps over the plan, (26 + 30 + 38) / 3 / 5 = 6.27x, and the load average
    against the cores (9.0 >= 1.5 x 2: busy)."""
    text = _slow_run(tmp_path, monkeypatch, [60.0, 26.0, 30.0, 38.0, 25.0], 9.0)
    notes = [l for l in text.splitlines() if l.startswith("note: ")]
    assert len(notes) == 1, text
    flat = " ".join(text[text.index("note: "):].split())
    assert flat.startswith("note: 3 steps took 6.3x the plan on average (31.33 s against 5.00 s): the host is "
                           "busy, load average 9.0 on 2 cores"), flat
    assert "`top`" in flat
    lines = text.splitlines()
    assert lines[lines.index(notes[0]) - 2].startswith("step 4/5"), text  # after step 4's two lines


@pytest.mark.parametrize("columns", [80, 100])
def test_the_busy_host_note_is_folded_once_at_the_consoles_width(tmp_path, monkeypatch, columns):
    """At 80 columns the note was folded at 100 by the reporter and again at 80 by the launcher's folder: lines of
    60, 20 and 80 columns, indented 2 and 4, two paragraphs interleaved. Folded once at the console's width, the
    launcher's folder (launch/run.py's _LogTee) leaves it as it is, every line fits, and it reads as one paragraph:
    the first line unindented, the others indented two spaces."""
    from npu_train.metrics import report

    monkeypatch.setattr(report, "console_columns", lambda stream=None: columns)
    text = _slow_run(tmp_path, monkeypatch, [60.0, 26.0, 30.0, 38.0, 25.0], 7.6)
    folder = report.LineFolder(columns)
    assert folder.feed(text) + folder.drain() == text  # nothing left for the launcher to fold again
    lines = text[text.index("note: "):].splitlines()
    note = lines[:1] + list(itertools.takewhile(lambda ln: ln.startswith("  ") and not ln.startswith("   "), lines[1:]))
    assert len(note) >= 2 and all(len(ln) <= columns for ln in note), note
    flat = " ".join(ln.strip() for ln in note)
    assert flat == report.slow_steps_note(31.333333333333332, 5.0, 3, (7.6, 2)), (flat, note)


def test_slow_steps_on_a_quiet_host_do_not_blame_the_host(tmp_path, monkeypatch):
    """Load average 1.2 on 2 cores is below 1.5 per core: the note says the host is not busy, never "busy"."""
    text = _slow_run(tmp_path, monkeypatch, [9.0, 8.0, 8.0, 8.0], 1.2)
    flat = " ".join(text[text.index("note: "):].split())
    assert "the host is not busy (load average 1.2 on 2 cores)" in flat and "host is busy" not in flat, flat
    assert "calibrate=true" in flat


def test_a_slow_steps_note_under_a_tenth_of_a_second_is_in_ms():
    """As the step line: a 49.1 ms plan and 92.6 ms steps read in ms (92.6 / 49.1 = 1.9x), not ``0.09 s``."""
    from npu_train.metrics.report import slow_steps_note

    assert slow_steps_note(0.0926, 0.0491, 3, (6.6, 2)).startswith(
        "note: 3 steps took 1.9x the plan on average (92.6 ms against 49.1 ms): the host is busy")


@pytest.mark.parametrize("walls", [[60.0, 7.4, 7.4, 7.4, 7.4],  # 1.48x the plan: not slow
                                   [60.0, 9.0, 9.0, 5.0, 5.0]])  # two slow steps only
def test_steps_near_the_plan_print_no_note(tmp_path, monkeypatch, walls):
    assert "note: " not in _slow_run(tmp_path, monkeypatch, walls, 9.0)


def test_a_chat_step_says_its_trained_and_all_tokens_a_second(tmp_path):
    """Chat LoRA (fresh-clone review): 162 assistant tokens trained of 1,024 positions in an 11.80 s step printed
    ``14 tok/s`` next to a plan of ``277 tokens/s`` (every position). The step now names both: 162 / 11.80 =
    13.7 trained tokens a second, 1,024 / 11.80 = 86.8 over every position; metrics.jsonl keeps ``tokens`` and
    ``tokens_per_s`` (trained) and adds ``all_tokens`` / ``all_tokens_per_s``, summary.json
    ``mean_all_tokens_per_s`` (steps after the first)."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 3, predicted_step_s=3.70, stream=out, tensorboard=False, positions_per_step=1024)
    for i, t in enumerate([20.0, 11.80, 8.0], start=1):
        r.step([dict(_rep(i, 3.0, t, 10), tokens=162)])
    summ = r.finish()
    lines = out.getvalue().splitlines()
    assert "| 14 trained tok/s (87 all) |" in lines[2], lines
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert rows[1]["tokens"] == 162 and rows[1]["tokens_per_s"] == pytest.approx(162 / 11.80)
    assert rows[1]["all_tokens"] == 1024 and rows[1]["all_tokens_per_s"] == pytest.approx(1024 / 11.80)
    assert summ["mean_tokens_per_s"] == pytest.approx((162 / 11.80 + 162 / 8.0) / 2)
    assert summ["mean_all_tokens_per_s"] == pytest.approx((1024 / 11.80 + 1024 / 8.0) / 2)


def test_a_text_step_trains_every_position_and_keeps_one_tok_s(tmp_path):
    """Text trains every position: one ``tok/s`` figure, no ``all_*`` keys."""
    out = io.StringIO()
    r = Reporter(str(tmp_path), 2, stream=out, tensorboard=False, positions_per_step=1000)
    for i in (1, 2):
        r.step([_rep(i, 3.0, 2.0, 10)])
    summ = r.finish()
    assert "| 500 tok/s |" in out.getvalue() and "trained" not in out.getvalue()
    assert "all_tokens_per_s" not in json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert "mean_all_tokens_per_s" not in summ


def test_every_step_record_samples_the_hosts_load(tmp_path, monkeypatch):
    """``metrics.jsonl`` holds ``host_load`` = [1-minute load average, cores] at each step (what planner.fit
    decides a busy run from); an OS without a load average writes none."""
    _slow_run(tmp_path, monkeypatch, [5.0, 5.0], 2.345)
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert [r["host_load"] for r in recs] == [[2.35, 2], [2.35, 2]], recs

    def no_load():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", no_load)
    out = io.StringIO()
    (tmp_path / "n").mkdir()
    r = Reporter(str(tmp_path / "n"), 1, predicted_step_s=5.0, stream=out, tensorboard=False)
    assert "host_load" not in r.step([_rep(1, 3.0, 5.0, 10), _rep(1, 3.0, 5.0, 10)])
    r.close()
