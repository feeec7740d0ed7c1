"""Resume safety (issue 12), pure units: settings/data comparison, write-order ``latest``, rotation that
keeps the newest finite checkpoint, staging directories and shm/IPC leftovers removed only for dead
owners, and run directories never appended to."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from npu_train.checkpoint.store import (CheckpointError, CheckpointReader, complete_checkpoints, finalize,
                                        find_checkpoint, remove_stale_staging, save_shard, tmp_dir)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _save(root, step, *, finite=True, job="j1", base=None):
    st = tmp_dir(root, step, job)
    save_shard(st, 0, {"master.w": torch.full((2,), float(step))}, {"rank": 0, "finite": finite})
    return finalize(root, st, step, dict(base or {}), keep=0)


TRAIN = {"steps": 10, "lr": 1e-3, "warmup_steps": 2, "min_lr_ratio": 0.1, "seed": 1}


def test_resume_refuses_changed_settings_and_data(tmp_path):
    root = str(tmp_path)
    path = _save(root, 4, base={"train": TRAIN, "data_fingerprint": "abc"})
    r = CheckpointReader(path)
    assert r.check_run(dict(TRAIN, seed=2), "abc") == []  # other keys (seed here) are not compared
    for key, val in (("steps", 20), ("lr", 2e-3), ("warmup_steps", 0), ("min_lr_ratio", 0.0)):
        with pytest.raises(CheckpointError, match=rf"train\.{key}: checkpoint .* now .*train\.resume_mismatch=allow"):
            r.check_run(dict(TRAIN, **{key: val}), "abc")
    with pytest.raises(CheckpointError, match=r"data fingerprint does not match.*train\.resume_mismatch=allow"):
        r.check_run(TRAIN, "other")
    assert len(r.check_run(dict(TRAIN, lr=2e-3), "other", allow=True)) == 2


LORA_TRAIN = dict(TRAIN, mode="lora", lora_rank=8, lora_alpha=16.0, lora_dropout=0.0,
                  lora_targets=["q_proj", "k_proj", "v_proj"])


def test_resume_refuses_another_mode_or_adapter_shape(tmp_path):
    """train.mode, lora.rank and lora.targets decide which tensors a checkpoint holds: no
    train.resume_mismatch continues another; lora.alpha/dropout are settings (refused unless allowed)."""
    r = CheckpointReader(_save(str(tmp_path / "l"), 4, base={"train": LORA_TRAIN}))
    r.check_mode("lora", 8, ["v_proj", "q_proj", "k_proj"])  # same set, any order
    with pytest.raises(CheckpointError, match=r"train\.mode=lora run's state but this run is train\.mode=full: "
                                              r"resume with train\.mode=lora lora\.rank=8 lora\.targets=\[q_proj,k_proj,v_proj\]"):
        r.check_mode("full", 8, [])
    with pytest.raises(CheckpointError, match=r"lora\.targets: checkpoint \[q_proj,k_proj,v_proj\], now \[q_proj,v_proj\]"):
        r.check_mode("lora", 8, ["q_proj", "v_proj"])  # narrower: would drop the k_proj adapters
    with pytest.raises(CheckpointError, match=r"lora\.rank: checkpoint 8, now 4"):
        r.check_mode("lora", 4, ["q_proj", "k_proj", "v_proj"])
    assert r.check_run(TRAIN, None, lora={"alpha": 16, "dropout": 0.0}) == []
    with pytest.raises(CheckpointError, match=r"lora\.alpha: checkpoint 16\.0, now 64.*train\.resume_mismatch=allow"):
        r.check_run(TRAIN, None, lora={"alpha": 64, "dropout": 0.0})
    assert r.check_run(TRAIN, None, allow=True, lora={"alpha": 64, "dropout": 0.1}) == [
        "lora.alpha: checkpoint 16.0, now 64", "lora.dropout: checkpoint 0.0, now 0.1"]
    full = CheckpointReader(_save(str(tmp_path / "f"), 4, base={"train": dict(TRAIN, mode="full")}))
    full.check_mode("full", 4, ["q_proj"])  # lora.* are not a full run's concern
    with pytest.raises(CheckpointError, match=r"train\.mode=full run's state but this run is train\.mode=lora"):
        full.check_mode("lora", 8, ["q_proj"])
    CheckpointReader(_save(str(tmp_path / "old"), 4, base={"train": TRAIN})).check_mode("lora", 8, ["q_proj"])


def test_damaged_checkpoint_is_named_with_the_earlier_one(tmp_path):
    """A truncated or missing shard, an unreadable manifest or a manifest whose step is not its
    directory's is refused in the launcher (before any card process), naming the file and the
    checkpoint before it; train.resume=auto (a restarting pod) skips to the newest one that reads."""
    from npu_train.checkpoint.store import open_resume_checkpoint

    root = str(tmp_path)
    first = _save(root, 2)
    last = _save(root, 4)
    CheckpointReader(last).verify()
    shard = os.path.join(last, "stage_000.safetensors")
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) - 4])  # the last bytes of the tensor data
    with pytest.raises(CheckpointError) as e:
        open_resume_checkpoint(last, root)
    msg = str(e.value)
    assert shard in msg and "damaged" in msg and f"train.resume={first}" in msg and "\n" not in msg, msg
    assert open_resume_checkpoint(last, root, auto=True).path == first
    os.remove(shard)
    with pytest.raises(CheckpointError, match=r"shard .*stage_000\.safetensors is missing; use an earlier checkpoint, e\.g\. .*step_000002 \(to resume from it: train\.resume="):
        CheckpointReader(last).verify()
    man = os.path.join(first, "manifest.json")
    text = open(man).read()
    with open(man, "w") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"step_000002/manifest\.json: not a readable checkpoint manifest \(JSONDecodeError"):
        CheckpointReader(first)
    with pytest.raises(CheckpointError, match=r"there is no other checkpoint in|use an earlier checkpoint"):
        open_resume_checkpoint(last, root, auto=True)  # neither reads
    with open(man, "w") as f:
        f.write(text.replace('"step": 2', '"step": 3'))
    with pytest.raises(CheckpointError, match=r"its manifest says step 3, its directory name step 2"):
        CheckpointReader(first)


def test_latest_is_last_written_not_highest_step(tmp_path):
    root = str(tmp_path)
    _save(root, 10)
    _save(root, 2)  # a fresh run writing into the same root
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_000010", "step_000002"]
    assert os.path.basename(find_checkpoint("latest", root)) == "step_000002"
    st = tmp_dir(root, 4, "j2")
    save_shard(st, 0, {"master.w": torch.zeros(2)}, {"rank": 0})
    finalize(root, st, 4, {}, keep=1)  # rotation follows write order too
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_000004"]


def test_rotation_never_deletes_newest_finite_checkpoint(tmp_path):
    root = str(tmp_path)
    _save(root, 2)
    _save(root, 4, finite=False)
    st = tmp_dir(root, 6, "j1")
    save_shard(st, 0, {"master.w": torch.full((2,), float("nan"))}, {"rank": 0, "finite": False})
    finalize(root, st, 6, {}, keep=1)
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_000002", "step_000006"]
    assert CheckpointReader(os.path.join(root, "step_000002")).manifest["finite"] is True
    assert CheckpointReader(os.path.join(root, "step_000006")).manifest["finite"] is False


def test_staging_of_live_job_is_kept(tmp_path):
    root = str(tmp_path)
    live = tmp_dir(root, 2, "live1")                             # owner: this (live) process
    dead = tmp_dir(root, 2, "dead1", owner_pid=_dead_pid())      # owner gone: a crashed job
    legacy = os.path.join(root, ".tmp-step_000002-old1")         # no owner record (older version)
    os.makedirs(legacy)
    with open(os.path.join(live, "owner.json")) as f:
        assert json.load(f)["pid"] == os.getpid()
    removed = remove_stale_staging(root)
    assert sorted(removed) == sorted([dead, legacy])
    assert os.path.isdir(live) and not os.path.exists(dead) and not os.path.exists(legacy)
    other_host = tmp_dir(root, 4, "far1")
    with open(os.path.join(other_host, "owner.json"), "w") as f:
        json.dump({"pid": _dead_pid(), "start": 0.0, "host": "some-other-host"}, f)
    remove_stale_staging(root)
    assert os.path.isdir(other_host)  # cannot tell from here: kept


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_sweep_removes_only_dead_jobs_leftovers(tmp_path, monkeypatch):
    import tempfile

    from npu_train.runtime import leftovers
    from npu_train.transport.shm import segment_names_for_job

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    jobs = {}
    for name in ("deadjob1", "livejob1"):
        ipc = tempfile.mkdtemp(prefix=f"npt-{name}-")
        with open(f"/dev/shm/npt_{name}_act0", "wb") as f:
            f.write(b"x")
        leftovers.write_job_owner(name, ipc)
        jobs[name] = ipc
    try:
        with open(leftovers.owner_path("deadjob1")) as f:
            rec = json.load(f)
        rec["pid"] = _dead_pid()
        with open(leftovers.owner_path("deadjob1"), "w") as f:
            json.dump(rec, f)
        assert "deadjob1" in leftovers.sweep_dead_jobs()
        assert segment_names_for_job("deadjob1") == [] and not os.path.exists(jobs["deadjob1"])
        assert segment_names_for_job("livejob1") == ["npt_livejob1_act0", "npt_livejob1_owner"]
        assert os.path.isdir(jobs["livejob1"])
    finally:
        for name in jobs:
            for seg in segment_names_for_job(name):
                os.remove(f"/dev/shm/{seg}")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_sweep_two_nodes_of_one_job_on_one_host(tmp_path, monkeypatch):
    """Two "nodes" of one job on one host each record themselves: a dead node's IPC directory goes while
    the other runs (its segments stay); once both are dead, everything goes."""
    import tempfile

    from npu_train.runtime import leftovers
    from npu_train.transport.shm import segment_names_for_job

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    job = "twonode1"
    ipc = [tempfile.mkdtemp(prefix=f"npt-{job}-") for _ in range(2)]
    with open(f"/dev/shm/npt_{job}_act0", "wb") as f:
        f.write(b"x")
    try:
        paths = [leftovers.write_job_owner(job, ipc[k], node=k) for k in range(2)]
        assert paths[0] != paths[1] and paths[1].endswith("_owner-n1")

        def kill(k):
            with open(paths[k]) as f:
                rec = json.load(f)
            rec["pid"] = _dead_pid()
            with open(paths[k], "w") as f:
                json.dump(rec, f)

        kill(1)
        assert leftovers.sweep_dead_jobs() == []  # node 0 still runs: the job's segments stay
        assert not os.path.exists(ipc[1]) and os.path.isdir(ipc[0])
        assert segment_names_for_job(job) == [f"npt_{job}_act0", f"npt_{job}_owner"]
        kill(0)
        assert leftovers.sweep_dead_jobs() == [job]
        assert segment_names_for_job(job) == [] and not os.path.exists(ipc[0])
    finally:
        for seg in segment_names_for_job(job):
            os.remove(f"/dev/shm/{seg}")


def test_run_dir_with_metrics_is_rotated_not_appended(tmp_path):
    """A relaunch into a used run directory moves every output of the earlier launch into one previous-<k>/
    (its plan, job and status records too: they used to be overwritten, review of 2026-12-03); Hydra's
    .hydra/, the appended run.log, the run-dir lock and checkpoints/ (what a resume reads) stay."""
    from npu_train.metrics.report import rotate_previous_run

    d = str(tmp_path)
    assert rotate_previous_run(d) is None
    launch = ["card1.traceback.txt", "eval.jsonl", "job.json", "loss.png", "metrics.jsonl", "plan.json", "plan.txt",
              "status.json", "status.json.part", "summary.json", "tb", "trace.json"]
    stay = [".hydra", ".npt-run.lock", "checkpoints", "run.log"]
    for fn in launch + stay:
        if fn in ("tb", ".hydra", "checkpoints"):
            os.makedirs(os.path.join(d, fn))
        else:
            with open(os.path.join(d, fn), "w") as f:
                f.write("{}\n")
    assert rotate_previous_run(d) == os.path.join(d, "previous-1")
    assert sorted(os.listdir(os.path.join(d, "previous-1"))) == launch
    assert sorted(os.listdir(d)) == sorted(stay + ["previous-1"])
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write("{}\n")
    assert rotate_previous_run(d) == os.path.join(d, "previous-2")
    # a launch that only left its status (stopped while it prepared) is an earlier launch too
    with open(os.path.join(d, "status.json"), "w") as f:
        f.write("{}\n")
    assert rotate_previous_run(d) == os.path.join(d, "previous-3")
    assert rotate_previous_run(d) is None


def test_status_of_an_earlier_launch_is_moved_before_it_is_overwritten(tmp_path):
    """A launch that writes status.json without reaching the rotation (plan=true, stopped while preparing)
    moves the earlier launch's records aside first; a status.json that finished after this launch started
    (another node of the job sharing the directory) stays."""
    import json

    from npu_train.metrics.report import rotate_before_status

    d = str(tmp_path)
    assert rotate_before_status(d, 100.0) is None  # nothing there
    for fn, rec in (("status.json", {"exit_code": 0, "started": 10.0, "finished": 50.0}), ("plan.json", {})):
        with open(os.path.join(d, fn), "w") as f:
            json.dump(rec, f)
    assert rotate_before_status(d, 100.0) == os.path.join(d, "previous-1")
    assert sorted(os.listdir(os.path.join(d, "previous-1"))) == ["plan.json", "status.json"]
    with open(os.path.join(d, "status.json"), "w") as f:
        json.dump({"exit_code": 0, "started": 90.0, "finished": 120.0}, f)
    assert rotate_before_status(d, 100.0) is None and os.path.exists(os.path.join(d, "status.json"))
    with open(os.path.join(d, "status.json"), "w") as f:
        f.write("{torn")  # unreadable: not this launch's (its own is written atomically at its end)
    assert rotate_before_status(d, 100.0) == os.path.join(d, "previous-2")


def test_reused_checkpoint_dir_is_refused_or_set_aside(tmp_path):
    """A fresh run (or a resume from elsewhere) in a checkpoint root holding another run's checkpoints
    is refused naming both fixes; train.resume into the same root continues it; set_aside moves the
    old checkpoints (and ``latest``) to previous-<k>/ and deletes nothing."""
    from npu_train.checkpoint.store import check_reused_root, set_aside

    root = str(tmp_path / "ck")
    assert check_reused_root(root, None, "refuse") == []  # no root yet: a fresh start
    _save(root, 2)
    last = _save(root, 4)
    with pytest.raises(CheckpointError) as e:
        check_reused_root(root, None, "refuse")
    msg = str(e.value)
    assert "\n" not in msg and root in msg and "step_000004" in msg, msg
    # the resume hint is spelt as the interrupt line and status.json spell it (issue 40)
    assert "continue that run with train.resume=latest," in msg and "checkpoint.existing=set_aside" in msg, msg
    elsewhere = _save(str(tmp_path / "other"), 6)
    with pytest.raises(CheckpointError, match="checkpoint.existing=set_aside"):
        check_reused_root(root, elsewhere, "refuse")
    assert check_reused_root(root, last, "refuse") == []  # train.resume=latest/auto: the same run goes on
    assert check_reused_root(root, find_checkpoint("auto", root), "refuse") == []
    assert [os.path.basename(p) for p in check_reused_root(root, None, "set_aside")] == ["step_000002", "step_000004"]
    assert sorted(os.listdir(root)) == ["latest", "step_000002", "step_000004"]  # the check moves nothing

    for fn in ("trackers.json", "dpo_reference-0123456789abcdef.safetensors", ".npt-checkpoint.lock"):
        open(os.path.join(root, fn), "w").close()  # the run's tracker ids and DPO values; a lock file stays
    assert set_aside(root) == os.path.join(root, "previous-1")
    assert complete_checkpoints(root) == [] and find_checkpoint("auto", root) is None
    assert sorted(os.listdir(os.path.join(root, "previous-1"))) == [
        "dpo_reference-0123456789abcdef.safetensors", "latest", "step_000002", "step_000004", "trackers.json"]
    assert sorted(os.listdir(root)) == [".npt-checkpoint.lock", "previous-1"]
    assert CheckpointReader(find_checkpoint(os.path.join(root, "previous-1"), None)).step == 4  # still resumable
    _save(root, 1)
    assert set_aside(root) == os.path.join(root, "previous-2")
    assert set_aside(root) is None  # nothing left to move


def test_checkpoint_existing_takes_refuse_or_set_aside():
    from omegaconf import OmegaConf

    from npu_train.config import Config, ConfigError, validate

    cfg = OmegaConf.structured(Config)
    assert cfg.checkpoint.existing == "refuse"  # the default never moves anything
    validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["checkpoint.existing=set_aside"])))
    with pytest.raises(ConfigError, match="checkpoint.existing='overwrite': use refuse or set_aside"):
        validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["checkpoint.existing=overwrite"])))


def test_records_a_resume_continues_are_the_newest_that_trained(tmp_path):
    """A plan=true launch (or one stopped while it prepared) between a stopped run and its resume leaves a
    previous-<k> with its status only: the resume continues the metrics of the newest previous-<k> that has a
    metrics.jsonl, not that one (review of 2026-12-03: the resumed metrics.jsonl started at the resumed step)."""
    from npu_train.metrics.report import newest_records

    d = str(tmp_path)
    assert newest_records(d) is None
    for k, files in ((1, ["metrics.jsonl", "status.json"]), (2, ["metrics.jsonl"]), (3, ["status.json"]),
                     (10, ["status.json", "plan.json"])):
        os.makedirs(os.path.join(d, f"previous-{k}"))
        for fn in files:
            with open(os.path.join(d, f"previous-{k}", fn), "w") as f:
                f.write("{}\n")
    os.makedirs(os.path.join(d, "previous-x"))  # not a launch's directory
    assert newest_records(d) == os.path.join(d, "previous-2")  # 10 and 3 hold no metrics; 2 > 1 numerically


def test_another_models_checkpoint_names_its_family_and_experts(tmp_path):
    """The wrong-model refusal listed ``intermediate_size: checkpoint 6144 vs model 384`` only; a Qwen3-MoE
    checkpoint resumed on a Mixtral model also differs in family and expert count, and says so."""
    from npu_train.model.config import LlamaConfig

    def cfg(**kw):
        base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
        return LlamaConfig(**dict(base, **kw)).to_dict()

    moe = cfg(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8)
    r = CheckpointReader(_save(str(tmp_path), 4, base={"model": moe}))
    r.check_model(moe)
    with pytest.raises(CheckpointError) as e:
        r.check_model(cfg(family="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    msg = str(e.value)
    assert "family (model_type): checkpoint qwen3_moe vs model mixtral" in msg, msg
    assert "num_experts: checkpoint 8 vs model 4" in msg, msg
    dense = cfg()
    r2 = CheckpointReader(_save(str(tmp_path / "d"), 4, base={"model": {k: v for k, v in dense.items()
                                                                         if k not in ("family", "num_experts",
                                                                                      "moe_intermediate_size")}}))
    r2.check_model(dense)  # a manifest from before these keys: the same dense model still resumes
    r2.check_model(dict(dense, family="mistral"))  # same tensors, another family name: not refused


def test_a_rotated_away_checkpoint_lists_the_ones_there(tmp_path):
    """train.resume=<root>/step_000002 after checkpoint.keep=2 removed it said only "does not exist"."""
    root = str(tmp_path)
    for s in (2, 4, 6):
        st = tmp_dir(root, s, "j1")
        save_shard(st, 0, {"master.w": torch.zeros(2)}, {"rank": 0})
        finalize(root, st, s, {}, keep=2)
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(os.path.join(root, "step_000002"), root)
    msg = str(e.value)
    assert "step_000002 does not exist" in msg and f"{root} holds step_000004, step_000006" in msg, msg
    assert f"train.resume={root} for the newest" in msg, msg
