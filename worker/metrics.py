"""Every Prometheus metric a worker exports, in one object.

`WorkerMetrics` builds all metrics against one registry, which tests inject
so that two workers (or two tests) never share state. The worker calls the
small typed methods below with plain numbers; nothing else in the code base
touches prometheus_client.

NOTE: label values are bounded. Request ids, prompts and other content never
become labels; one worker is told apart from another by Prometheus'
`instance` label. Labels with a fixed vocabulary (kind, status, DLQ reason,
batcher bucket, transaction outcome) reject unknown values with ValueError;
kinds and error codes come from schemas/, the rest are defined here, and each
value gets a zero series from the start.
Labels whose values come from configuration (topic, Redis operation, rule
name) are capped at `MAX_OPEN_LABEL_VALUES` distinct values; the rest are
counted under "other". The vocabulary itself (names, label values, buckets)
is in worker/metric_names.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from worker.metric_names import (
    BATCH_BUCKET_LABELS,
    DLQ_REASONS,
    E2E_BUCKETS,
    GC_PAUSE_BUCKETS,
    KAFKA_TRANSACTION_OUTCOMES,
    NUM_BATCH_BUCKETS,
    PARTITION_STALL_REASONS,
    PIPELINE_STALL_BUCKETS,
    QUEUE_BUCKETS,
    REQUEST_KINDS,
    REQUEST_STATUSES,
    SPEC_TOKENS_PER_STEP_BUCKETS,
    STEP_BATCH_SIZE_BUCKETS,
    TPOT_BUCKETS,
    TRUNCATED_FIELDS,
    TTFT_BUCKETS,
    OpenLabel,
    check_member,
    clamp_ratio,
)


class WorkerMetrics:
    """All metrics of one worker, built against `registry`.

    With no registry a fresh `CollectorRegistry` is used, never the global one,
    so constructing two instances never raises "Duplicated timeseries".
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._topic = OpenLabel("topic")
        self._redis_op = OpenLabel("op")
        self._rule = OpenLabel("rule")

        self.worker_info = Info("infinilm_worker", "Identity of this worker process.", registry=r)

        # The seed article's three metrics, with their names kept.
        self.batch_utilization = Gauge(
            "infinilm_batch_utilization",
            "Share (0..1) of the last engine step's token budget that scheduled tokens used.",
            registry=r,
        )
        self.kv_cache_hit_rate = Gauge(
            "infinilm_kv_cache_hit_rate",
            "The engine's own prefix-cache hit rate (0..1): cached prompt tokens over prompt tokens.",
            registry=r,
        )
        self.pipeline_stall = Histogram(
            "infinilm_pipeline_stall",
            "Seconds the compute loop (on a GPU: the device) waited, per engine step, while work was pending.",
            buckets=PIPELINE_STALL_BUCKETS,
            registry=r,
        )

        self.gc_pause = Histogram(
            "infinilm_gc_pause_seconds",
            "Seconds each timed full garbage collection, with the malloc_trim after it, held the worker's event loop "
            "(worker/memory.py).",
            buckets=GC_PAUSE_BUCKETS,
            registry=r,
        )
        self.gc_collected = Counter(
            "infinilm_gc_collected_objects_total",
            "Unreachable objects the timed full garbage collections freed.",
            registry=r,
        )

        self.cluster_kv_cache_hit_rate = Gauge(
            "infinilm_cluster_kv_cache_hit_rate",
            "Cluster-wide prefix-cache hit rate (0..1), computed from the shared Redis prefix index.",
            registry=r,
        )
        self.step_batch_size = Histogram(
            "infinilm_step_batch_size",
            "Sequences scheduled per engine step.",
            buckets=STEP_BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "infinilm_kv_cache_usage_ratio",
            "Share (0..1) of KV blocks held by requests; evictable prefix-cache blocks count as free.",
            registry=r,
        )
        self.num_running = Gauge(
            "infinilm_num_requests_running", "Requests in the engine's running set.", registry=r
        )
        self.num_waiting = Gauge(
            "infinilm_num_requests_waiting",
            "Requests accepted by the worker but not yet running in the engine.",
            registry=r,
        )
        self.preemptions = Counter(
            "infinilm_preemptions_total",
            "Requests preempted because KV blocks ran out (their prefix is recomputed later).",
            registry=r,
        )

        self.requests = Counter(
            "infinilm_requests_total",
            "Requests answered, by kind and status ('ok' or an error code).",
            ["kind", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "infinilm_time_to_first_token_seconds",
            "Seconds from a request's arrival at the worker to its first generated token.",
            ["kind"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "infinilm_time_per_output_token_seconds",
            "Mean seconds per generated token after the first, one observation per request.",
            ["kind"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "infinilm_e2e_request_latency_seconds",
            "Seconds from a request's arrival at the worker to its final result being produced.",
            ["kind"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "infinilm_queue_time_seconds",
            "Seconds a request waited in the worker (batcher and engine queue) before its first step.",
            ["kind"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "infinilm_prompt_tokens_total", "Prompt tokens of answered requests.", ["kind"], registry=r
        )
        self.generation_tokens = Counter(
            "infinilm_generation_tokens_total",
            "Tokens generated for answered requests.",
            ["kind"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "infinilm_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache instead of being computed.",
            ["kind"],
            registry=r,
        )

        self.consumer_lag = Gauge(
            "infinilm_consumer_lag",
            "Messages between the committed offset and the log end, summed over this worker's partitions.",
            ["topic"],
            registry=r,
        )
        self.dlq_records = Counter(
            "infinilm_dlq_records_total",
            "Records written to the dead-letter topic, by the error code of their reason.",
            ["reason"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "infinilm_request_fields_ignored_total",
            "Requests that carried keys no field reads (reported in the result, or rejected), by kind.",
            ["kind"],
            registry=r,
        )
        self.results_truncated = Counter(
            "infinilm_results_truncated_total",
            "Results cut to fit one Kafka record (kafka.max_message_bytes), by kind and the field cut; "
            "one that could not be cut enough counts as status result_too_large in infinilm_requests_total.",
            ["kind", "field"],
            registry=r,
        )
        self.kafka_transactions = Counter(
            "infinilm_kafka_transactions_total",
            "Kafka producer transactions, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.partition_stalls = Counter(
            "infinilm_partition_stalls_total",
            "Partitions set up again because they had records waiting and made no progress, by reason.",
            ["reason"],
            registry=r,
        )
        self.redis_errors = Counter(
            "infinilm_redis_errors_total", "Failed Redis operations.", ["op"], registry=r
        )
        self.redis_up = Gauge(
            "infinilm_redis_up",
            "1 while Redis answers; 0 until the first successful call and while the worker runs degraded.",
            registry=r,
        )
        self.rule_violations = Counter(
            "infinilm_rule_violations_total",
            "Answers that broke a '##必须遵守:' constraint of the rule engine.",
            ["rule"],
            registry=r,
        )
        self.batches = Counter(
            "infinilm_batches_total",
            "Micro-batches flushed by the Dynamic Bucket batcher, by bucket index (or 'fifo').",
            ["bucket"],
            registry=r,
        )
        self.padding_tokens = Counter(
            "infinilm_padding_tokens_total",
            "Padding tokens the batcher's buckets added (work spent on nothing).",
            registry=r,
        )

        self.spec_acceptance_rate = Gauge(
            "infinilm_spec_acceptance_rate",
            "Share of speculative draft tokens that verification accepted, since the engine started.",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "infinilm_spec_draft_tokens_total", "Speculative draft tokens proposed.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "infinilm_spec_accepted_tokens_total", "Speculative draft tokens accepted.", registry=r
        )
        self.spec_tokens_per_step = Histogram(
            "infinilm_spec_tokens_per_step",
            "Tokens a request got from one engine step (above 1 only through accepted drafts).",
            ["kind"],
            buckets=SPEC_TOKENS_PER_STEP_BUCKETS,
            registry=r,
        )
        self._spec_seen = (0, 0)  # the engine's cumulative (draft, accepted) counts last observed

        self._initialise_series()

    def _initialise_series(self) -> None:
        # Series that exist from the start make rate() and increase() see the first event.
        for kind in REQUEST_KINDS:
            self.requests.labels(kind=kind, status="ok")
            self.prompt_tokens.labels(kind=kind)
            self.generation_tokens.labels(kind=kind)
            self.cached_prompt_tokens.labels(kind=kind)
            self.ignored_fields.labels(kind=kind)
        for kind, field in (("chat", "logprobs"), ("asr", "committed_text")):
            self.results_truncated.labels(kind=kind, field=field)
        for reason in DLQ_REASONS:
            self.dlq_records.labels(reason=reason)
        for reason in PARTITION_STALL_REASONS:
            self.partition_stalls.labels(reason=reason)
        for outcome in KAFKA_TRANSACTION_OUTCOMES:
            self.kafka_transactions.labels(outcome=outcome)
        for bucket in BATCH_BUCKET_LABELS:
            self.batches.labels(bucket=bucket)

    def declare_label_values(self, *, topics=(), redis_ops=(), rules=()) -> None:
        """Create the zero series of open labels known at start-up (topics, Redis ops, rule kinds),
        so dashboards and alerts see them before their first event."""
        for topic in topics:
            self.consumer_lag.labels(topic=self._topic(topic)).set(0)
        for op in redis_ops:
            self.redis_errors.labels(op=self._redis_op(op))
        for rule in rules:
            self.rule_violations.labels(rule=self._rule(rule))

    # -- identity ---------------------------------------------------------

    def set_worker_info(self, worker_id: str, model: str, version: str) -> None:
        self.worker_info.info({"worker_id": worker_id, "model": model, "version": version})

    # -- engine -----------------------------------------------------------

    def observe_step(
        self,
        *,
        num_seqs: int,
        num_scheduled_tokens: int,
        token_budget: int,
        stall_s: float,
        kv_cache_usage: float,
        num_running: int,
        num_waiting: int,
        num_preemptions: int = 0,
        prefix_cache_hit_rate: float | None = None,
    ) -> None:
        """Record one engine step.

        stall_s is how long the compute loop waited for work, or for its
        inputs, before this step while requests were pending; 0 when it did
        not wait. num_preemptions counts preemptions in this step only.
        """
        utilization = num_scheduled_tokens / token_budget if token_budget > 0 else 0.0
        self.batch_utilization.set(clamp_ratio(utilization))
        self.step_batch_size.observe(num_seqs)
        self.pipeline_stall.observe(max(0.0, stall_s))
        self.kv_cache_usage.set(clamp_ratio(kv_cache_usage))
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        if num_preemptions > 0:
            self.preemptions.inc(num_preemptions)
        if prefix_cache_hit_rate is not None:
            self.kv_cache_hit_rate.set(clamp_ratio(prefix_cache_hit_rate))

    def observe_speculation(self, draft_tokens: int, accepted_tokens: int) -> None:
        """The engine's cumulative draft and accepted token counts (EngineStats), after a step."""
        seen_draft, seen_accepted = self._spec_seen
        if draft_tokens >= seen_draft and accepted_tokens >= seen_accepted:  # else a new engine: start over
            self.spec_draft_tokens.inc(draft_tokens - seen_draft)
            self.spec_accepted_tokens.inc(accepted_tokens - seen_accepted)
        self._spec_seen = (draft_tokens, accepted_tokens)
        if draft_tokens:
            self.spec_acceptance_rate.set(clamp_ratio(accepted_tokens / draft_tokens))

    def observe_step_tokens(self, kind: str, num_tokens: int) -> None:
        """Tokens one request of `kind` got from one step."""
        self.spec_tokens_per_step.labels(kind=check_member("kind", kind, REQUEST_KINDS)).observe(num_tokens)

    def set_cluster_kv_cache_hit_rate(self, rate: float) -> None:
        self.cluster_kv_cache_hit_rate.set(clamp_ratio(rate))

    # -- requests ---------------------------------------------------------

    def observe_request_finished(
        self,
        kind: str,
        status: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        queue_s: float | None = None,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """Record a request that got its final result, successful or not.

        A latency that does not apply (no token was generated, or the request
        was rejected before it queued) is passed as None and not observed.
        """
        kind = check_member("kind", kind, REQUEST_KINDS)
        status = check_member("status", status, REQUEST_STATUSES)
        self.requests.labels(kind=kind, status=status).inc()
        if prompt_tokens > 0:
            self.prompt_tokens.labels(kind=kind).inc(prompt_tokens)
        if completion_tokens > 0:
            self.generation_tokens.labels(kind=kind).inc(completion_tokens)
        if cached_tokens > 0:
            self.cached_prompt_tokens.labels(kind=kind).inc(cached_tokens)
        for histogram, seconds in (
            (self.queue_time, queue_s),
            (self.ttft, ttft_s),
            (self.tpot, tpot_s),
            (self.e2e, e2e_s),
        ):
            if seconds is not None:
                histogram.labels(kind=kind).observe(max(0.0, seconds))

    # -- batcher ----------------------------------------------------------

    def observe_batch_flush(self, bucket: int | None, padding_tokens: int = 0) -> None:
        """Record one flushed micro-batch; bucket None means the FIFO path."""
        if bucket is None:
            label = "fifo"
        elif 0 <= bucket < NUM_BATCH_BUCKETS:
            label = str(bucket)
        else:
            raise ValueError(f"bucket={bucket!r} is outside 0..{NUM_BATCH_BUCKETS - 1}")
        self.batches.labels(bucket=label).inc()
        if padding_tokens > 0:
            self.padding_tokens.inc(padding_tokens)

    def observe_gc(self, collected: int, seconds: float) -> None:
        self.gc_collected.inc(max(0, collected))
        self.gc_pause.observe(max(0.0, seconds))

    # -- Kafka ------------------------------------------------------------

    def set_consumer_lag(self, topic: str, lag: int) -> None:
        self.consumer_lag.labels(topic=self._topic(topic)).set(max(0, lag))

    def inc_ignored_fields(self, kind: str) -> None:
        self.ignored_fields.labels(kind=check_member("kind", kind, REQUEST_KINDS)).inc()

    def inc_result_truncated(self, kind: str, field: str) -> None:
        self.results_truncated.labels(kind=check_member("kind", kind, REQUEST_KINDS),
                                      field=check_member("field", field, TRUNCATED_FIELDS)).inc()

    def inc_dlq(self, reason: str) -> None:
        self.dlq_records.labels(reason=check_member("reason", reason, DLQ_REASONS)).inc()

    def inc_kafka_transaction(self, outcome: str) -> None:
        outcome = check_member("outcome", outcome, KAFKA_TRANSACTION_OUTCOMES)
        self.kafka_transactions.labels(outcome=outcome).inc()

    def inc_partition_stall(self, reason: str) -> None:
        self.partition_stalls.labels(reason=check_member("reason", reason, PARTITION_STALL_REASONS)).inc()

    # -- Redis ------------------------------------------------------------

    def inc_redis_error(self, op: str) -> None:
        self.redis_errors.labels(op=self._redis_op(op)).inc()

    def set_redis_up(self, up: bool) -> None:
        self.redis_up.set(1 if up else 0)

    # -- rule engine ------------------------------------------------------

    def inc_rule_violation(self, rule: str) -> None:
        self.rule_violations.labels(rule=self._rule(rule)).inc()
