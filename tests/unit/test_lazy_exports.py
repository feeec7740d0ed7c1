"""``npu_train.backends``, ``npu_train.data`` and ``npu_train.model`` import their public names on first use
through one helper (:func:`npu_train.lazy_exports`): importing a package imports none of them (no torch), every
name in its ``__all__`` resolves to the object of the module that defines it, and an unknown name is an
AttributeError naming the package."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("npu_train.backends", "npu_train.data", "npu_train.model")


def test_importing_the_packages_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            + "".join(f"import {p}\n" for p in PACKAGES)
            + "from npu_train.backends import parse_backend_list\nfrom npu_train.data import FORMATS\n"
            + "from npu_train.model import embedded_model_path\nprint('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_and_an_unknown_one_is_refused(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        assert getattr(obj, "__name__", name) == name or not callable(obj), (package, name)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        getattr(pkg, "no_such_name")
