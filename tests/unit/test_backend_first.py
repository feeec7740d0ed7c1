"""A malformed ``backend=`` is refused before the launcher's heavy imports: a fresh-clone review on a loaded
2-core host waited 19 s for the one line, most of it torch's import and the job's modules. Checked by what the
launcher imported when it stopped (no torch, no model or tokenizer module, not even the job module), not by
timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npu_train.errors import one_refusal

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(REPO, "launch", "run.py")

#: the modules a refusal before any work must not have imported
HEAVY = ("torch", "transformers", "tokenizers", "npu_train.model.tokenizer", "npu_train.model.weights",
         "npu_train.data.prepare", "npu_train.runtime.job")

CODE = """
import atexit, json, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(json.dumps([m for m in {heavy!r} if m in sys.modules])))
sys.argv = [{launch!r}, *argv]
runpy.run_path({launch!r}, run_name="__main__")
"""


@pytest.mark.parametrize("backend, says", [
    ("tpu:0", "unknown device kind 'tpu'"),
    ("cpu:1", "cpu takes no index"),
    ("gpu", "write cuda:N"),
    ("furiosa:0,furiosa:0", "already named by entry"),
])
def test_a_malformed_backend_is_refused_before_the_heavy_imports(tmp_path, backend, says):
    seen = tmp_path / "imported.json"
    r = subprocess.run([sys.executable, "-c", CODE.format(heavy=HEAVY, launch=LAUNCH), str(seen),
                        f"backend={backend}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env=dict(os.environ, NPT_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 2, r.stderr[-2000:]
    assert one_refusal(r.stderr) and says in one_refusal(r.stderr), r.stderr
    assert json.loads(seen.read_text()) == [], "imported before the refusal"


def test_a_cuda_card_this_machine_cannot_have_is_refused_before_the_heavy_imports(tmp_path):
    """``backend=cuda:7,cpu`` on a host without CUDA: ~12 s of imports and loading came before the line that
    the device does not exist (a fresh-clone review). On a CPU-only torch build it now comes first."""
    from npu_train.backends.spec import _torch_version

    if not (_torch_version() or "").endswith("+cpu"):
        pytest.skip("this torch build may have CUDA (the fake-machine checks below cover the rule)")
    seen = tmp_path / "imported.json"
    r = subprocess.run([sys.executable, "-c", CODE.format(heavy=HEAVY, launch=LAUNCH), str(seen),
                        "backend=cuda:7,cpu", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env=dict(os.environ, NPT_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 2, r.stderr[-2000:]
    msg = one_refusal(r.stderr)
    assert msg and "'cuda:7' names a device that does not exist" in msg and "install a CUDA build" in msg, r.stderr
    assert json.loads(seen.read_text()) == [], "imported before the refusal"
    assert "npu-train: " not in r.stdout  # refused before the launcher's first line


def _machine(tmp_path, gpus=None, dev=()):
    """A fake ``/proc`` and ``/dev``: ``gpus`` GPUs listed by the NVIDIA driver (None: no driver), ``dev``: nodes."""
    proc, d = tmp_path / "proc", tmp_path / "dev"
    d.mkdir()
    for name in dev:
        (d / name).write_text("")
    if gpus is not None:
        for i in range(gpus):
            (proc / "driver" / "nvidia" / "gpus" / f"0000:0{i}:00.0").mkdir(parents=True)
        (proc / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    return str(proc), str(d)


@pytest.mark.parametrize("version, gpus, dev, backend, says", [
    ("2.13.0+cpu", 8, (), "cuda:0,cpu", "this PyTorch build, 2.13.0+cpu, has no CUDA support"),
    ("2.13.0+cu128", None, (), "cpu,cuda:auto", "0 CUDA devices (torch.cuda.is_available() is False"),
    ("2.13.0+cu128", 2, ("nvidia0", "nvidia1"), "cuda:7,cpu",
     "'cuda:7' names a device that does not exist: this machine has 2 CUDA devices (valid: cuda:0..cuda:1)"),
    ("2.13.0+cu128", 2, (), "cuda:1,cuda:0", None),       # both exist
    ("2.13.0", None, ("dxg",), "cuda:3", None),            # WSL: no driver listing, the probe decides
    ("2.13.0+cpu", None, (), "cpu,furiosa:0", None),       # no cuda entry
])
def test_cuda_cards_that_cannot_exist_are_known_without_torch(tmp_path, monkeypatch, version, gpus, dev, backend,
                                                              says):
    from npu_train.backends import spec
    from npu_train.errors import UserError

    monkeypatch.setattr(spec, "_torch_version", lambda: version)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    proc, d = _machine(tmp_path, gpus, dev)
    cards = spec.parse_backend_list(backend)
    if says is None:
        spec.check_cuda_early(cards, proc=proc, dev=d)
        return
    with pytest.raises(UserError) as e:
        spec.check_cuda_early(cards, proc=proc, dev=d)
    assert says in str(e.value), str(e.value)
    if "valid:" in says:  # under CUDA_VISIBLE_DEVICES (renumbered) the index is left to the probe
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        spec.check_cuda_early(cards, proc=proc, dev=d)
