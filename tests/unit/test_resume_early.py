"""rev4 POLISH 3: ``train.resume=latest`` without ``checkpoint.dir`` is refused before the plan search when the
launch's run directory holds no checkpoints (launch/run.py ``check_resume_early``)."""
from __future__ import annotations

from scripts import LAUNCH_RUN, load_script


def _launcher():
    return load_script(LAUNCH_RUN, "_npt_launcher_resume_early")


def test_resume_latest_without_checkpoint_dir_is_refused_before_planning(tmp_path):
    """rev4 POLISH 3: ``train.resume=latest`` without checkpoint.dir planned (the schedule search printed), then
    refused naming a fresh, empty ``outputs/<date>/<new time>/checkpoints``. It is refused at once, naming the
    newest run directories beside it that hold checkpoints; a run directory with checkpoints resumes on."""
    from omegaconf import OmegaConf

    from npu_train.config import Config
    from npu_train.errors import ConfigError

    run = _launcher()
    old = tmp_path / "outputs" / "2026-12-07" / "08-01-53"
    (old / "checkpoints" / "step_000002").mkdir(parents=True)
    (old / "checkpoints" / "step_000002" / "manifest.json").write_text("{}")
    (tmp_path / "outputs" / "2026-12-07" / "08-02-00" / "checkpoints").mkdir(parents=True)  # none complete
    new = tmp_path / "outputs" / "2026-12-07" / "09-00-00"
    new.mkdir()
    cfg = OmegaConf.structured(Config)
    cfg.train.resume = "latest"
    try:
        run.check_resume_early(cfg, str(new))
        raise AssertionError("not refused")
    except ConfigError as e:
        msg = str(e)
    assert msg.startswith(f"train.resume=latest without checkpoint.dir resumes from this launch's run directory, "
                          f"{new}, which holds no checkpoint: set checkpoint.dir="), msg
    assert msg.count(str(tmp_path)) == 3 and f"{old / 'checkpoints'}; or drop train.resume" in msg, msg
    run.check_resume_early(cfg, str(old))  # its own checkpoints: the job resumes
    cfg.checkpoint.dir = str(old / "checkpoints")
    run.check_resume_early(cfg, str(new))
    cfg.checkpoint.dir, cfg.train.resume = None, "auto"
    run.check_resume_early(cfg, str(new))
