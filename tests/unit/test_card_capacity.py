"""A node's cpu cards split the host RAM left after the launcher's reserve; an explicit capacity above
that share is refused (runtime.job.card_specs)."""
from __future__ import annotations

import psutil
import pytest
from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.errors import ConfigError
from npu_train.hardware import Card
from npu_train.runtime.job import card_specs

RESERVE = 512 * 2**20  # written here, not imported: the launcher's measured peak rounded up


def _cfg(*overrides):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(overrides)))


def test_cpu_cards_share_ram_after_the_launcher():
    total = psutil.virtual_memory().total
    cards = card_specs([Card("cpu", None, 0), Card("cpu", None, 0)], _cfg())
    assert [c.capacity_bytes for c in cards] == [(total - RESERVE) // 2] * 2
    assert [c.name for c in cards] == ["cpu:0", "cpu:1"]


def test_capacity_above_the_share_is_refused():
    share = (psutil.virtual_memory().total - RESERVE) // 2
    ok = card_specs([Card("cpu", None, 0)] * 2, _cfg(f"placement.capacity_gib={share / 2**30 * 0.99}"))
    assert ok[0].capacity_bytes <= share
    with pytest.raises(ConfigError, match="- 0.5 GiB for the launcher"):
        card_specs([Card("cpu", None, 0)] * 2, _cfg(f"placement.capacity_gib={share / 2**30 * 1.01}"))
