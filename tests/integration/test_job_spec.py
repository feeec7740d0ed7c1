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
    return seen["specs"], seen["prep"].plan


@pytest.mark.parametrize("threads", ["null", "1", "3"])
def test_worker_threads_equal_planned_threads(monkeypatch, tmp_path, tiny_model, threads):
    """The plan's step time and the card processes use one thread count (runtime.threads or the host rule)."""
    from npu_train.planner import threads_per_card

    specs, plan = _specs_and_plan(monkeypatch, tmp_path, tiny_model, f"runtime.threads={threads}")
    expected = threads_per_card(None if threads == "null" else int(threads), len(specs))
    assert plan.threads == expected
    assert [s.runtime.threads for s in specs] == [expected] * len(specs)


def test_worker_spec_is_frozen_and_typed(monkeypatch, tmp_path, tiny_model):
    # one chunk per card (train.schedule=auto may choose the two-chunk zbv here, whose head is on card 0)
    specs, plan = _specs_and_plan(monkeypatch, tmp_path, tiny_model, "backend=[cpu,cpu,cpu]", "train.schedule=1f1b")
    assert [s.rank for s in specs] == [0, 1, 2] and all(s.world_size == 3 for s in specs)
    assert [(s.stage.first, s.stage.last) for s in specs] == [(st.first_layer, st.last_layer) for st in plan.stages]
    assert specs[0].stage.has_embed and specs[-1].stage.has_head
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs[0].rank = 5
    assert specs[0].token not in repr(specs[0])


@pytest.mark.parametrize("where", ["packed data", "coordinator"])
def test_failed_launch_leaves_no_ipc_dir_or_owner_record(monkeypatch, tmp_path, tiny_model, where):
    """A launch that fails after it made the job's private IPC dir and owner record, before the
    coordinator took them over (here: the packed data does not fit, or the coordinator's set-up
    fails), removes both: nothing is left for a later sweep that may never find it (another TMPDIR)."""
    import glob
    import os
    import tempfile

    import npu_train.data.packfile as packfile
    import npu_train.runtime.job as job
    import npu_train.runtime.leftovers as leftovers
    from npu_train.data.text import DataError
    from npu_train.transport.shm import SHM_DIR

    made = []
    real_write = leftovers.write_job_owner

    def write_job_owner(job_id, ipc_dir, node=0):
        made.append((job_id, ipc_dir))
        return real_write(job_id, ipc_dir, node)

    def short(*a, **kw):
        raise DataError("the packed training data needs 1.0 MB in ... but only 0.1 MB are free")

    class Broken:
        def __init__(self, specs, **kw):
            raise RuntimeError("coordinator set-up failed")

    monkeypatch.setattr(leftovers, "write_job_owner", write_job_owner)
    if where == "packed data":  # data held in memory (not mapped from the cache) is written into the IPC dir
        real_prepare = job._prepare_data

        def in_memory(cfg, prep):
            d = real_prepare(cfg, prep)
            d.path = None
            return d

        monkeypatch.setattr(job, "_prepare_data", in_memory)
        monkeypatch.setattr(packfile, "save_packed", short)
    else:
        monkeypatch.setattr(job, "Coordinator", Broken)
    with pytest.raises(DataError if where == "packed data" else RuntimeError):
        job.run_job(make_cfg(tiny_model), str(tmp_path))
    assert len(made) == 1, made
    job_id, ipc_dir = made[0]
    assert os.path.dirname(ipc_dir) == tempfile.gettempdir()
    assert not os.path.exists(ipc_dir)
    assert not glob.glob(os.path.join(SHM_DIR, f"npt_{job_id}_*"))
