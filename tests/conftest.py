"""Suite-wide settings.

Every test gets its own ``NPT_CACHE`` (inherited by its subprocesses) holding no calibration
profile and no fitted figures, so plans start from the assumed defaults whatever ran before; the
cached data, tokenizers, compiled modules and the host AdamW kernel are shared (links to the real cache's
folders).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import tempfile

from npu_train.env import cache_root

_SHARED = ("data", "tokenizers", "furiosa", "kernels")
_REAL_CACHE = cache_root()
_CACHES = tempfile.mkdtemp(prefix="npt-test-caches-")

# ---- disk: a passed test's temp dir goes at once (checkpoints of the real model are ~2 GB each), so the
# suite's peak disk use is one test's, not the whole session's; a failed test's dir stays for inspection.
import shutil  # noqa: E402

atexit.register(shutil.rmtree, _CACHES, True)  # the per-test caches' parent (ignore_errors)

import pytest  # noqa: E402


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item._npt_failed = True
    return report


@pytest.fixture(autouse=True)
def _remove_tmp_path_of_passed_test(request):
    path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if path is not None and not getattr(request.node, "_npt_failed", False):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _private_cache():
    """``NPT_CACHE`` set to a fresh directory (shared folders linked) for the ``with`` block."""
    root = tempfile.mkdtemp(dir=_CACHES)
    for name in _SHARED:
        (_REAL_CACHE / name).mkdir(parents=True, exist_ok=True)
        os.symlink(_REAL_CACHE / name, os.path.join(root, name))
    old = os.environ.get("NPT_CACHE")
    os.environ["NPT_CACHE"] = root
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("NPT_CACHE", None)
        else:
            os.environ["NPT_CACHE"] = old
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _session_cache():
    """A fresh ``NPT_CACHE`` for what runs outside a test's own (module- and session-scoped fixtures),
    so nothing a test runs reads or writes the user's real cache."""
    with _private_cache() as root:
        yield root


@pytest.fixture(autouse=True)
def _own_cache(request):
    """A fresh ``NPT_CACHE`` per test (module docstring)."""
    with _private_cache() as root:
        yield root
