"""The default run and sweep directories (``conf/config.yaml``) are unique per launch: two launches started in
the same second used to share ``outputs/<date>/<H-M-S>``, where Hydra rewrote the first launch's ``.hydra/``
with the second's overrides before the run-dir lock refused the second (review of 2026-12-03)."""
from __future__ import annotations

import datetime as dt
import os

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _dirs_at(monkeypatch, when: dt.datetime, mode) -> tuple[str, str]:
    """``(hydra.run.dir, hydra.sweep.dir)`` of a launch whose clock reads ``when`` (Hydra's ``now`` resolver)."""
    import hydra.core.utils as hydra_utils
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from npu_train.config import register

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return when

    monkeypatch.setattr(hydra_utils, "datetime", Frozen)
    register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None):
        hydra_utils.setup_globals()  # the `now` resolver, as the launcher registers it
        cfg = GlobalHydra.instance().config_loader().load_configuration("config", [], run_mode=mode)
        return str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)


@pytest.mark.parametrize("multirun", [False, True])
def test_launches_in_the_same_second_get_their_own_directories(monkeypatch, multirun):
    from hydra.types import RunMode

    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    first = _dirs_at(monkeypatch, dt.datetime(2026, 12, 3, 10, 0, 0, 120000), mode)
    second = _dirs_at(monkeypatch, dt.datetime(2026, 12, 3, 10, 0, 0, 870000), mode)
    assert first[0] != second[0] and first[1] != second[1]
    # still <date>/<time>, readable: the second's digits, then the fraction
    assert first[0] == "outputs/2026-12-03/10-00-00.120000"
    assert first[1] == "multirun/2026-12-03/10-00-00.120000"


def test_directory_names_sort_by_start_time(monkeypatch):
    from hydra.types import RunMode

    times = [dt.datetime(2026, 12, 3, 9, 59, 59, 999999), dt.datetime(2026, 12, 3, 10, 0, 0, 5),
             dt.datetime(2026, 12, 3, 10, 0, 0, 40), dt.datetime(2026, 12, 3, 10, 0, 1)]
    names = [_dirs_at(monkeypatch, t, RunMode.RUN)[0] for t in times]
    assert sorted(names) == names and len(set(names)) == len(names)
