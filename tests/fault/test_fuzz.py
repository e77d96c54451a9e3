"""Bad input at volume: 10,000 hypothesis-generated records into the request topics of a real worker.

Random bytes, JSON and msgpack of the wrong shape, near-miss requests (wrong
types, huge strings, deep nesting, NaN and inf, bad max_tokens, unicode edge
cases, empty lists), prompts over max_seq_len and oversized records: each must
get exactly one error result (by id) or one dead letter (by source offset) with
a reason code; the worker must not die, and its RSS must stay within 5% of its
size after the warm-up. One run serves both tests. The counts by code are
printed (run with -s) and, at bigger volume, reported by bench/chaos.py.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_tiny_model
from tests.fault.fleet import Site
from tests.fault.fuzz_run import RSS_LIMIT, fuzz

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fuzzed(stack_config, local_stack, redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fuzz")
    site = Site(stack_config, redis_url, str(write_tiny_model(workdir / "tiny-llama", "llama")), workdir)
    outcome = fuzz(site, total=10_000, seed=1)
    detail = {k: v for k, v in outcome.detail.items() if k != "rss_samples"}
    print(outcome.row())
    print(json.dumps({"codes": detail["codes"], "by_category": detail["by_category"],
                      "rss": {k: detail[k] for k in ("baseline_kb", "rss_after_round_kb", "rss_peak_kb", "final_kb",
                                                    "rss_growth")}}, indent=1))
    return outcome


def test_ten_thousand_bad_records_each_get_exactly_one_answer_and_no_worker_dies(fuzzed):
    detail = {k: v for k, v in fuzzed.detail.items() if k != "rss_samples"}
    assert detail["messages"] == 10_000
    assert not fuzzed.problems(), (fuzzed.problems(), detail)
    answered = sum(sum(c.values()) for c in detail["codes"].values())
    assert answered == 10_000
    # Only the control messages may succeed; everything else is answered with a reason.
    assert detail["codes"]["result"].get("ok", 0) == detail["by_category"]["valid"]


def test_worker_rss_stays_within_five_percent_after_warm_up(fuzzed):
    assert fuzzed.detail["rss_problem"] is None, (fuzzed.detail["rss_problem"], RSS_LIMIT)
    assert fuzzed.detail["rss_growth"] <= RSS_LIMIT
