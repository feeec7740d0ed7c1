"""Suite-wide settings.

The launcher calibrates a card kind on a job's first run on a machine
(``placement.calibrate=auto``, :mod:`npu_train.planner.autocal`, ~12 s for cpu). The test suite
launches many jobs, in-process and as subprocesses, so it switches that off for all of them
(``NPT_CALIBRATE=never``, inherited by every subprocess): plans use whatever profile the cache
holds, else the assumed defaults. ``tests/unit/test_autocal.py`` clears the variable to test the
automatic path itself.
"""
from __future__ import annotations

import os

os.environ.setdefault("NPT_CALIBRATE", "never")


# ---- disk: a passed test's temp dir goes at once (checkpoints of the real model are ~2 GB each), so the
# suite's peak disk use is one test's, not the whole session's; a failed test's dir stays for inspection.
import shutil  # noqa: E402

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
