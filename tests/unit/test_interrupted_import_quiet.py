"""Ctrl-C while the launcher imports torch (``interrupted by SIGINT while preparing``) prints that line and no
torch log records: torch's import had registered its FakeTensor atexit hook but not yet set its loggers to WARNING,
and Hydra's root logger is at INFO, so ``[...][torch._subclasses.fake_tensor][INFO] - FakeTensor cache stats:``
and ``cache_hits: 0`` lines followed the interrupted line on the console and in run.log (fresh-clone review).
The signal is sent at a fixed point: right after ``torch._subclasses.fake_tensor`` has run, inside torch's import."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(REPO, "launch", "run.py")

#: runs the launcher with an import hook that sends SIGINT to the launcher once fake_tensor is imported
CODE = """
import importlib, importlib.abc, os, runpy, signal, sys
class AfterFakeTensor(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch._subclasses.fake_tensor":
            return None
        sys.meta_path.remove(self)
        importlib.import_module(name)  # its atexit hook is registered; torch's import is still under way
        os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, AfterFakeTensor())
sys.argv = [{launch!r}, *sys.argv[1:]]
runpy.run_path({launch!r}, run_name="__main__")
"""


def test_ctrl_c_during_the_torch_import_prints_no_torch_log_lines(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64, '
        '"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"max_position_embeddings": 256}')
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", CODE.format(launch=LAUNCH), f"model.path={model}", "backend=cpu,cpu",
                        "train.steps=4", f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=dict(os.environ, NPT_CACHE=str(tmp_path / "cache")))
    text = r.stdout + r.stderr
    assert r.returncode == 130, text
    assert "interrupted by SIGINT while preparing" in text, text
    log = (run / "run.log").read_text() if (run / "run.log").exists() else ""
    for where in (text, log):
        assert "FakeTensor" not in where and "cache_hits" not in where and "[torch." not in where, where
