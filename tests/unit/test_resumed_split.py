"""A resumed run keeps its checkpoint's split unless train.split is given (runtime.job._resumed_split)."""
from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.runtime.job import _resumed_split


def _cfg(**over):
    cfg = OmegaConf.structured(Config)
    for k, v in over.items():
        OmegaConf.update(cfg, k.replace("__", "."), v, merge=False)
    return cfg


def _checkpoint(root, step, bounds):
    d = os.path.join(root, f"step_{step:06d}")
    os.makedirs(d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"step": step, "split": bounds}, f)


def test_latest_checkpoint_split_in_layers_per_stage(tmp_path):
    root = str(tmp_path / "ck")
    _checkpoint(root, 2, [[0, 3], [3, 6]])
    _checkpoint(root, 4, [[0, 4], [4, 6]])  # [first, last) per stage
    cfg = _cfg(train__resume="latest", checkpoint__dir=root)
    assert _resumed_split(cfg, str(tmp_path), 2) == [4, 2]
    assert _resumed_split(cfg, str(tmp_path), 3) is None  # another stage count: the planner chooses


def test_no_resume_or_nothing_to_resume(tmp_path):
    assert _resumed_split(_cfg(), str(tmp_path), 2) is None
    assert _resumed_split(_cfg(train__resume="auto", checkpoint__dir=str(tmp_path / "none")), str(tmp_path), 2) is None
