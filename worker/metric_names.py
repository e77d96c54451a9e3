"""The worker's metric vocabulary: every metric name, the label values each label may take, and the
histogram buckets. worker/metrics.py builds the metrics from it; tests and the ops checks read it to
compare dashboards and alert rules against what a worker exports.
"""

from __future__ import annotations

import re

from schemas.errors import ErrorCode
from schemas.requests import KINDS

REQUEST_KINDS: tuple[str, ...] = KINDS

# "ok" or the stable error code of an error result (schemas.errors.ErrorCode).
REQUEST_STATUSES: tuple[str, ...] = ("ok", *(code.value for code in ErrorCode))

# A dead letter's reason is an ErrorInfo too, so its code labels the DLQ counter.
DLQ_REASONS: tuple[str, ...] = tuple(code.value for code in ErrorCode)

# The result fields worker.record_size may cut so that a result fits one Kafka record.
TRUNCATED_FIELDS: tuple[str, ...] = ("logprobs", "committed_text")

KAFKA_TRANSACTION_OUTCOMES: tuple[str, ...] = ("committed", "aborted", "fenced", "timed_out")

# Why the watchdog set a partition up again (worker.partitions.Partitions.check_progress): records taken
# that nothing works on, or records in the log that are not being fetched.
PARTITION_STALL_REASONS: tuple[str, ...] = ("orphaned", "not_fetching")

# The Dynamic Bucket batcher has buckets max_seq_len / 2**i for i = 0..4, and a
# plain FIFO path when bucketing is off.
NUM_BATCH_BUCKETS = 5
BATCH_BUCKET_LABELS: tuple[str, ...] = (*(str(i) for i in range(NUM_BATCH_BUCKETS)), "fifo")

MAX_OPEN_LABEL_VALUES = 32
OVERFLOW_LABEL_VALUE = "other"
# Kafka topic names go up to 249 characters of this alphabet.
_OPEN_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,249}$")

# Buckets, in seconds unless the name says otherwise.
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PIPELINE_STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
# Tokens one request gets from one engine step: 1 without speculative decoding, up to k + 1 with it.
SPEC_TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)

# Histogram base names; PromQL sees them with _bucket, _sum and _count.
HISTOGRAM_NAMES: tuple[str, ...] = (
    "infinilm_pipeline_stall",
    "infinilm_step_batch_size",
    "infinilm_time_to_first_token_seconds",
    "infinilm_time_per_output_token_seconds",
    "infinilm_e2e_request_latency_seconds",
    "infinilm_queue_time_seconds",
    "infinilm_gc_pause_seconds",
    "infinilm_spec_tokens_per_step",
)

# Every metric, by the name PromQL uses: counters with _total, the info metric
# with _info, histograms by their base name.
METRIC_NAMES: tuple[str, ...] = (
    "infinilm_worker_info",
    "infinilm_batch_utilization",
    "infinilm_kv_cache_hit_rate",
    "infinilm_cluster_kv_cache_hit_rate",
    "infinilm_kv_cache_usage_ratio",
    "infinilm_num_requests_running",
    "infinilm_num_requests_waiting",
    "infinilm_preemptions_total",
    "infinilm_requests_total",
    "infinilm_prompt_tokens_total",
    "infinilm_generation_tokens_total",
    "infinilm_cached_prompt_tokens_total",
    "infinilm_consumer_lag",
    "infinilm_dlq_records_total",
    "infinilm_request_fields_ignored_total",
    "infinilm_results_truncated_total",
    "infinilm_redis_errors_total",
    "infinilm_redis_up",
    "infinilm_rule_violations_total",
    "infinilm_kafka_transactions_total",
    "infinilm_partition_stalls_total",
    "infinilm_batches_total",
    "infinilm_padding_tokens_total",
    "infinilm_gc_collected_objects_total",
    "infinilm_spec_acceptance_rate",
    "infinilm_spec_draft_tokens_total",
    "infinilm_spec_accepted_tokens_total",
    *HISTOGRAM_NAMES,
)


def check_member(label: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{label}={value!r} is not one of {allowed}")
    return value


class OpenLabel:
    """Caps the distinct values of a label whose vocabulary comes from config."""

    def __init__(self, name: str, limit: int = MAX_OPEN_LABEL_VALUES) -> None:
        self._name = name
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        # A metric call must never fail the caller: odd values count as "other".
        if not _OPEN_LABEL_VALUE.match(value) or len(self._seen) >= self._limit:
            return OVERFLOW_LABEL_VALUE
        self._seen.add(value)
        return value


def clamp_ratio(value: float) -> float:
    return min(1.0, max(0.0, float(value)))
