"""``calibrate=true``: measure a card kind's :class:`~npu_train.planner.rates.Rates` here and write its
profile. Start at :func:`~npu_train.calibrate.profile.main_calibrate`; imports torch when measuring.
"""
from __future__ import annotations

from npu_train.calibrate.baseline import CARD_PROCESS_MODULES, measure_process_baseline
from npu_train.calibrate.profile import calibrate, machine_info, main_calibrate, save_profile, thread_counts

__all__ = ["calibrate", "main_calibrate", "save_profile", "thread_counts", "machine_info",
           "measure_process_baseline", "CARD_PROCESS_MODULES"]
