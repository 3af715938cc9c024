"""The soak report's arithmetic: growth per hour after the warm-up, and the p99 drift
from the first tenth of a run to the last."""

from __future__ import annotations

import math
import os

import pytest

from sgl_pd.cluster.soak import growth_pct_per_hour, p99_drift, tree_sample


def test_growth_is_the_slope_after_the_warm_up_in_percent_of_the_mean_per_hour() -> None:
    times = [60.0 * i for i in range(61)]  # an hour, a sample a minute
    # 10 minutes of filling caches (+50%), then 1% of 1 GB an hour
    values = [
        1e9 * (1 + 0.5 * t / 600) if t < 600 else 1.5e9 + 1.5e7 * (t - 600) / 3600 for t in times
    ]
    growth = growth_pct_per_hour(times, values)
    assert math.isclose(growth, 100 * 1.5e7 / 1.5e9, rel_tol=0.02)
    assert growth_pct_per_hour(times, [7.0] * len(times)) == pytest.approx(0.0, abs=1e-9)
    assert math.isnan(growth_pct_per_hour([0.0, 1.0], [1.0, 2.0]))  # too few samples


def test_drift_compares_the_last_tenth_of_the_run_with_the_first() -> None:
    starts = [float(i) for i in range(100)]
    steady = [[0.1, 0.1]] * 100
    assert p99_drift(starts, steady) == pytest.approx(1.0)
    slower = [[0.1]] * 90 + [[0.3]] * 10
    assert p99_drift(starts, slower) == pytest.approx(3.0)
    assert math.isnan(p99_drift([], []))


def test_a_process_tree_is_read_whole() -> None:
    sample = tree_sample(os.getpid())
    assert sample.rss_bytes > 0 and sample.threads >= 1 and sample.fds >= 3
