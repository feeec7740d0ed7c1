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
    job._choose_schedule(cfg, "/nonexistent", SimpleNamespace(is_moe=False), "fp32", [None], 1, 1, 0, None)
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


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_two_chunk_schedule_on_one_stage_is_refused_before_start(schedule):
    """rev4 BUG 1: ``train.schedule=zbv`` (or interleaved) on one card started every process and then crashed in
    the card (chunk 0 has no next card to send to): one ConfigError at launch naming the fix; 2 stages are fine."""
    from npu_train.runtime import job

    cfg = OmegaConf.structured(Config)
    cfg.train.schedule, cfg.train.accum = schedule, 2
    with pytest.raises(ConfigError, match=rf"train\.schedule={schedule} needs at least 2 pipeline stages.*this "
                                          r"launch has 1: use train\.schedule=1f1b"):
        job._check_interleaved(cfg, 1)
    job._check_interleaved(cfg, 2)


def test_resumed_two_chunk_schedule_onto_one_card_is_chosen_anew(monkeypatch, capsys):
    """rev4 BUG 1: a 2-card zbv checkpoint resumed onto one card kept zbv (a resume keeps its schedule) and
    crashed in the card; the schedule cannot run there, so auto says so and chooses as a fresh launch would
    (as a resume onto another card count already replans the recompute layers); on 2 cards zbv is kept."""
    from types import SimpleNamespace

    from npu_train.planner import schedule_choice
    from npu_train.runtime import job

    monkeypatch.setattr(job, "_resumed_train", lambda cfg, run_dir: {"schedule": "zbv", "recompute": False})
    request = SimpleNamespace(shape=SimpleNamespace(vocab_parallel=False))
    monkeypatch.setattr(job, "plan_request", lambda *a, **k: request)
    monkeypatch.setattr(schedule_choice, "choose_schedule", lambda *a, **k: SimpleNamespace(
        schedule="1f1b", recompute=False, why="train.schedule=auto: 1f1b (predicted step 1 s)", plan=None,
        recompute_attention=False, recompute_fewest=False))
    for cards, want in ((["c0"], "1f1b"), (["c0", "c1"], "zbv")):
        cfg = OmegaConf.structured(Config)
        cfg.train.schedule = "auto"
        job._choose_schedule(cfg, "/nonexistent", SimpleNamespace(is_moe=False), "fp32", cards, 1, 1, 0, None)
        out = capsys.readouterr().out
        assert cfg.train.schedule == want, out
        said = "the resumed checkpoint's schedule zbv needs at least 2 pipeline stages and this launch has 1"
        assert (said in out) == (len(cards) == 1), out


def test_a_resume_with_another_batch_layout_names_the_setting():
    """rev4 POLISH 2: a resume with another train.accum was refused naming the sampler's internal
    ``micro_batches x dp_size`` and six settings to repeat; it names the one that differs and its value."""
    from npu_train.runtime import job

    manifest = {"train": {"micro_batch": 1, "accum": 2, "seed": 1234}, "parallel": {"dp": 1}}
    cfg = OmegaConf.structured(Config)
    cfg.train.micro_batch, cfg.train.accum, cfg.train.seed, cfg.parallel.dp = 1, 4, 1234, 1
    assert job._layout_fix(cfg, manifest) == ("train.accum: checkpoint 2, now 4 (the data order of each step "
                                              "depends on it): resume with train.accum=2")
    cfg.train.micro_batch = 2
    assert job._layout_fix(cfg, manifest) == (
        "train.micro_batch: checkpoint 1, now 2; train.accum: checkpoint 2, now 4 (the data order of each step "
        "depends on them): resume with train.micro_batch=1 train.accum=2")
    cfg.train.micro_batch, cfg.train.accum = 1, 2
    assert job._layout_fix(cfg, manifest) is None  # the data or data.seq_len changed: the general message


def test_a_misspelt_lora_target_gets_a_suggestion():
    """rev4 POLISH 4: ``lora.targets=[q_prj]`` listed the valid names without the one meant (unknown keys get
    ``did you mean train.steps?``): the nearest target is named; a name like none of them gets no guess."""
    cfg = OmegaConf.structured(Config)
    cfg.train.mode = "lora"
    cfg.lora.targets = ["q_prj", "v_proj"]
    with pytest.raises(ConfigError, match=r"lora\.targets=\['q_prj', 'v_proj'\]: use a non-empty subset of "
                                          r"\[.*\] \(did you mean q_proj\?\)$"):
        validate(cfg)
    cfg.lora.targets = ["zzz"]
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "did you mean" not in str(e.value)
