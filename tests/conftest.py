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
