"""Reliability round 4 (issue 41): faults a new user and a cluster produce, each run as the user would, through
``launch/run.py`` as a subprocess (:mod:`launch_util`), on the tiny test model."""
from __future__ import annotations

import json
import os
import shlex

import pytest

from launch_util import Job, edit_model_copy
from npu_train.errors import error_lines

pytestmark = pytest.mark.timeout(300)


def _status(job: Job) -> dict:
    with open(os.path.join(job.run_dir, "status.json")) as f:
        return json.load(f)


def test_resume_command_runs_as_printed_from_a_dir_with_a_space_and_an_apostrophe(tiny_model, tmp_path):
    """Fault 20: the run dir ``.../Bob's run/out``; the ``resume`` command of ``status.json`` (shell- and
    Hydra-quoted) runs as printed and continues the run (it failed in Hydra's parser:
    ``LexerNoViableAltException``)."""
    name = "Bob's run"
    first = Job(tmp_path, tiny_model, "train.steps=2", "train.stop_after=1", name=name)
    assert first.finish(240) == 0, first.tail()
    resume = _status(first)["resume"]
    assert resume and f"{name}/out/checkpoints" in shlex.split(resume)[-1], resume
    again = Job(tmp_path, tiny_model, name=name, argv=shlex.split(resume))
    rc = again.finish(240)
    assert rc == 0, again.tail()
    assert "resuming from" in again.stdout and "step_000001" in again.stdout, again.tail()
    assert _status(again)["status"] == "ok"


def test_lora_base_relative_replaced_and_moved(tmp_path):
    """Faults 3, 4 and 19 on one LoRA run of a base given as a relative ``model.path``:

    4: the checkpoint records the base's absolute path; 3: the base's weights replaced by others of the same
    shapes: ``train.resume=latest`` and the export are refused (they resumed / merged silently); 19: the base
    moved: the export names the recorded base and ``--base``, which finds it; nothing is written by a refusal."""
    import shutil

    from conftest import make_tiny_model
    from launch_util import REPO
    from npu_train.checkpoint.export import main as export_main
    from npu_train.checkpoint.store import complete_checkpoints, CheckpointReader

    base = make_tiny_model(str(tmp_path / "base"))
    orig = str(tmp_path / "orig")
    shutil.copytree(base, orig)
    rel = os.path.relpath(base, REPO)  # the launcher runs in REPO
    lora = ["train.mode=lora", "lora.rank=4", "lora.alpha=8", "train.steps=2", "train.stop_after=1"]
    first = Job(tmp_path, rel, *lora, name="lora")
    assert first.finish(240) == 0, first.tail()
    ck = complete_checkpoints(os.path.join(first.run_dir, "checkpoints"))[-1]
    assert CheckpointReader(ck).manifest["model_path"] == base  # fault 4: absolute

    make_tiny_model(base, seed=1)  # fault 3: same shapes, other weights
    again = Job(tmp_path, rel, *lora, "train.resume=latest", name="lora")
    rc = again.finish(240)
    assert rc == 2, again.tail()
    (line,) = again.error_lines()
    assert "differ from those the checkpoint's LoRA adapters were trained on" in line \
        and "train.resume_mismatch=allow" in line, line
    out = str(tmp_path / "hf")
    assert export_main([ck, out]) == 2 and not os.path.exists(out)

    shutil.rmtree(base)  # fault 19: the base moved
    moved = str(tmp_path / "moved")
    shutil.move(orig, moved)
    assert export_main([ck, out]) == 2 and not os.path.exists(out)
    assert export_main([ck, out, "--base", base + "-nowhere"]) == 2 and not os.path.exists(out)
    assert export_main([ck, out, "--base", moved]) == 0
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == moved


def test_lora_base_moved_message(tmp_path, capsys):
    """Fault 19's message: the recorded base, that it does not exist any more, and ``--base``."""
    from npu_train.checkpoint.export import main as export_main

    ck = tmp_path / "ck" / "step_000001"
    ck.mkdir(parents=True)
    from npu_train.model.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True)
    (ck / "manifest.json").write_text(json.dumps({
        "step": 1, "format": 1, "model": cfg.to_dict(), "index": {}, "model_path": "/gone/base",
        "tokenizer_path": "/gone/base", "train": {"mode": "lora", "lora_rank": 4, "lora_alpha": 8.0,
                                                  "lora_dropout": 0.0, "lora_targets": ["q_proj"]}}))
    assert export_main([str(ck), str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the refusal as one line (printed folded at words)
    assert "LoRA checkpoint of the base model at /gone/base (its run's model.path), which does not exist" in err
    assert "--base" in err and not (tmp_path / "out").exists()


def test_tied_config_with_a_distinct_head_in_the_file_keeps_the_files_head(tiny_model, tmp_path, capsys):
    """Fault 5: ``tie_word_embeddings=true`` beside an ``lm_head.weight`` with other values than the embedding:
    as transformers 5.25 does (it keeps the file's head, untied, and warns), the model is untied and reads the file's
    head, with one note; a head equal to the embedding stays tied, without a note."""
    import torch

    from npu_train.model import load_config, load_tensors
    from npu_train.model import weights

    _NOTED = getattr(weights, "_NOTED", set())  # notes printed once per process

    g = torch.Generator().manual_seed(3)
    head = {}

    def add_head(t, same=False):
        head["w"] = t["model.embed_tokens.weight"].clone() if same else \
            0.05 * torch.randn(t["model.embed_tokens.weight"].shape, generator=g)
        t["lm_head.weight"] = head["w"]

    d = edit_model_copy(tiny_model, str(tmp_path / "distinct"), edit_tensors=add_head)
    _NOTED.clear()
    cfg = load_config(d)
    assert cfg.tie_word_embeddings is False
    got = load_tensors(d, cfg, ["lm_head.weight"])["lm_head.weight"]
    assert torch.equal(got, head["w"].float())
    err = capsys.readouterr().err
    assert "sets tie_word_embeddings=true, but the weights hold their own lm_head.weight" in err and \
        "as transformers does" in err
    same = edit_model_copy(tiny_model, str(tmp_path / "same"), edit_tensors=lambda t: add_head(t, same=True))
    assert load_config(same).tie_word_embeddings is True
    assert "tie_word_embeddings" not in capsys.readouterr().err


def test_config_with_fewer_layers_than_the_weights_warns(tiny_model, tmp_path, capsys):
    """Fault 6: config.json says 4 layers, the weights hold 6: a warning naming the unused layers 4-5 and the
    fix (it trained the 4-layer model without a word); the complete model warns nothing."""
    from npu_train.model import check_weights, load_config
    from npu_train.model import weights

    _NOTED = getattr(weights, "_NOTED", set())  # notes printed once per process

    d = edit_model_copy(tiny_model, str(tmp_path / "fewer"), edit_cfg=lambda c: c.update(num_hidden_layers=4))
    _NOTED.clear()
    check_weights(d, load_config(d))
    err = capsys.readouterr().err
    assert "holds weights of 6 decoder layers but" in err and "num_hidden_layers=4: layers 4-5 are not used" in err
    assert "set num_hidden_layers=6" in err
    check_weights(tiny_model, load_config(tiny_model))
    assert "decoder layers" not in capsys.readouterr().err


def test_resume_after_a_file_was_added_to_the_data_dir(tiny_model, tmp_path):
    """Fault 16: a file added to a ``data.source`` directory before a resume: the refusal names the new file and
    ``train.resume_mismatch=allow`` (it said "layout differs ... resume with the same data.source", which it was);
    with ``allow`` the run continues on the data as it is now."""
    from npu_train.data.text import botchan_text

    text = botchan_text()
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text(text[:30000])
    args = [f"data.source={data}", "train.steps=3", "train.stop_after=1"]
    first = Job(tmp_path, tiny_model, *args, name="data")
    assert first.finish(240) == 0, first.tail()
    (data / "extra.txt").write_text(text[30000:60000])
    refused = Job(tmp_path, tiny_model, *args, "train.resume=latest", name="data")
    rc = refused.finish(240)
    assert rc == 2, refused.tail()
    (line,) = refused.error_lines()
    assert f"data.source={data} changed since" in line and "new file(s) extra.txt" in line, line
    assert "train.resume_mismatch=allow" in line, line
    allowed = Job(tmp_path, tiny_model, *args, "train.resume=latest", "train.resume_mismatch=allow", name="data")
    rc = allowed.finish(240)
    assert rc == 0, allowed.tail()
    assert "resuming onto changed data" in allowed.stdout and "new file(s) extra.txt" in allowed.stdout


def test_export_of_a_checkpoint_rotated_away_mid_read(tiny_model, tmp_path, monkeypatch, capsys):
    """Fault 18: the live job's rotation deletes the checkpoint being exported (simulated: the checkpoint dir is
    removed after two tensors were read, as ``finalize``'s ``shutil.rmtree`` does): the error says it was rotated
    away and names the newest kept checkpoint; no partial file or output directory stays (a 97 MB partial
    ``model.safetensors`` stayed, and the message said "truncated or corrupt; use step_000003")."""
    import shutil

    from conftest import run_pipeline
    from npu_train.checkpoint import store
    from npu_train.checkpoint.export import main as export_main

    run = str(tmp_path / "run")
    run_pipeline(tiny_model, run, "train.steps=3", "train.save_every=1", "checkpoint.keep=0")
    root = os.path.join(run, "checkpoints")
    old = os.path.join(root, "step_000001")
    real_get, calls = store.CheckpointReader.get, []

    def get(self, key):
        calls.append(key)
        if len(calls) == 3:
            shutil.rmtree(self.path)  # the rotation
        return real_get(self, key)

    monkeypatch.setattr(store.CheckpointReader, "get", get)
    out = str(tmp_path / "hf")
    assert export_main([old, out]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the refusal as one line (printed folded at words)
    assert "was deleted while it was being read" in err and "rotated away" in err, err
    assert os.path.join(root, "step_000003") in err and "truncated" not in err, err
    assert not os.path.exists(out)
    os.makedirs(out)  # an existing (empty) output directory stays, emptied of the partial export
    calls.clear()
    assert export_main([os.path.join(root, "step_000002"), out]) == 2
    assert os.listdir(out) == []


def test_address_space_limit_below_the_plan_is_refused(tiny_model, tmp_path):
    """Fault 14: ``ulimit -v`` (RLIMIT_AS, inherited by the card processes) below what a card needs: one error
    line naming the limit, the card, what it needs and the fix, exit 2, before any card process starts (the plan
    said "fits", then ``DefaultCPUAllocator: can't allocate memory``). The tiny job's cards plan 0.36 GiB each;
    under 0.80 GiB they failed in their model load (exit 1), the launcher got as far as starting them."""
    limit = int(0.80 * 2**30)
    job = Job(tmp_path, tiny_model, "train.steps=2", prefix=["prlimit", f"--as={limit}"])
    rc = job.finish(240)
    assert rc == 2, job.tail()
    (line,) = job.error_lines()
    assert "address-space limit of this shell (ulimit -v, RLIMIT_AS) is 0.80 GiB per process" in line, line
    assert "ulimit -v unlimited" in line and not os.path.exists(os.path.join(job.run_dir, "job.json"))


def test_address_space_check_from_the_plan():
    """The check's arithmetic: planned host memory + the reserved address space against the limit."""
    from types import SimpleNamespace

    from npu_train.errors import ConfigError
    from npu_train.hardware import ADDRESS_SPACE_OVERHEAD_BYTES as O
    from npu_train.runtime.job import check_address_space

    g = 2 ** 30
    card = SimpleNamespace(kind="cpu", name="cpu:1")
    plan = SimpleNamespace(stages=[SimpleNamespace(mem={"total": 1 * g}, host_bytes=0, card=card),
                                   SimpleNamespace(mem={"total": 2 * g}, host_bytes=0, card=card)])
    check_address_space(plan, 2 * g + O)  # exactly fits
    with pytest.raises(ConfigError, match="card cpu:1 is planned to use 2.00 GiB"):
        check_address_space(plan, 2 * g + O - 1)


def _no_leftovers(job: Job, info: dict) -> None:
    """No shm segment, IPC dir or checkpoint staging dir of the job stays."""
    from launch_util import job_segments

    assert job_segments(info["job_id"]) == []
    assert not os.path.exists(info["ipc_dir"])
    root = info["ckpt_root"]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")] if os.path.isdir(root) else True


def test_sigterm_to_one_card_stops_the_job_with_a_checkpoint(tiny_model, tmp_path):
    """Fault 8: SIGTERM to one card process (was ignored silently; the run went on): the job stops as for SIGTERM to
    the launcher: a note naming the card, the current step finished and checkpointed, exit 143, status.json
    ``interrupted`` with the checkpoint and the resume command, nothing left behind."""
    import signal

    job = Job(tmp_path, tiny_model, "train.steps=400")
    try:
        info = job.job_info()
        job.wait_steps(1)
        os.kill(job.card_pids(info)[1], signal.SIGTERM)
        rc = job.wait(240)
    finally:
        job.kill_all()
    assert rc == 143, job.tail()
    assert "received SIGTERM: stopping the job as for a SIGTERM to the launcher" in job.stderr, job.tail()
    st = _status(job)
    assert st["status"] == "interrupted" and st["checkpoint"] and st["resume"], st
    assert os.path.isfile(os.path.join(st["checkpoint"], "manifest.json"))
    assert len(job.losses()) < 400
    _no_leftovers(job, info)


def test_sighup_to_the_process_group_is_handled_as_sigterm(tiny_model, tmp_path):
    """Fault 9: SIGHUP to the launcher and every card at once (a terminal or ssh session closed without tmux) killed
    every process with no message, no status.json, the step lost and shm segments and a staging dir left: now the
    job finishes the step, checkpoints and exits 129 with status.json ``interrupted``, leaving nothing behind."""
    import signal

    job = Job(tmp_path, tiny_model, "train.steps=400")
    try:
        info = job.job_info()
        job.wait_steps(1)
        os.killpg(job.proc.pid, signal.SIGHUP)  # the launcher leads its own process group (start_new_session)
        rc = job.wait(240)
    finally:
        job.kill_all()
    assert rc == 129, job.tail()
    assert "interrupted by SIGHUP" in job.stderr, job.tail()
    st = _status(job)
    assert st["status"] == "interrupted" and st["checkpoint"] and st["resume"], st
    _no_leftovers(job, info)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (needs root's mount; skipped elsewhere) to fill; unmounted afterwards."""
    import subprocess

    d = tmp_path / "small_disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(d) -> None:
    """Write zeros into ``d`` until its file system is full."""
    import errno

    with open(os.path.join(d, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_run_dir_full_mid_run_keeps_training_and_checkpointing(tiny_model, tmp_path, small_disk):
    """Faults 10-11, mid-run: the disk under ``hydra.run.dir`` fills after the first step, checkpoints go elsewhere.
    Training goes on to its last checkpoint with one warning for the records (it died with three chained
    ``OSError: [Errno 28]`` tracebacks, no status.json, and a ``job.json.part`` left); the missing status.json is one
    line naming the directory; no partial file stays."""
    import subprocess
    import sys
    import time

    from launch_util import BASE, LAUNCH, REPO
    from npu_train.config import hydra_value

    run_dir, ckpt = small_disk / "run", tmp_path / "ckpt"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [sys.executable, LAUNCH, f"model.path={tiny_model}", "backend=cpu,cpu", *BASE, "train.steps=40",
           "train.save_every=10", f"checkpoint.dir={ckpt}", f"hydra.run.dir={hydra_value(str(run_dir))}"]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=REPO, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.05)
        _fill(small_disk)
        rc = proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    stderr = err.read_text()
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr[-3000:]
    stdout = out.read_text()
    flat = " ".join(stdout.split())  # the launcher folds stdout lines at 100 columns
    assert "warning: cannot write metrics.jsonl" in flat and f"in {run_dir}" in flat and \
        "training and its checkpoints go on" in flat, stdout[-3000:]
    assert "figures not fitted" not in stderr, stderr[-3000:]  # metrics.jsonl holds whole lines only
    assert (ckpt / "step_000040" / "manifest.json").exists()
    assert f"cannot write {run_dir}/status.json" in stderr, stderr[-3000:]
    assert not [n for n in os.listdir(run_dir) if n.endswith(".part")], os.listdir(run_dir)


def test_run_dir_full_at_the_start_is_one_error_line(tiny_model, tmp_path, small_disk):
    """Faults 10-11, at the start: the disk under ``hydra.run.dir`` has room for Hydra's own files but not for the
    plan: one error line naming the directory and what to do (it gave Hydra's "Error executing job" and chained
    ``OSError: [Errno 28]`` tracebacks with no path), exit 1, no partial file, no shm segment or IPC dir left."""
    import glob
    import subprocess
    import sys

    from launch_util import BASE, LAUNCH, REPO
    from npu_train.config import hydra_value

    _fill(small_disk)
    os.remove(small_disk / "filler")
    with open(small_disk / "filler", "wb") as f:  # leave 16 KiB: Hydra's .hydra/*.yaml fit, plan.txt does not
        f.write(b"\0" * (4 * 2**20 - 16 * 2**10))
    run_dir = small_disk / "run"
    cmd = [sys.executable, LAUNCH, f"model.path={tiny_model}", "backend=cpu,cpu", *BASE, "train.steps=2",
           f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={hydra_value(str(run_dir))}"]
    before = set(glob.glob("/dev/shm/npt_*"))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = p.communicate(timeout=300)
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "no space left on device" in lines[0] and f"hydra.run.dir={run_dir}" in lines[0] \
        and "set hydra.run.dir to a directory on a larger disk" in lines[0], r.stderr[-3000:]
    left = os.listdir(run_dir)
    assert not [n for n in left if n.endswith(".part")] and "plan.txt" not in left and "job.json" not in left, left
    assert not _own_segments(set(glob.glob("/dev/shm/npt_*")) - before, p.pid)


def test_pausing_the_whole_job_does_not_kill_it(tiny_model, tmp_path):
    """Fault 1: SIGSTOP of the launcher and every card (the whole process group: Ctrl-Z, docker pause, a suspended
    VM) for twice ``runtime.heartbeat_timeout_s``, then SIGCONT: the job goes on to its last step (it failed 0.1 s
    after SIGCONT with "no heartbeat for 90 s" though every process was healthy). The launcher tells "my peers are
    silent" from "I was not running" by the gap in its own supervision loop."""
    import signal
    import time

    job = Job(tmp_path, tiny_model, "train.steps=30", "runtime.heartbeat_timeout_s=4")
    try:
        job.job_info()
        job.wait_steps(2)
        os.killpg(job.proc.pid, signal.SIGSTOP)
        time.sleep(9)
        os.killpg(job.proc.pid, signal.SIGCONT)
        rc = job.wait(240)
    finally:
        job.kill_all()
    assert rc == 0, job.tail()
    assert len(job.losses()) == 30 and "did not run for" in job.stdout, job.tail()


def test_a_card_stopped_alone_is_still_reported(tiny_model, tmp_path):
    """The pause rule forgives only the launcher's own gaps: one card SIGSTOPped while the launcher runs is still
    reported after ``runtime.heartbeat_timeout_s`` (exit 1, "stopped responding")."""
    import signal

    job = Job(tmp_path, tiny_model, "train.steps=400", "runtime.heartbeat_timeout_s=4")
    try:
        info = job.job_info()
        job.wait_steps(2)
        os.kill(job.card_pids(info)[1], signal.SIGSTOP)
        rc = job.wait(240)
    finally:
        job.kill_all()
    assert rc == 1 and "stopped responding: no heartbeat for" in " ".join(job.error_lines()), job.tail()


def test_a_second_sweep_into_a_live_sweeps_dir_is_refused_before_it_writes(tiny_model, tmp_path):
    """Fault 2: two sweeps into one ``hydra.sweep.dir``: the second is refused at once (exit 2, one line naming the
    live sweep) and writes nothing, so the first's ``.hydra/overrides.yaml`` keep its ``lr`` and its summary says
    what its jobs ran (the refused launches rewrote the other's overrides; summary.md / .csv showed the wrong lr
    beside both runs, and the second sweep exited 0 though its job never ran)."""
    import subprocess
    import sys
    import time

    import yaml

    from launch_util import BASE, LAUNCH, REPO

    sweep_dir = str(tmp_path / "sweep")

    def cmd(lrs):
        return [sys.executable, LAUNCH, "-m", f"model.path={tiny_model}", *BASE, "train.steps=25",
                f"train.lr={lrs}", "hydra.launcher.n_jobs=1", f"hydra.sweep.dir={sweep_dir}"]

    a = subprocess.Popen(cmd("0.001,0.002"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        metrics = os.path.join(sweep_dir, "0", "metrics.jsonl")
        while time.monotonic() < deadline and a.poll() is None and not os.path.exists(metrics):
            time.sleep(0.1)
        assert a.poll() is None, a.communicate()
        listing = sorted(os.listdir(sweep_dir))
        b = subprocess.run(cmd("0.005,0.006"), capture_output=True, text=True, cwd=REPO, timeout=120)
        assert sorted(os.listdir(sweep_dir)) == listing
        out_a, err_a = a.communicate(timeout=400)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, 9)
    assert b.returncode == 2, b.stderr[-3000:]
    lines = error_lines(b.stderr)
    assert len(lines) == 1 and f"hydra.sweep.dir={sweep_dir} is in use by job sweep (pid {a.pid}" in lines[0], b.stderr
    assert a.returncode == 0, err_a[-3000:]
    for num, lr in ((0, "0.001"), (1, "0.002")):
        with open(os.path.join(sweep_dir, str(num), ".hydra", "overrides.yaml")) as f:
            assert f"train.lr={lr}" in yaml.safe_load(f)
    with open(os.path.join(sweep_dir, "summary.csv")) as f:
        text = f.read()
    assert "train.lr=0.001" in text and "train.lr=0.002" in text and "0.005" not in text
    assert not os.path.exists(os.path.join(sweep_dir, ".npt-sweep.lock"))


def test_sweep_summary_takes_each_jobs_own_record(tmp_path):
    """The summary's overrides come from each job's ``status.json`` (what it ran), not from ``.hydra/`` (which a
    later launch into the job's directory rewrites)."""
    import yaml

    from npu_train.metrics.sweep import collect

    d = tmp_path / "sweep" / "0"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["train.lr=5e-3"]))  # rewritten by a refused launch
    (d / "status.json").write_text(json.dumps({"exit_code": 0, "status": "ok", "error": "",
                                               "overrides": ["train.lr=1e-3"]}))
    (row,) = collect(str(tmp_path / "sweep"))
    assert row["overrides"] == ["train.lr=1e-3"]



def _own_segments(new: set, pid: int) -> list:
    """Of the segments ``new`` (``/dev/shm/npt_<job>_...`` paths that appeared during a launch), those of a job
    launched by process ``pid``: its owner record names ``pid``, or it has none while its segments stay (other
    jobs running beside, e.g. a second suite, keep their owner record as long as their segments exist)."""
    import time

    def owner_pid(path: str):
        job = os.path.basename(path)[len("npt_"):].split("_", 1)[0]
        try:
            with open(f"/dev/shm/npt_{job}_owner") as f:
                return json.load(f).get("pid")
        except (OSError, ValueError):
            return None

    suspects = [n for n in new if owner_pid(n) in (pid, None)]
    if suspects:
        time.sleep(1.0)  # a job beside may be between removing its owner record and its last segments
    return [n for n in suspects if os.path.exists(n) and owner_pid(n) in (pid, None)]
