"""``calibrate=true``: measure a card kind's :class:`~npu_train.planner.rates.Rates` on this machine
and write its calibration profile. Start at :func:`~npu_train.calibrate.profile.main_calibrate`;
:mod:`.measure` holds the benchmarks, :mod:`.splitcost` the zero-bubble figure, :mod:`.baseline`
the cpu process baseline, :mod:`.timing` the timing loops. Imports torch when a measurement runs.
"""
from __future__ import annotations

from npu_train.calibrate.baseline import CARD_PROCESS_MODULES, measure_process_baseline
from npu_train.calibrate.profile import calibrate, machine_info, main_calibrate, save_profile, thread_counts

__all__ = ["calibrate", "main_calibrate", "save_profile", "thread_counts", "machine_info",
           "measure_process_baseline", "CARD_PROCESS_MODULES"]
