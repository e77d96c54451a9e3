"""A two-minute soak at a steady rate: no errors, nothing lost or duplicated, worker memory bounded.

bench/soak.py runs the same for 20 minutes (or --minutes) and prints the per-minute table.
"""

from __future__ import annotations

import pytest

from tests.fault.soak_run import soak

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

# From the end of the first minute (engine warm, caches filled) to the end of the run.
MAX_RSS_GROWTH = 0.10


def test_two_minute_soak_has_no_errors_no_loss_and_bounded_memory(site):
    report = soak(site, minutes=2.0, rate=4.0, workers=2)
    for row in report.rows():
        print(row)
    outcome = report.outcome
    assert not outcome.problems(), (outcome.problems(), outcome.detail)
    assert sum(m["answered"] for m in report.minutes) == 480
    assert report.rss_growth <= MAX_RSS_GROWTH, report.minutes
