"""Regression review 39a of 34365ce (the plateau rule near the ceiling, mean_interval's overflow)
and acc7792 (summed_cross_entropy keeps float64). Each test failed on the code it reviews."""

from __future__ import annotations

import math

import pytest

from mnemo.sweep.recipe import judge_claim, left_plateau
from mnemo.sweep.stats import mean_interval, t_quantile


def _curve(values, metric="val_acc"):
    return [{"step": 2 * (i + 1), metric: v} for i, v in enumerate(values)]


def test_a_run_stuck_at_guessing_is_still_stuck_under_a_low_threshold():
    """``mnemo sweep report --threshold 0.3`` (a valid threshold: "how many runs got past 0.3" on
    a task nothing solves) put MQAR's guessing plateau (0.25: one of the four values present)
    within ``ACC_RISE`` of the threshold, so 34365ce called a run stuck there "left before its first
    evaluation", and a claim between two stuck models got a verdict ("not reproduced") instead of
    "not testable here". Before 34365ce: stuck. A low threshold says nothing about where guessing
    lies, so the ceiling band only holds for a threshold of at least ``1 − ACC_RISE``."""
    stuck = _curve([0.16, 0.24, 0.26, 0.28, 0.27, 0.28])
    assert left_plateau(stuck, "val_acc", 0.3) is False
    assert left_plateau(_curve([0.5, 0.5, 0.52]), "val_acc", 0.6) is False  # a 2-symbol task's 0.5
    # reaching the low threshold still counts, and so does a rise
    assert left_plateau(_curve([0.25, 0.26, 0.31]), "val_acc", 0.3) is True
    assert left_plateau(_curve([0.25, 0.25, 0.3, 0.36]), "val_acc", 0.5) is True
    # the band itself (34365ce's cases) is unchanged at the default threshold and without one
    assert left_plateau(_curve([0.92, 0.93, 0.95]), "val_acc", 0.99) is True
    assert left_plateau(_curve([0.89, 0.89, 0.95]), "val_acc", 0.99) is True
    assert left_plateau(_curve([0.91, 0.92], "val_seq_acc"), "val_seq_acc") is True
    assert left_plateau(_curve([0.84, 0.84, 0.86]), "val_acc", 0.9) is True  # 0.9 - 0.1 = 0.8
    cell = {"seeds": [1, 2, 3], "values": [0.28, 0.27, 0.26]}
    a = {**cell, "plateau": [left_plateau(stuck, "val_acc", 0.3)] * 3}
    b = {**cell, "values": [0.26, 0.27, 0.28], "plateau": a["plateau"]}
    j = judge_claim({"better": "a", "than": "b"}, a, b, metric="val_acc", threshold=0.3)
    assert j["verdict"] == "not testable here" and "did not leave the initial plateau" in j["why"]


def test_the_interval_of_values_whose_difference_from_the_mean_overflows():
    """34365ce scaled the deviations by the largest one, but a deviation ``x − mean`` past the
    float range (values near ±1.8e308) is already ``inf`` before the scaling: ``inf / inf`` made the
    spread NaN, and a claim on it the silent verdict "not reproduced: contains 0" (before: an
    ``OverflowError``). By hand: deviations 2.4e308 and four of −0.6e308, ``s = √1.8 · 1e308``."""
    xs = [1.5e308] + [-1.5e308] * 4
    st = mean_interval(xs)
    assert st["mean"] == pytest.approx(-0.9e308, rel=1e-15)
    assert st["std"] == pytest.approx(math.sqrt(1.8) * 1e308, rel=1e-14)
    half = t_quantile(0.975, 4) * math.sqrt(1.8 / 5) * 1e308  # finite: 1.67e308 (t · s alone is not)
    assert math.isfinite(st["half_width"]) and st["half_width"] == pytest.approx(half, rel=1e-14)
    assert st["high"] == pytest.approx(-0.9e308 + half, rel=1e-14)
    # ordinary and 34365ce's values: unchanged
    assert mean_interval([1e200, -1e200, 1e200])["std"] == pytest.approx(2 / math.sqrt(3) * 1e200, rel=1e-15)
    assert mean_interval([0.5, 0.5, 0.5])["std"] == 0.0
