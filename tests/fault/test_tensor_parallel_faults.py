"""A tensor-parallel worker whose rank dies stops on its own, and its work is redelivered exactly once."""

from __future__ import annotations

import pytest

from tests.fault import tp_scenarios
from tests.fault.test_faults import check

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_killed_rank_stops_its_worker_and_loses_and_duplicates_nothing(site):
    outcome = tp_scenarios.rank_kill(site, requests=150, seed=11)
    check(outcome)
    assert outcome.detail["exit_code"] == 4 and outcome.detail["in_flight_at_kill"], outcome.detail
