"""Issue 40 (first impressions): settings that contradict each other are refused before work, and the
launcher's messages say one thing one way."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config, validate
from npu_train.errors import ConfigError


def test_lora_setting_without_lora_mode_is_refused():
    """``lora.rank=16`` alone (train.mode=full) used to run a full fine-tune in silence: one error naming
    train.mode=lora; the same settings with train.mode=lora, and the defaults with full, are fine."""
    cfg = OmegaConf.structured(Config)
    validate(cfg)  # the defaults: full, lora.* untouched
    cfg.lora.rank = 16
    with pytest.raises(ConfigError, match=r"lora\.rank=16 set, but train\.mode=full .*add train\.mode=lora"):
        validate(cfg)
    cfg.train.mode = "lora"
    validate(cfg)
    cfg = OmegaConf.structured(Config)
    cfg.lora.targets = ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"lora\.targets=\[q_proj,v_proj\] set"):
        validate(cfg)
    cfg = OmegaConf.structured(Config)
    cfg.lora.alpha = 16  # the default's value written as an integer is no change
    validate(cfg)


def test_resumed_schedule_line_is_a_whole_phrase(monkeypatch, capsys):
    """A resumed ``train.schedule=auto`` run printed ``train.schedule=auto: zb-h2, the resumed checkpoint's``,
    which reads cut off: the line names what it keeps (the schedule) and why."""
    from types import SimpleNamespace

    from npu_train.runtime import job

    monkeypatch.setattr(job, "_resumed_train", lambda cfg, run_dir: {"schedule": "zb-h2", "recompute": False})
    cfg = OmegaConf.structured(Config)
    cfg.train.schedule = "auto"
    job._choose_schedule(cfg, "/nonexistent", SimpleNamespace(is_moe=False), "fp32", [], 1, 1, 0, None)
    line = capsys.readouterr().out.strip()
    assert cfg.train.schedule == "zb-h2"
    assert line.startswith("train.schedule=auto: zb-h2, the resumed checkpoint's schedule (a resume keeps it"), line
    assert not line.endswith("checkpoint's"), line


def test_moe_auto_schedule_line_leads_with_the_schedule_used(monkeypatch, capsys):
    """With the load-balancing loss on, ``train.schedule=auto`` printed ``train.schedule=auto: zb-h2 (predicted
    ...); 1f1b instead: ...`` and ran 1f1b (issue 40): the line starts with the schedule used and says why."""
    from types import SimpleNamespace

    from npu_train.planner import schedule_choice
    from npu_train.runtime import job

    why = "train.schedule=auto: zb-h2 (predicted step 3.84 s; 1f1b 4.10 s)"
    monkeypatch.setattr(job, "_resumed_train", lambda cfg, run_dir: None)
    request = SimpleNamespace(shape=SimpleNamespace(vocab_parallel=False))
    monkeypatch.setattr(job, "plan_request", lambda *a, **k: request)
    monkeypatch.setattr(schedule_choice, "choose_schedule", lambda *a, **k: SimpleNamespace(
        schedule="zb-h2", recompute=False, why=why, plan=None, recompute_attention=False, recompute_fewest=False))
    monkeypatch.setattr(job, "_aux_needs_1f1b", lambda cfg, mcfg: True)
    cfg = OmegaConf.structured(Config)
    cfg.train.schedule = "auto"
    job._choose_schedule(cfg, "/nonexistent", SimpleNamespace(is_moe=True), "fp32", [], 1, 1, 0, None)
    line = capsys.readouterr().out.strip()
    assert cfg.train.schedule == "1f1b"
    assert line.startswith("train.schedule=auto: 1f1b, as the mixture-of-experts load-balancing loss "
                           "(train.moe_aux_loss) needs a full backward"), line
    assert line.endswith("without the loss: zb-h2 (predicted step 3.84 s; 1f1b 4.10 s)"), line
