"""Helpers shared by test directories: load a repository script (``launch/run.py``,
``launch/k8s/render.py``) as a module, for tests that call its functions directly; check that
processes are gone. Importable from every test directory: ``tests/`` is on ``sys.path`` because
``tests/conftest.py`` lives there (pytest's default ``prepend`` import mode)."""
from __future__ import annotations

import importlib.util
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LAUNCH_RUN = os.path.join(REPO, "launch", "run.py")


def load_script(path: str, name: str):
    """Execute the Python file ``path`` as a fresh module called ``name`` and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pids_gone(pids) -> bool:
    """True when no process of ``pids`` is running (reaped, or a zombie at most)."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True
