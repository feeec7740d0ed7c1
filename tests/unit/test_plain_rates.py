"""Rates in the plan are plain numbers: the 8B plan printed ``host AdamW 1e+03 M params/s`` and
``device AdamW 1e+04 M params/s`` (``.3g``)."""
from __future__ import annotations

from npu_train.planner.table import _RATE_ROWS, _rate_text, plain_number


def test_plain_number_keeps_three_digits_without_an_exponent():
    assert plain_number(1000.0) == "1,000"
    assert plain_number(10000.0) == "10,000"
    assert plain_number(13456.0) == "13,500"
    assert plain_number(123.4) == "123"
    assert plain_number(2.345) == "2.35"
    assert plain_number(0.0123) == "0.0123"
    assert plain_number(0.0) == "0"
    assert "e" not in plain_number(4.2e9)


class _Rates:
    """The attributes ``_rate_text`` reads of a planner ``Rates``."""
    host_adamw_params_per_s = 1.0e9  # 1,000 M params/s
    device_adamw_params_per_s = 1.0e10
    device_adamw = 1.0e10
    device_flops = 2.0e14

    def source(self, name: str) -> str:
        return "assumed"


def test_adamw_rates_print_as_plain_numbers():
    rows = {r[0]: r for r in _RATE_ROWS}
    assert _rate_text(_Rates(), rows["host_adamw_params_per_s"]) == "host AdamW 1,000 M params/s [assumed]"
    assert _rate_text(_Rates(), rows["device_adamw_params_per_s"]) == "device AdamW 10,000 M params/s [assumed]"
    assert _rate_text(_Rates(), rows["device_flops"]) == "compute 200 TFLOP/s [assumed]"
