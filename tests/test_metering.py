"""Busy time as the union of overlapping work, and the cost lines services report."""

from __future__ import annotations

import time

import pytest

from bus.metering import BusyMeter, LinearFit, fit


def test_overlapping_work_counts_once() -> None:
    meter = BusyMeter()
    meter.start()
    time.sleep(0.05)
    meter.start()  # a second piece of work while the first runs
    time.sleep(0.05)
    meter.stop()
    meter.stop()
    busy = meter.busy_s
    assert 0.09 <= busy < 0.2  # once, not 0.15 (the sum of the two pieces)
    time.sleep(0.03)
    assert meter.busy_s == busy  # idle time is not busy time
    with meter.busy():
        time.sleep(0.02)
        assert meter.busy_s > busy  # the interval in progress counts
    with pytest.raises(RuntimeError):
        meter.stop()


def test_a_line_is_fitted_from_the_sums_and_their_differences() -> None:
    line = LinearFit()
    for n in (1, 2, 4, 8):
        line.add(n, 0.01 + 0.002 * n)
    fixed, per_unit, count = fit(line.gauges("act"), "act")
    assert (fixed, per_unit, count) == (pytest.approx(0.01), pytest.approx(0.002), 4)
    before = line.gauges("act")
    for n in (4, 16):
        line.add(n, 0.03 + 0.001 * n)
    after = line.gauges("act")
    between = {k: after[k] - before[k] for k in after}
    assert fit(between, "act") == (pytest.approx(0.03), pytest.approx(0.001), 2)


def test_degenerate_samples_fall_back_to_a_proportional_or_flat_cost() -> None:
    one_size = LinearFit()
    for _ in range(3):
        one_size.add(4, 0.02)
    assert fit(one_size.gauges("x"), "x") == (0.0, pytest.approx(0.005), 3)
    flat = LinearFit()
    flat.add(1, 0.03)
    flat.add(10, 0.029)  # noise over a flat cost: a slightly negative slope
    assert fit(flat.gauges("x"), "x") == (pytest.approx(0.0295), 0.0, 2)
    assert fit({}, "x") == (0.0, 0.0, 0)
