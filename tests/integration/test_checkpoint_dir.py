"""A checkpoint.dir that cannot take this run's checkpoints is refused at launch (issue 28), not at the first
save after training: read-only (a read-only tmpfs mount), too small for one checkpoint, too small for the
checkpoint.keep newest beside the one being written. One error line, exit 2, nothing written. Mounting
needs root (CAP_SYS_ADMIN); elsewhere the unit tests (test_checkpoint_space.py) cover the checks."""
from __future__ import annotations

import os
import subprocess

import pytest

from launch_util import Job

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(name, size_bytes, ro)`` -> mount point; unmounted afterwards."""
    mounted = []

    def mount(name: str, size: int, ro: bool = False) -> str:
        d = str(tmp_path / "mnt" / name)
        os.makedirs(d)
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", d], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", d], capture_output=True)


def _refused(job: Job) -> str:
    try:
        rc = job.wait(120)
    finally:
        job.kill_all()
    lines = job.error_lines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in job.stderr, job.tail()
    written = set(os.listdir(job.run_dir)) if os.path.isdir(job.run_dir) else set()
    assert written <= {".hydra", "run.log"}, written
    return lines[0]


def _ckpt_bytes(model: str) -> int:
    from npu_train.checkpoint.store import checkpoint_bytes
    from npu_train.model import load_config

    return checkpoint_bytes(load_config(model), 2, "full")


def test_read_only_checkpoint_dir_is_refused_at_launch(tiny_model, tmp_path, mount_tmpfs):
    ro = mount_tmpfs("ro", 1 << 20, ro=True)
    for ck in (ro, os.path.join(ro, "run1")):  # the mount itself, a new directory under it
        line = _refused(Job(tmp_path, tiny_model, "train.steps=2", f"checkpoint.dir={ck}", name=f"job-{os.path.basename(ck)}"))
        assert (f"checkpoint.dir={ck} cannot be written ({ro}: [Errno 30] Read-only file system)" in line
                and "checkpoint.save=false" in line), line


def test_checkpoint_dir_too_small_for_one_checkpoint_is_refused(tiny_model, tmp_path, mount_tmpfs):
    size = _ckpt_bytes(tiny_model)
    ck = mount_tmpfs("small", size // 2)
    line = _refused(Job(tmp_path, tiny_model, "train.steps=2", f"checkpoint.dir={ck}"))
    assert f"free in {ck}: the first save will fail" in line and "checkpoint.low_space=warn" in line, line
    assert os.listdir(ck) == []


def test_checkpoint_dir_too_small_for_the_kept_checkpoints_is_refused(tiny_model, tmp_path, mount_tmpfs):
    size = _ckpt_bytes(tiny_model)
    ck = mount_tmpfs("keep", int(2.5 * size))  # one fits, three (keep=2 + the one being written) do not
    line = _refused(Job(tmp_path, tiny_model, "train.steps=3", "train.save_every=1", "checkpoint.keep=2",
                        f"checkpoint.dir={ck}"))
    assert "up to 3 checkpoints" in line and "checkpoint.keep=2" in line and "lower checkpoint.keep" in line, line
