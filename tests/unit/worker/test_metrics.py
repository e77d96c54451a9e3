"""WorkerMetrics: every metric is exposed, labels stay bounded, registries stay apart."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.metric_names import (
    DLQ_REASONS,
    HISTOGRAM_NAMES,
    MAX_OPEN_LABEL_VALUES,
    METRIC_NAMES,
    OVERFLOW_LABEL_VALUE,
    REQUEST_KINDS,
)
from worker.metrics import WorkerMetrics


def exercise(metrics: WorkerMetrics) -> None:
    """Call each method once, with realistic values."""
    metrics.set_worker_info(worker_id="worker-0", model="smollm2", version="0.1.0")
    metrics.observe_step(
        num_seqs=12,
        num_scheduled_tokens=768,
        token_budget=1024,
        stall_s=0.004,
        kv_cache_usage=0.6,
        num_running=12,
        num_waiting=3,
        num_preemptions=1,
        prefix_cache_hit_rate=0.42,
    )
    metrics.set_cluster_kv_cache_hit_rate(0.37)
    metrics.observe_request_finished(
        kind="chat",
        status="ok",
        prompt_tokens=120,
        completion_tokens=40,
        cached_tokens=64,
        queue_s=0.02,
        ttft_s=0.15,
        tpot_s=0.03,
        e2e_s=1.4,
    )
    metrics.observe_batch_flush(bucket=2, padding_tokens=17)
    metrics.set_consumer_lag("infinilm.requests.chat", 5)
    metrics.inc_dlq("bad_request")
    metrics.inc_kafka_transaction("committed")
    metrics.inc_redis_error("hset")
    metrics.set_redis_up(True)
    metrics.inc_rule_violation("no_refund_promise")
    metrics.observe_gc(collected=120, seconds=0.0008)
    metrics.observe_speculation(draft_tokens=40, accepted_tokens=30)
    metrics.observe_step_tokens("asr", 4)


def exposed_samples(registry: CollectorRegistry) -> dict[str, list]:
    text = generate_latest(registry).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matches = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_every_metric_name_is_exposed_after_one_observation_each():
    metrics = WorkerMetrics()
    exercise(metrics)
    samples = exposed_samples(metrics.registry)
    for name in METRIC_NAMES:
        if name in HISTOGRAM_NAMES:
            for suffix in ("_bucket", "_sum", "_count"):
                assert name + suffix in samples, name + suffix
        else:
            assert name in samples, name
    exposed = {n for n in samples if n.startswith("infinilm_") and not n.endswith("_created")}
    declared = set(METRIC_NAMES) | {h + s for h in HISTOGRAM_NAMES for s in ("_bucket", "_sum", "_count")}
    assert exposed <= declared, f"exposed but not in METRIC_NAMES: {sorted(exposed - declared)}"


def test_observations_land_in_the_right_series():
    metrics = WorkerMetrics()
    exercise(metrics)
    s = exposed_samples(metrics.registry)
    assert value(s, "infinilm_batch_utilization") == pytest.approx(0.75)
    assert value(s, "infinilm_kv_cache_hit_rate") == pytest.approx(0.42)
    assert value(s, "infinilm_requests_total", kind="chat", status="ok") == 1
    assert value(s, "infinilm_requests_total", kind="asr", status="ok") == 0
    assert value(s, "infinilm_prompt_tokens_total", kind="chat") == 120
    assert value(s, "infinilm_cached_prompt_tokens_total", kind="chat") == 64
    assert value(s, "infinilm_pipeline_stall_sum") == pytest.approx(0.004)
    assert value(s, "infinilm_pipeline_stall_bucket", le="0.005") == 1
    assert value(s, "infinilm_pipeline_stall_bucket", le="0.0025") == 0
    assert value(s, "infinilm_time_to_first_token_seconds_count", kind="chat") == 1
    assert value(s, "infinilm_batches_total", bucket="2") == 1
    assert value(s, "infinilm_batches_total", bucket="fifo") == 0
    assert value(s, "infinilm_padding_tokens_total") == 17
    assert value(s, "infinilm_consumer_lag", topic="infinilm.requests.chat") == 5
    assert value(s, "infinilm_redis_up") == 1
    assert value(s, "infinilm_gc_collected_objects_total") == 120
    assert value(s, "infinilm_gc_pause_seconds_bucket", le="0.001") == 1
    assert value(s, "infinilm_gc_pause_seconds_bucket", le="0.0005") == 0
    assert value(s, "infinilm_spec_acceptance_rate") == pytest.approx(0.75)
    assert value(s, "infinilm_spec_accepted_tokens_total") == 30
    assert value(s, "infinilm_spec_tokens_per_step_bucket", kind="asr", le="4.0") == 1
    assert value(s, "infinilm_spec_tokens_per_step_bucket", kind="asr", le="3.0") == 0
    info = value(s, "infinilm_worker_info", worker_id="worker-0", model="smollm2", version="0.1.0")
    assert info == 1


def test_counters_start_at_zero_for_every_fixed_label_value():
    s = exposed_samples(WorkerMetrics().registry)
    for kind in REQUEST_KINDS:
        assert value(s, "infinilm_requests_total", kind=kind, status="ok") == 0
    for reason in DLQ_REASONS:
        assert value(s, "infinilm_dlq_records_total", reason=reason) == 0
    assert value(s, "infinilm_redis_up") == 0  # unknown until the first successful call


def test_error_result_without_latencies_counts_but_observes_nothing():
    metrics = WorkerMetrics()
    metrics.observe_request_finished(kind="risk", status="prompt_too_long", prompt_tokens=9000)
    s = exposed_samples(metrics.registry)
    assert value(s, "infinilm_requests_total", kind="risk", status="prompt_too_long") == 1
    assert "infinilm_e2e_request_latency_seconds_count" not in s


def test_ratios_are_clamped_and_zero_budget_is_safe():
    metrics = WorkerMetrics()
    metrics.observe_step(
        num_seqs=0,
        num_scheduled_tokens=0,
        token_budget=0,
        stall_s=-1.0,
        kv_cache_usage=1.3,
        num_running=0,
        num_waiting=0,
    )
    s = exposed_samples(metrics.registry)
    assert value(s, "infinilm_batch_utilization") == 0
    assert value(s, "infinilm_kv_cache_usage_ratio") == 1
    assert value(s, "infinilm_pipeline_stall_sum") == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_request_finished(kind="chat", status="req-1234"),
        lambda m: m.observe_request_finished(kind="vision", status="ok"),
        lambda m: m.inc_dlq("something new"),
        lambda m: m.inc_kafka_transaction("maybe"),
        lambda m: m.observe_batch_flush(bucket=5),
    ],
)
def test_unbounded_label_values_are_rejected(call):
    with pytest.raises(ValueError):
        call(WorkerMetrics())


def test_open_label_values_that_are_not_identifiers_count_as_other():
    metrics = WorkerMetrics()
    metrics.inc_rule_violation("a prompt's text, not a rule id")
    s = exposed_samples(metrics.registry)
    assert value(s, "infinilm_rule_violations_total", rule="other") == 1


def test_open_labels_overflow_into_other():
    metrics = WorkerMetrics()
    for i in range(MAX_OPEN_LABEL_VALUES + 5):
        metrics.inc_redis_error(f"op{i}")
    s = exposed_samples(metrics.registry)
    ops = {sample.labels["op"] for sample in s["infinilm_redis_errors_total"]}
    assert len(ops) == MAX_OPEN_LABEL_VALUES + 1
    assert value(s, "infinilm_redis_errors_total", op=OVERFLOW_LABEL_VALUE) == 5


def test_two_instances_with_separate_registries_do_not_clash():
    first, second = WorkerMetrics(CollectorRegistry()), WorkerMetrics(CollectorRegistry())
    exercise(first)
    s_first, s_second = exposed_samples(first.registry), exposed_samples(second.registry)
    assert value(s_first, "infinilm_requests_total", kind="chat", status="ok") == 1
    assert value(s_second, "infinilm_requests_total", kind="chat", status="ok") == 0


def test_default_registry_is_private():
    # Two default-constructed instances would raise "Duplicated timeseries" on a shared registry.
    assert WorkerMetrics().registry is not WorkerMetrics().registry
