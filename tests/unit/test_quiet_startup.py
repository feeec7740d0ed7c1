"""Plain output says what the cards do when the start-up is silent for long: the default job's model load was
10-25 s on a loaded 2-core host between ``start-up: model load`` and ``start-up: rendezvous`` with no line.
The clock is the test's (``now=``), not the machine's."""
from __future__ import annotations

import io

from npu_train.metrics.report import Reporter


def _reporter(tmp_path, **kw):
    out = io.StringIO()
    rep = Reporter(str(tmp_path), total_steps=3, stream=out, tensorboard=False, plain_phases=True, **kw)
    return rep, out


def test_a_silent_start_up_gets_a_line_naming_each_cards_phase(tmp_path):
    rep, out = _reporter(tmp_path)
    t0 = rep.t_start
    cards = [("cpu:0", "model load"), ("cpu:1", "rendezvous")]
    rep.quiet_startup(cards, now=t0 + rep.STARTUP_QUIET_S - 0.5)
    assert out.getvalue() == ""  # not yet: a line came (the job line) less than the interval ago
    rep.quiet_startup(cards, now=t0 + rep.STARTUP_QUIET_S + 1)
    assert out.getvalue().splitlines() == [
        "still: cpu:0 model load, cpu:1 rendezvous (waits for the others) (11 s)"]
    rep.quiet_startup(cards, now=t0 + rep.STARTUP_QUIET_S + 5)  # once per silent interval
    assert len(out.getvalue().splitlines()) == 1
    rep.quiet_startup([("cpu:0", "start"), ("cpu:1", "start")], now=t0 + 2 * rep.STARTUP_QUIET_S + 2)
    assert out.getvalue().splitlines()[-1] == ("still: cpu:0 process start (Python imports), cpu:1 process start "
                                               "(Python imports) (22 s)")


def test_any_printed_line_restarts_the_interval(tmp_path):
    rep, out = _reporter(tmp_path)
    rep.phase(0, "model load")  # "start-up: model load (card 0, ...)": a line now
    rep.quiet_startup([("cpu:0", "model load")], now=rep._said_at + rep.STARTUP_QUIET_S - 1)
    assert out.getvalue().count("\n") == 1


def test_quiet_after_the_first_step_line_and_with_the_live_display(tmp_path):
    rep, out = _reporter(tmp_path)
    rep._n = 1  # a step line was printed: steps say the rest
    rep.quiet_startup([("cpu:0", "step 2 forward/backward")], now=rep.t_start + 1000)
    live, out2 = _reporter(tmp_path / "x" if (tmp_path / "x").mkdir() is None else None, live=object())
    live.quiet_startup([("cpu:0", "model load")], now=live.t_start + 1000)
    assert out.getvalue() == "" and out2.getvalue() == ""


def test_many_cards_fold_at_100_columns(tmp_path):
    rep, out = _reporter(tmp_path)
    rep.quiet_startup([(f"cpu:{k}", "model load") for k in range(8)], now=rep.t_start + 60)
    lines = out.getvalue().splitlines()
    assert len(lines) > 1 and all(len(l) <= 100 for l in lines), lines


def test_a_checkpoint_save_before_the_first_step_line_is_not_called_start_up(tmp_path):
    """A Ctrl-C in step 1 saves step 1 before any step line: that phase printed
    ``start-up: checkpoint save of step 1 (card 1, 44 s)``; a save, the shutdown or an evaluation after a step
    are not the start-up, the evaluation before step 1 (after step 0) is."""
    rep, out = _reporter(tmp_path)
    for text in ("model load", "evaluation after step 0", "checkpoint save of step 1", "evaluation after step 1",
                 "shutdown"):
        rep.phase(1, text)
    lines = [l.rsplit(" (card", 1)[0] for l in out.getvalue().splitlines()]
    assert lines == ["start-up: model load", "start-up: evaluation after step 0", "checkpoint save of step 1",
                     "evaluation after step 1", "shutdown"], lines
