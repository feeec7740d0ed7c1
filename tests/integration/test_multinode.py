"""Multi-node on one machine (issue 10, part 1): two "nodes" are two launchers in two network
namespaces joined by a veth pair (10.77.0.1/24 and 10.77.0.2/24, only inside the namespaces this
test creates), rendezvousing through node 0's TCPStore on MASTER_ADDR=10.77.0.1.

- the 3-stage pipeline split over the nodes (node 0: one CPU card, node 1: two) gives the same
  per-step losses as one node with three cards (fp32, 1e-5), the boundary between the nodes runs
  over ZeroMQ TCP and the one within node 1 over shared memory, and both nodes' shards land in one
  checkpoint that a single node with two cards resumes from (resharding across node counts);
- kill -9 of a card process on node 1 brings both launchers down within the heartbeat timeout,
  both naming node 1's card, its stage and the phase, with nothing left behind.

The namespaces share the filesystem (and ``/dev/shm``) as the pods of a Kubernetes job share a RWX
checkpoint volume. Skipped with the reason where network namespaces cannot be created (not root,
no ``ip``, no CAP_SYS_ADMIN in a container).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest

from launch_util import Job, job_segments

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

ADDR = ("10.77.0.1", "10.77.0.2")
MASTER_PORT = 29511
HB_TIMEOUT_S = 20.0  # runtime.heartbeat_timeout_s of launch_util.BASE


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


_TAGS: list[str] = []


def _wait_reachable(ns, timeout_s: float = 30.0) -> None:
    """Until a TCP connection from namespace 1 reaches a listener on node 0's address in namespace 0
    (a veth pair just set up may drop the first packets); skip the test if it never does. The probe uses
    the port after MASTER_PORT, whose TIME_WAIT then cannot block the rendezvous store's bind."""
    port = MASTER_PORT + 1
    server = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
              f"s.bind(('{ADDR[0]}', {port})); s.listen(); s.settimeout({timeout_s}); "
              "c,_=s.accept(); c.close(); s.close()")
    client = ("import socket,sys,time\n"
              f"t=time.monotonic()+{timeout_s}\n"
              "while True:\n"
              f"  try: socket.create_connection(('{ADDR[0]}', {port}), timeout=2).close(); break\n"
              "  except OSError:\n"
              "    if time.monotonic()>t: sys.exit(1)\n"
              "    time.sleep(0.2)\n")
    srv = subprocess.Popen(["ip", "netns", "exec", ns[0], sys.executable, "-c", server])
    try:
        time.sleep(0.3)
        r = subprocess.run(["ip", "netns", "exec", ns[1], sys.executable, "-c", client], timeout=timeout_s + 10)
        if r.returncode:
            pytest.skip(f"namespace {ns[1]} cannot reach {ADDR[0]}:{port} in {ns[0]} within {timeout_s:g} s")
        srv.wait(10)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def _job_infos(jobs) -> list[dict]:
    """Every node's ``job.json``; when one never appears, the failure shows every node's output (each
    launcher's and card process's stacks included: :meth:`Job.dump_stacks`), since a node waiting at
    the rendezvous is usually waiting for another one."""
    try:
        return [j.job_info() for j in jobs]
    except AssertionError as e:
        for j in jobs:
            j.dump_stacks(0.0)
        time.sleep(2.0)
        for j in jobs:
            j.kill_all()
        others = "\n".join(f"=== {j.dir} ===\n{j.tail(12000)}" for j in jobs)
        raise AssertionError(f"{e}\n{others}") from None


@pytest.fixture
def two_nodes():
    """Two network namespaces joined by a veth pair; yields their names; deleted in the finalizer."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed (apt-get install -y iproute2)")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    # new names for every test: a namespace deleted by the previous test may still be torn down
    # (its processes gone, the kernel's cleanup not yet), so a name is never reused within a session
    _TAGS.append(f"{os.getpid() % 10000}{len(_TAGS)}")
    tag = _TAGS[-1]
    ns = (f"npt-mn0-{tag}", f"npt-mn1-{tag}")
    veth = (f"nptmn{tag}a", f"nptmn{tag}b")  # <= 15 characters
    made = []
    try:
        for n in ns:
            r = _ip("netns", "add", n)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(n)
        steps = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
        for i in (0, 1):
            steps += [("link", "set", veth[i], "netns", ns[i]),
                      ("-n", ns[i], "addr", "add", f"{ADDR[i]}/24", "dev", veth[i]),
                      ("-n", ns[i], "link", "set", veth[i], "up"),
                      ("-n", ns[i], "link", "set", "lo", "up")]
        for st in steps:
            r = _ip(*st)
            if r.returncode:
                pytest.skip(f"cannot set up the veth pair (`ip {' '.join(st)}`): {r.stderr.strip()}")
        _wait_reachable(ns)
        yield ns
    finally:
        for n in made:  # deleting a namespace deletes its end of the veth pair (and so the pair)
            _ip("netns", "del", n)


def _node_job(tmp_path, model, ns, node: int, backend: str, *overrides: str, env=None) -> Job:
    e = {"NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": ADDR[0], "MASTER_PORT": str(MASTER_PORT)}
    if node == 1:  # the Indexed-Job fallback: NODE_RANK unset, JOB_COMPLETION_INDEX set
        e = dict(e, JOB_COMPLETION_INDEX="1")
        del e["NODE_RANK"]
    e.update(env or {})
    return Job(tmp_path, model, *overrides, name=f"node{node}", env=e, backend=backend,
               prefix=["ip", "netns", "exec", ns[node]])


def _wait_both(jobs, timeout: float) -> list[int]:
    try:
        return [j.wait(timeout) for j in jobs]
    finally:
        for j in jobs:
            j.kill_all()


def _survivors_gone(jobs, timeout: float = 5.0) -> list:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = [p for j in jobs for p in j.survivors()]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _assert_close(got, ref, what):
    assert len(got) == len(ref), f"{what}: {len(got)} steps vs {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {i + 1} loss {a!r} vs single node {b!r}"


def test_two_nodes_match_one_node_and_reshard(two_nodes, tiny_model, tmp_path):
    steps = ["train.steps=4", "train.save_every=2"]
    # reference: one node, three cards
    ref = Job(tmp_path, tiny_model, *steps, name="single", backend="cpu,cpu,cpu")
    assert _wait_both([ref], 300) == [0], ref.tail()
    ref_losses = ref.losses()
    assert len(ref_losses) == 4

    root = str(tmp_path / "shared_ckpt")  # one checkpoint root shared by both nodes
    n0 = _node_job(tmp_path, tiny_model, two_nodes, 0, "cpu", *steps, f"checkpoint.dir={root}")
    n1 = _node_job(tmp_path, tiny_model, two_nodes, 1, "cpu,cpu", *steps, f"checkpoint.dir={root}")
    info0, info1 = _job_infos([n0, n1])
    rcs = _wait_both([n0, n1], 300)
    assert rcs == [0, 0], n0.tail() + n1.tail()
    assert info0["job_id"] == info1["job_id"]
    # node order = rank order; node 0 has stage 0, node 1 stages 1 and 2
    assert [c["rank"] for c in info0["cards"]] == [0] and [c["rank"] for c in info1["cards"]] == [1, 2]
    assert info1["cards"][0]["card"] == "node1/cpu:0"
    # the boundary between the nodes over ZeroMQ TCP on the veth addresses, the one in node 1 over shm
    assert info0["boundaries"] == info1["boundaries"] == ["inline", "shm"]
    assert info0["cards"][0]["inbox"].startswith(f"tcp://{ADDR[0]}:")
    assert info1["cards"][0]["inbox"].startswith(f"tcp://{ADDR[1]}:")
    assert info1["cards"][1]["inbox"].startswith("ipc://")
    _assert_close(n0.losses(), ref_losses, "node 0's metrics")
    _assert_close(n1.losses(), ref_losses, "node 1's metrics")
    assert not _survivors_gone([n0, n1])
    assert job_segments(info0["job_id"]) == []
    # node 0 published both checkpoints, each with every stage's shard
    with open(os.path.join(root, "step_000002", "manifest.json")) as f:
        man = json.load(f)
    assert man["world_size"] == 3 and man["step"] == 2
    assert sorted(set(man["index"].values())) == [f"stage_00{r}.safetensors" for r in range(3)]
    assert not [d for d in os.listdir(root) if d.startswith(".tmp-")]

    # two nodes -> one node with two cards: resume from step 2 (other split), steps 3-4 match
    res = Job(tmp_path, tiny_model, *steps, f"train.resume={os.path.join(root, 'step_000002')}",
              f"checkpoint.dir={tmp_path / 'resumed_ckpt'}", name="resume", backend="cpu,cpu")
    assert _wait_both([res], 300) == [0], res.tail()
    got = res.losses()  # steps 1-2 carried from node 0's run dir (the checkpoint's), where it still holds them
    assert len(got) in (2, 4), got
    _assert_close(got[-2:], ref_losses[2:], "one node resumed from the two-node checkpoint")


# kill -9 (dead: seen at once) and SIGSTOP (hung: seen after runtime.heartbeat_timeout_s)
FAULTS = [("kill", "killed by signal SIGKILL", HB_TIMEOUT_S),
          ("stop", "stopped responding: no heartbeat", HB_TIMEOUT_S + 10)]


@pytest.mark.parametrize("action,cause,bound_s", FAULTS, ids=[f[0] for f in FAULTS])
def test_card_fault_on_node1_brings_both_nodes_down(two_nodes, tiny_model, tmp_path, action, cause, bound_s):
    root = str(tmp_path / "shared_ckpt")
    common = ("train.steps=6", "train.save_every=1", f"checkpoint.dir={root}")
    # global rank 2 = node 1's second card; NPT_FAULT only in node 1's environment
    fault = {"NPT_FAULT": f"rank=2,phase=forward,step=3,action={action}"}
    n0 = _node_job(tmp_path, tiny_model, two_nodes, 0, "cpu", *common)
    n1 = _node_job(tmp_path, tiny_model, two_nodes, 1, "cpu,cpu", *common, env=fault)
    jobs = [n0, n1]
    try:
        info0, info1 = _job_infos([n0, n1])
        victim = info1["cards"][1]
        assert victim["rank"] == 2

        def gone():
            try:
                return psutil.Process(victim["pid"]).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
            except psutil.NoSuchProcess:
                return True
        n1.wait_for(gone, 180, "the card process on node 1 to die or stop")
        t_dead = time.monotonic()
        rcs = [n0.wait(120), n1.wait(120)]
    finally:
        for j in jobs:
            j.kill_all()
    assert rcs == [1, 1], n0.tail() + n1.tail()
    for j in jobs:
        assert j.t_exit - t_dead < bound_s, f"{j.dir}: exit {j.t_exit - t_dead:.1f} s after the kill\n{j.tail()}"
        errs = j.error_lines()
        assert len(errs) == 1, j.tail()
        # node, card, stage and phase of the root cause, on both nodes
        assert f"card node1/cpu:1 (stage 2, layers {victim['layers']})" in errs[0], j.tail()
        assert "step 3" in errs[0] and cause in errs[0], j.tail()
        assert "Traceback" not in j.stderr
    assert not _survivors_gone(jobs), "processes left running"
    assert job_segments(info0["job_id"]) == [], "shared-memory segments left in /dev/shm"
    assert not os.path.exists(info0["ipc_dir"]) and not os.path.exists(info1["ipc_dir"])
    # the last checkpoint (step 2, or step 1 if the kill came before node 1's report of step 2
    # reached node 0) stays complete and loadable; no staging dir is left
    from npu_train.checkpoint.store import CheckpointReader, complete_checkpoints

    last = complete_checkpoints(root)[-1]
    assert os.path.basename(last) in ("step_000001", "step_000002")
    r = CheckpointReader(last)
    assert r.manifest["world_size"] == 3 and r.get("master.model.norm.weight").numel() == 64
    assert not [d for d in os.listdir(root) if d.startswith(".tmp-")]


def test_kill9_node_agent_brings_the_other_node_down(two_nodes, tiny_model, tmp_path):
    """kill -9 of node 1's launcher (its node agent): its card processes clean up and exit, node 0
    declares node 1 dead after the heartbeat timeout, names it, and leaves nothing behind."""
    common = ("train.steps=200", f"checkpoint.dir={tmp_path / 'shared_ckpt'}")
    n0 = _node_job(tmp_path, tiny_model, two_nodes, 0, "cpu", *common)
    n1 = _node_job(tmp_path, tiny_model, two_nodes, 1, "cpu,cpu", *common)
    jobs = [n0, n1]
    try:
        info0, info1 = _job_infos([n0, n1])
        n0.wait_steps(2, 180)
        os.kill(n1.proc.pid, 9)
        t_kill = time.monotonic()
        rc0 = n0.wait(120)
    finally:
        for j in jobs:
            j.kill_all()
    assert rc0 == 1, n0.tail()
    # silence is only "dead" after runtime.heartbeat_timeout_s; then the teardown takes a moment
    assert n0.t_exit - t_kill < HB_TIMEOUT_S + 10, f"node 0 exited {n0.t_exit - t_kill:.1f} s after the kill"
    errs = n0.error_lines()
    assert len(errs) == 1 and "node 1 stopped responding" in errs[0], n0.tail()
    assert not _survivors_gone(jobs), "processes left running"
    assert job_segments(info0["job_id"]) == [], "shared-memory segments left in /dev/shm"
    assert not os.path.exists(info0["ipc_dir"]) and not os.path.exists(info1["ipc_dir"])


def test_nodes_with_different_settings_fail_naming_the_keys(tiny_model, tmp_path):
    """The rendezvous compares the model/data/train settings: both launchers exit 2 naming the key
    (two launchers on this host's loopback; no namespaces needed before any card process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    n0 = Job(tmp_path, tiny_model, "train.lr=1e-3", name="node0", env=dict(env, NODE_RANK="0"), backend="cpu")
    n1 = Job(tmp_path, tiny_model, "train.lr=2e-3", name="node1", env=dict(env, NODE_RANK="1"), backend="cpu")
    rcs = _wait_both([n0, n1], 180)
    assert rcs == [2, 2], n0.tail() + n1.tail()
    for j in (n0, n1):
        errs = j.error_lines()
        assert len(errs) == 1 and "node 1 differs from node 0 in train.lr (node 0: 0.001, node 1: 0.002)" in errs[0], j.tail()
        assert not os.path.exists(os.path.join(j.run_dir, "checkpoints")), "nothing is written before the check"


def test_unshared_checkpoint_dir_is_refused_before_training(tiny_model, tmp_path):
    """Each node with its own checkpoint.dir would train every step and then fail to publish; the rendezvous
    refuses it first (node 0's marker is not visible in node 1's root): exit 2 on node 1, naming the fix,
    and node 0 stops too (two launchers on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    n0 = Job(tmp_path, tiny_model, f"checkpoint.dir={tmp_path / 'ck0'}", name="node0", env=dict(env, NODE_RANK="0"),
             backend="cpu")
    n1 = Job(tmp_path, tiny_model, f"checkpoint.dir={tmp_path / 'ck1'}", name="node1", env=dict(env, NODE_RANK="1"),
             backend="cpu")
    rcs = _wait_both([n0, n1], 180)
    assert rcs[1] == 2 and rcs[0] != 0, n0.tail() + n1.tail()
    assert any("one shared checkpoint.dir" in e for e in n1.error_lines()), n1.tail()
    assert not os.path.exists(os.path.join(n0.run_dir, "metrics.jsonl"))  # no step was trained


def test_two_slurm_nodes_through_the_sbatch_script(two_nodes, tiny_model, tmp_path):
    """launch/slurm/npu-train.sbatch on two "nodes" given only Slurm's variables (no NNODES / NODE_RANK /
    MASTER_ADDR): srun is a stand-in that runs the step's command as this node's task. The launchers find
    node 0 in SLURM_JOB_NODELIST, rendezvous, and train the same losses as one node with the two cards."""
    from launch_util import BASE

    steps = ["train.steps=3"]
    ref = Job(tmp_path, tiny_model, *steps, name="single", backend="cpu,cpu")
    assert _wait_both([ref], 300) == [0], ref.tail()
    srun = tmp_path / "srun"
    srun.write_text("#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    srun.chmod(0o755)
    sbatch = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "slurm", "npu-train.sbatch")
    jobs = []
    for node in (0, 1):
        env = {"SLURM_JOB_ID": "5151", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(node),
               "SLURM_PROCID": str(node), "SLURM_JOB_NODELIST": "10.77.0.[1-2]", "MASTER_PORT": str(MASTER_PORT),
               "NPT_CKPT_DIR": str(tmp_path / "shared" / "ckpt"), "NPT_RUN_ROOT": str(tmp_path / "runs"),
               "NPT_PYTHON": sys.executable, "NPT_SRUN": str(srun)}
        j = Job(tmp_path, tiny_model, name=f"slurm{node}", env=env, prefix=["ip", "netns", "exec", two_nodes[node]],
                argv=["bash", sbatch, f"model.path={tiny_model}", "backend=cpu", *BASE, *steps])
        j.run_dir = str(tmp_path / "runs" / "job5151" / "try0" / f"node{node}")  # where the script puts it
        jobs.append(j)
    infos = _job_infos(jobs)
    rcs = _wait_both(jobs, 300)
    assert rcs == [0, 0], jobs[0].tail() + jobs[1].tail()
    assert infos[0]["job_id"] == infos[1]["job_id"]
    assert [c["rank"] for c in infos[0]["cards"]] == [0] and [c["rank"] for c in infos[1]["cards"]] == [1]
    assert infos[1]["cards"][0]["inbox"].startswith(f"tcp://{ADDR[1]}:")
    _assert_close(jobs[0].losses(), ref.losses(), "Slurm node 0's metrics")
    assert os.path.isfile(tmp_path / "shared" / "ckpt" / "step_000003" / "manifest.json")
    assert not _survivors_gone(jobs)
