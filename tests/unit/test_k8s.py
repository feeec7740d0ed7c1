"""Kubernetes launch (launch/k8s/): rendered manifests against the Kubernetes schema, the pod entry
script's derived ranks/addresses/backend list, and its restart path (train.resume=auto).

References are written from the formulas in launch/k8s/render.py's docstring, not from its code.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from npu_train.checkpoint.store import find_checkpoint
from scripts import load_script

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RENDER = os.path.join(REPO, "launch", "k8s", "render.py")
ENTRY = os.path.join(REPO, "launch", "k8s", "entrypoint.sh")
MIB = 2 ** 20

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")


def render(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, RENDER, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def expected_shm_mi(nodes: int, cards: int, accum: int, mb: int, seq: int, hidden: int, elem: int) -> int:
    """2 x (C-1) x slots x (b*S*H*e + 64) + 256 MiB, slots = min(accum, nodes*C) + 1, rounded up to Mi."""
    slots = min(accum, nodes * cards) + 1
    total = 2 * (cards - 1) * slots * (mb * seq * hidden * elem + 64) + 256 * MIB
    return -(-total // MIB)


@pytest.mark.parametrize("nodes", [1, 4])
def test_manifests_validate_and_carry_the_layout(nodes):
    docs = render("--nodes", str(nodes), "--cards-per-node", "2", "--image", "registry.local/npu-train:0.1",
                  "--model", "/models/llama-3.1-8b", "--data", "/models/corpus", "--ckpt-pvc", "npt-ckpt",
                  "--model-pvc", "npt-models", "--cache-pvc", "npt-cache", "--hidden", "4096", "--seq-len", "512",
                  "--micro-batch", "1", "--accum", "8", "--cpu", "32", "--memory", "200Gi",
                  "--", "train.steps=1000", "train.lr=3e-5")
    for d in docs:  # strict: unknown fields (a typo) are errors too
        kv.validate(d, kv.latest_version(), strict=True)
    svc, job = docs
    assert svc["kind"] == "Service" and job["kind"] == "Job"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    js = job["spec"]
    assert js["completionMode"] == "Indexed" and js["completions"] == nodes and js["parallelism"] == nodes
    pod = js["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] and pod["restartPolicy"] == "Never"
    # grace: one step (120 s) + one save (300 s) + 60 s tear-down
    assert pod["terminationGracePeriodSeconds"] == 120 + 300 + 60
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["furiosa.ai/rngd"] == 2 and c["resources"]["requests"]["furiosa.ai/rngd"] == 2
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MASTER_ADDR"] == "npu-train-0.npu-train.$(POD_NAMESPACE).svc"
    assert env["MASTER_PORT"] == "29500" and env["NNODES"] == str(nodes) and env["CARDS_PER_NODE"] == "2"
    assert c["args"][-2:] == ["train.steps=1000", "train.lr=3e-5"] and "model.path=/models/llama-3.1-8b" in c["args"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["/dev/shm"] == "dshm"
    want = expected_shm_mi(nodes, 2, accum=8, mb=1, seq=512, hidden=4096, elem=2)
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == f"{want}Mi"
    assert vols[mounts["/ckpt"]]["persistentVolumeClaim"]["claimName"] == "npt-ckpt"
    assert vols[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "npt-models"
    assert vols[mounts["/root/.cache/furiosa/compiler"]]["persistentVolumeClaim"]["claimName"] == "npt-cache"
    # a restart must not retry bad input (exit 2)
    (rule,) = js["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]


def test_shm_size_numbers():
    """Hand-computed: 4 nodes x 2 cards, b=2, S=128, H=4096, bf16, accum 4: slots = min(4, 8) + 1 = 5,
    slot = 2*128*4096*2 + 64 = 2,097,216 B; 2 * 1 * 5 * 2,097,216 + 268,435,456 = 289,407,616 B -> 277 Mi.
    One card per node: no ring inside the node, only the 256 Mi margin."""
    r = load_script(RENDER, "npt_k8s_render")
    assert r.shm_bytes(2, 4, accum=4, micro_batch=2, seq_len=128, hidden=4096) == 289_407_616
    assert r.quantity_mi(289_407_616) == "277Mi"
    assert r.shm_bytes(1, 4, accum=4, micro_batch=2, seq_len=128, hidden=4096) == 256 * MIB


def test_manifest_validation_catches_a_bad_field():
    """The schema check is not vacuous: a misspelt field and a wrong type are rejected."""
    _, job = render("--nodes", "2", "--cards-per-node", "2", "--image", "i", "--model", "/m", "--ckpt-pvc", "c")
    job["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.latest_version(), strict=True)
    del job["spec"]["template"]["spec"]["terminationGracePeriodSecond"]
    job["spec"]["completions"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.latest_version(), strict=True)


# ============================================================================ pod entry script
STUB = """import json, os, sys
with open(os.environ["STUB_OUT"], "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in
               ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES")}}, f)
"""


def run_entry(tmp_path, index, extra_env=None, args=(), ckpt=None):
    stub = tmp_path / "stub_launcher.py"
    stub.write_text(STUB)
    out = tmp_path / f"argv{index}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "JOB_COMPLETION_INDEX", "POD_IP")}
    env.update({"JOB_COMPLETION_INDEX": str(index), "MASTER_ADDR": "npu-train-0.npu-train.team.svc",
                "MASTER_PORT": "29500", "NNODES": "2", "CARDS_PER_NODE": "2", "POD_IP": f"10.0.0.{10 + index}",
                "NPT_CKPT_DIR": str(ckpt or tmp_path / "ckpt" / "checkpoints"),
                "NPT_RUN_ROOT": str(tmp_path / "ckpt" / "runs"),
                "NPT_LAUNCHER": f"{sys.executable} {stub}", "STUB_OUT": str(out)})
    env.update(extra_env or {})
    p = subprocess.run(["bash", ENTRY, *args], env=env, capture_output=True, text=True, timeout=60)
    got = json.loads(out.read_text()) if out.exists() else None
    return p, got


@pytest.mark.parametrize("index", [0, 1])
def test_entrypoint_derives_rank_address_backend_and_resume(tmp_path, index):
    p, got = run_entry(tmp_path, index, args=["train.steps=50"])
    assert p.returncode == 0, p.stderr
    assert got["env"] == {"NODE_RANK": str(index), "MASTER_ADDR": "npu-train-0.npu-train.team.svc",
                          "MASTER_PORT": "29500", "NNODES": "2"}
    argv = got["argv"]
    assert argv[0] == "backend=furiosa:auto,furiosa:auto"
    assert "train.resume=auto" in argv
    assert f"checkpoint.dir={tmp_path / 'ckpt' / 'checkpoints'}" in argv
    run_dir = [a for a in argv if a.startswith("hydra.run.dir=")][0]
    assert run_dir.startswith(f"hydra.run.dir={tmp_path / 'ckpt' / 'runs'}/node{index}/")
    assert f"runtime.host=10.0.0.{10 + index}" in argv
    assert argv[-1] == "train.steps=50"  # the Job's overrides come last (they win)
    assert "starting fresh" in p.stdout
    # the launcher reads "backend=a,b" as ONE job with both cards
    run = load_script(os.path.join(REPO, "launch", "run.py"), "npt_run_script")
    assert run.rewrite_backend_args([argv[0]]) == ["backend=[furiosa:auto,furiosa:auto]"]


def test_entrypoint_rank_from_node_rank_and_cpu_cards(tmp_path):
    p, got = run_entry(tmp_path, 0, {"NODE_RANK": "1", "NPT_CARD_KIND": "cpu", "NNODES": "1"})
    assert p.returncode == 2 and got is None
    assert p.stderr.strip().splitlines() == [
        "entrypoint: error: NODE_RANK=1 must be an integer in [0, NNODES=1)"]
    p, got = run_entry(tmp_path, 0, {"NODE_RANK": "1", "NPT_CARD_KIND": "cpu", "NNODES": "3", "CARDS_PER_NODE": "3"})
    assert p.returncode == 0, p.stderr
    assert got["env"]["NODE_RANK"] == "1" and got["argv"][0] == "backend=cpu,cpu,cpu"


@pytest.mark.parametrize("unset,needle", [("MASTER_ADDR", "MASTER_ADDR is not set"),
                                          ("JOB_COMPLETION_INDEX", "neither NODE_RANK nor JOB_COMPLETION_INDEX"),
                                          ("NNODES", "NNODES is not set")])
def test_entrypoint_rejects_missing_env(tmp_path, unset, needle):
    stub = tmp_path / "stub_launcher.py"
    stub.write_text(STUB)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "JOB_COMPLETION_INDEX")}
    env.update({"JOB_COMPLETION_INDEX": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1", "NNODES": "1",
                "CARDS_PER_NODE": "1", "NPT_LAUNCHER": f"{sys.executable} {stub}", "STUB_OUT": str(tmp_path / "o"),
                "NPT_CKPT_DIR": str(tmp_path / "c"), "NPT_RUN_ROOT": str(tmp_path / "r")})
    env.pop(unset)
    p = subprocess.run(["bash", ENTRY], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and not (tmp_path / "o").exists()
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("entrypoint: error: ") and needle in line


def _fake_checkpoint(root, step, complete=True):
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "stage_000.safetensors").write_bytes(b"")
    if complete:
        (d / "manifest.json").write_text(json.dumps({"step": step}))
    return d


def test_restart_resumes_from_latest_complete_checkpoint(tmp_path):
    """A replaced pod: the volume holds complete step 4 and 8 and an incomplete step 12 (crash during
    a save): the entry script passes train.resume=auto, and auto resolves to step 8."""
    root = tmp_path / "ckpt" / "checkpoints"
    assert find_checkpoint("auto", str(root)) is None  # nothing yet (root does not even exist)
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 8)
    _fake_checkpoint(root, 12, complete=False)
    (root / ".tmp-step_000016-abc").mkdir()
    p, got = run_entry(tmp_path, 1, ckpt=root)
    assert p.returncode == 0, p.stderr
    assert "train.resume=auto" in got["argv"] and f"checkpoint.dir={root}" in got["argv"]
    assert f"resuming from {root / 'step_000008'}" in p.stdout
    assert find_checkpoint("auto", str(root)) == str(root / "step_000008")


def test_resume_auto_without_checkpoint_is_a_fresh_start(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    _fake_checkpoint(root, 3, complete=False)
    assert find_checkpoint("auto", str(root)) is None
    assert find_checkpoint("auto", None) is None
    from npu_train.checkpoint.store import CheckpointError

    with pytest.raises(CheckpointError):  # 'latest' still insists on a checkpoint
        find_checkpoint("latest", str(root))
