"""Slurm: hostlist expansion (Slurm's syntax, written out by hand here), the layout read from a step's
variables, and launch/slurm/npu-train.sbatch with stand-ins for srun / scontrol / the launcher: the overrides
each node gets, and a requeue exactly when the launchers stopped on SIGTERM (exit 143)."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

from npu_train.errors import ConfigError
from npu_train.runtime.nodes import NodeLayout
from npu_train.runtime.slurm import expand_hostlist, slurm_layout_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SBATCH = os.path.join(REPO, "launch", "slurm", "npu-train.sbatch")


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[08-10],cpu5", ["gpu08", "gpu09", "gpu10", "cpu5"]),
    ("a[1,3-4]b[0-1]", ["a1b0", "a1b1", "a3b0", "a3b1", "a4b0", "a4b1"]),
    ("10.77.0.[1-2]", ["10.77.0.1", "10.77.0.2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def _slurm(**kw):
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
           "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "rngd[07-09]", "PATH": "/nonexistent"}
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def test_layout_from_slurm_variables():
    lay = NodeLayout.from_env(_slurm())
    assert (lay.nnodes, lay.node_rank, lay.master_addr, lay.master_port) == (3, 2, "rngd07", 20000 + 4242)
    assert NodeLayout.from_env(_slurm(MASTER_PORT="29600", MASTER_ADDR="10.0.0.9")).master_port == 29600
    assert NodeLayout.from_env(_slurm(MASTER_ADDR="10.0.0.9")).master_addr == "10.0.0.9"
    # explicit NNODES / NODE_RANK win over Slurm's
    lay = NodeLayout.from_env(_slurm(NNODES="2", NODE_RANK="1", MASTER_ADDR="h0", MASTER_PORT="29500"))
    assert (lay.nnodes, lay.node_rank, lay.master_addr) == (2, 1, "h0")
    assert NodeLayout.from_env(_slurm(SLURM_NNODES="1", SLURM_NTASKS="1")) is None  # one node: no rendezvous
    assert slurm_layout_env({"PATH": "/x"}) is None  # not a Slurm job


def test_allocation_without_srun_is_refused_at_once():
    """Issue 41, fault 13: an sbatch/salloc shell of 2 nodes (SLURM_JOB_ID, SLURM_NNODES=2, SLURM_JOB_NODELIST, no
    SLURM_STEP_ID / SLURM_NODEID / SLURM_PROCID): refused at once naming srun (it waited 300 s, then spoke of
    NNODES / NODE_RANK); NNODES=1 trains here alone."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "rngd[07-08]", "PATH": "/nonexistent"}
    with pytest.raises(ConfigError, match=r"allocation of 2 nodes .* not started by srun .* srun --ntasks-per-node=1"):
        NodeLayout.from_env(env)
    assert NodeLayout.from_env({**env, "NNODES": "1"}) is None
    assert NodeLayout.from_env({**env, "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "2"}).node_rank == 1


def test_two_tasks_per_node_is_refused():
    with pytest.raises(ConfigError, match="one task per node"):
        NodeLayout.from_env(_slurm(SLURM_NTASKS="6"))


def _exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _sbatch(tmp_path, launcher_rc: int, *args):
    log = tmp_path / "calls.txt"
    log.write_text("")
    # srun stand-in: drop srun's own options, run the command once as node 0 of the allocation
    srun = _exe(tmp_path / "srun", "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                                   f"echo srun >> {log}\nSLURM_NODEID=0 exec \"$@\"\n")
    scontrol = _exe(tmp_path / "scontrol", f"#!/usr/bin/env bash\necho scontrol \"$@\" >> {log}\n")
    launcher = _exe(tmp_path / "python", "#!/usr/bin/env bash\n"
                                         f"for a in \"$@\"; do echo \"arg $a\" >> {log}; done\nexit {launcher_rc}\n")
    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]",
               SLURM_SUBMIT_DIR=REPO, NPT_CKPT_DIR=str(tmp_path / "shared" / "ckpt"), NPT_PYTHON=launcher,
               NPT_SRUN=srun, NPT_SCONTROL=scontrol, SLURM_RESTART_COUNT="1")
    r = subprocess.run(["bash", SBATCH, *args], env=env, capture_output=True, text=True, timeout=60)
    return r, log.read_text().splitlines()


def test_sbatch_runs_one_launcher_per_node_with_resume_auto(tmp_path):
    r, calls = _sbatch(tmp_path, 0, "backend=furiosa:auto,furiosa:auto", "train.steps=10")
    assert r.returncode == 0, r.stderr
    args = [c[4:] for c in calls if c.startswith("arg ")]
    assert args == [f"{REPO}/launch/run.py", "backend=furiosa:auto,furiosa:auto", "train.steps=10", "train.resume=auto",
                    f"checkpoint.dir={tmp_path}/shared/ckpt", f"hydra.run.dir={tmp_path}/shared/runs/job77/try1/node0"]
    assert not [c for c in calls if c.startswith("scontrol")]


def test_sbatch_requeues_after_a_sigterm_checkpoint(tmp_path):
    r, calls = _sbatch(tmp_path, 143)
    assert r.returncode == 143
    assert "scontrol requeue 77" in calls
    r, calls = _sbatch(tmp_path, 1)  # a failure is not requeued (it would fail again)
    assert r.returncode == 1 and not [c for c in calls if c.startswith("scontrol")]


def test_sbatch_without_a_checkpoint_dir_is_one_error(tmp_path):
    env = dict(os.environ, SLURM_JOB_ID="77")
    env.pop("NPT_CKPT_DIR", None)
    r = subprocess.run(["bash", SBATCH], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "NPT_CKPT_DIR is not set" in r.stderr
