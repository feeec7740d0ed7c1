"""npu-train: pipeline-parallel fine-tuning across accelerator cards (README.md, docs/design.md §18)."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, where: dict):
    """The PEP 562 module ``__getattr__`` of ``package`` whose public names (``where``: name -> the module that
    defines it, ``.sub`` relative to ``package``) are imported on first use, so that importing the package
    imports none of them (``npu_train.backends`` and ``npu_train.data`` without torch: the launcher checks the
    backend list and the data source before its seconds of imports; ``npu_train.model`` for the planner)."""
    def __getattr__(name: str):
        if name in where:
            mod = where[name]
            return getattr(importlib.import_module(package + mod if mod.startswith(".") else mod), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
