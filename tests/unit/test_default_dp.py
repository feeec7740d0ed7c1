"""``parallel.dp`` left unset (the default, null): the planner chooses the layout where every card is an accelerator,
one pipeline as written where any card is a cpu card (runtime/job.py ``default_dp``); an explicit value wins; a
re-split from micro-batch ``b`` keeps the held-out evaluation's rows (``_eval_rows_kept``)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config, ConfigError, validate
from npu_train.runtime.job import _eval_rows_kept, default_dp


def _cfg(*dotlist: str):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(dotlist)))


def test_the_default_is_unset_and_valid():
    cfg = _cfg()
    assert cfg.parallel.dp is None
    validate(cfg)  # null passes the checks of an integer or auto


@pytest.mark.parametrize("kinds, want", [(["furiosa"] * 8, "auto"), (["cuda", "cuda"], "auto"),
                                         (["cpu", "cpu"], 1), (["furiosa", "cpu"], 1)])
def test_unset_resolves_by_card_kind(kinds, want):
    cfg = _cfg()
    default_dp(cfg, kinds)
    assert cfg.parallel.dp == want


@pytest.mark.parametrize("given", ["1", "2", "auto"])
def test_an_explicit_value_wins(given):
    cfg = _cfg(f"parallel.dp={given}")
    for kinds in (["furiosa"] * 4, ["cpu"] * 4):
        default_dp(cfg, kinds)
        assert str(cfg.parallel.dp) == given


def test_zero_1_with_cpu_cards_and_no_dp_is_one_clear_error():
    cfg = _cfg("parallel.zero=1")
    validate(cfg)
    with pytest.raises(ConfigError, match=r"parallel.zero=1 needs parallel.dp >= 2 .*set parallel.dp=2 \(or auto\)"):
        default_dp(cfg, ["cpu", "cpu"])


@pytest.mark.parametrize("eval_batches, written, new, want, note", [
    (4, 2, 1, 8, False),   # 8 rows in micro-batches of 1
    (4, 2, 4, 2, False),   # 8 rows in micro-batches of 4
    (1, 2, 4, 1, True),    # 2 rows cannot be one micro-batch of 4: 4 rows, said
    (0, 2, 1, 0, False),   # off stays off
    (4, 2, 2, 4, False),   # not re-split
])
def test_a_re_split_keeps_the_held_out_rows(eval_batches, written, new, want, note):
    cfg = _cfg(f"data.eval_batches={eval_batches}", f"train.micro_batch={new}")
    got = _eval_rows_kept(cfg, written)
    assert cfg.data.eval_batches == want
    assert bool(got) == note
    if note:
        assert "4 rows instead of the 2 as written" in got
