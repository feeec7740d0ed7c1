"""rev4 BUG 2: a SIGTERM that reached the launcher after the last step (during the final evaluation or save)
ended a complete run as ``interrupted`` (exit 143) with a resume command that the next launch refused ("the run
is complete"). :func:`npu_train.runtime.job._finish` now ends such a run as done, with a note and no resume
command; a signal before the last step still raises :class:`~npu_train.errors.Interrupted`."""
from __future__ import annotations

import io
import signal
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.errors import Interrupted
from npu_train.metrics.report import Reporter


def _card(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100, "time_s": 0.5,
            "compute_s": 0.4, "optimizer_s": 0.05, "transfer_s": 0.0, "send_s": 0.0, "mem_peak": 2 ** 30}


def _finish(tmp_path, monkeypatch, steps_done: int, ckpt):
    from npu_train.planner import fit
    from npu_train.runtime import job as J

    monkeypatch.setattr(fit, "refit_from_run", lambda *a, **k: None)
    rep = Reporter(str(tmp_path), 2, stream=io.StringIO())
    for s in range(1, steps_done + 1):
        rep.step([_card(s, 4.0 - s)])
    coord = SimpleNamespace(interrupted=True, signum=signal.SIGTERM, last_ckpt=ckpt, rejected=0, ranks=[],
                            run_dir=str(tmp_path))
    job = SimpleNamespace(coord=coord, reporter=rep, job_id="j")
    prep = SimpleNamespace(plan=SimpleNamespace(step_time_s=0.5, stages=[], rates=None), cards=[], dp=1)
    cfg = OmegaConf.structured(Config)
    cfg.train.steps = 2
    resume = SimpleNamespace(start_step=0, saving=True, ckpt_root=str(tmp_path / "checkpoints"), resume_dir=None)
    node = SimpleNamespace(node_rank=0, nnodes=1, is_owner=False)
    return J._finish(job, cfg, str(tmp_path), prep, resume, node,
                     resume_with=lambda root: ["launch/run.py", "train.resume=latest", f"checkpoint.dir={root}"])


def test_a_signal_after_the_last_step_ends_a_complete_run_as_done(tmp_path, monkeypatch, capsys):
    ckpt = str(tmp_path / "checkpoints" / "step_000002")
    summ = _finish(tmp_path, monkeypatch, 2, ckpt)
    out = capsys.readouterr().out
    assert summ["steps_run"] == 2 and "stopped_at" not in summ
    assert ("note: SIGTERM came after the last step: the run is complete (its final checkpoint "
            f"{ckpt} is saved), nothing to resume") in " ".join(out.split()), out
    assert "train.resume=latest" not in out, out


def test_a_signal_before_the_last_step_still_interrupts(tmp_path, monkeypatch, capsys):
    ckpt = str(tmp_path / "checkpoints" / "step_000001")
    with pytest.raises(Interrupted) as e:
        _finish(tmp_path, monkeypatch, 1, ckpt)
    assert e.value.signum == signal.SIGTERM and "after the last step" not in capsys.readouterr().out


def test_an_aborted_interrupt_save_without_a_checkpoint_says_a_rerun_starts_again(tmp_path):
    """rev4 POLISH 6: a second Ctrl-C during the interrupt save ended with "no checkpoint saved", without the
    usual tail every other no-checkpoint end has (``saving.NO_CHECKPOINT_YET``); with a checkpoint it names it."""
    from npu_train.runtime.coordinator import Coordinator
    from npu_train.runtime.saving import NO_CHECKPOINT_YET

    me = SimpleNamespace(ckpt_root=str(tmp_path / "checkpoints"), last_ckpt=None, signum=signal.SIGINT,
                         specs=[SimpleNamespace(train=SimpleNamespace(offload_update="sync"))])
    e = Coordinator._aborted(me)
    assert str(e).endswith(f"the interrupt save was aborted; {NO_CHECKPOINT_YET}") and e.checkpoint is None, str(e)
    me.last_ckpt = str(tmp_path / "checkpoints" / "step_000003")
    e = Coordinator._aborted(me)
    assert f"last complete checkpoint {me.last_ckpt}; " in str(e) and e.checkpoint == me.last_ckpt, str(e)
