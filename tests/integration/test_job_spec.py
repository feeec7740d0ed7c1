"""Job preparation builds typed worker specs whose thread count is the one the plan predicted with.

No card process is started: the coordinator is replaced by a stub that records the specs.
"""
from __future__ import annotations

import dataclasses

import pytest

from conftest import make_cfg


class _Captured(Exception):
    pass


def _specs_and_plan(monkeypatch, tmp_path, model, *overrides):
    import npu_train.runtime.job as job

    seen = {}
    real_prepare = job.prepare

    def prepare(cfg, run_dir, **kw):
        seen["prep"] = real_prepare(cfg, run_dir, **kw)
        return seen["prep"]

    class StubCoordinator:
        def __init__(self, specs, **kw):
            seen["specs"] = specs
            raise _Captured()

    monkeypatch.setattr(job, "prepare", prepare)
    monkeypatch.setattr(job, "Coordinator", StubCoordinator)
    with pytest.raises(_Captured):
        job.run_job(make_cfg(model, *overrides), str(tmp_path))
    return seen["specs"], seen["prep"]["plan"]


@pytest.mark.parametrize("threads", ["null", "1", "3"])
def test_worker_threads_equal_planned_threads(monkeypatch, tmp_path, tiny_model, threads):
    """The plan's step time and the card processes use one thread count (runtime.threads or the host rule)."""
    from npu_train.planner import threads_per_card

    specs, plan = _specs_and_plan(monkeypatch, tmp_path, tiny_model, f"runtime.threads={threads}")
    expected = threads_per_card(None if threads == "null" else int(threads), len(specs))
    assert plan.threads == expected
    assert [s.runtime.threads for s in specs] == [expected] * len(specs)


def test_worker_spec_is_frozen_and_typed(monkeypatch, tmp_path, tiny_model):
    specs, plan = _specs_and_plan(monkeypatch, tmp_path, tiny_model, "backend=[cpu,cpu,cpu]")
    assert [s.rank for s in specs] == [0, 1, 2] and all(s.world_size == 3 for s in specs)
    assert [(s.stage.first, s.stage.last) for s in specs] == [(st.first_layer, st.last_layer) for st in plan.stages]
    assert specs[0].stage.has_embed and specs[-1].stage.has_head
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs[0].rank = 5
    assert specs[0].token not in repr(specs[0])
