"""Health: /healthz and /readyz, and periodic self-reports. (The load in each Redis
heartbeat is EngineLoop.load.)

The housekeeping task runs every few seconds: the partitions' watchdog, a garbage
collection of reference cycles, consumer lag and the cluster's KV hit rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from worker.engine_loop import EngineLoop
from worker.inflight import InFlightTable
from worker.memory import collect_cycles
from worker.metrics import WorkerMetrics
from worker.partitions import Partitions

HOUSEKEEPING_INTERVAL_S = 5.0


class Health:
    def __init__(self, *, engine_loop: EngineLoop, consumer: AIOKafkaConsumer, partitions: Partitions,
                 table: InFlightTable, redis, metrics: WorkerMetrics,
                 working: Callable[[TopicPartition], set[int]] | None = None) -> None:
        """`redis`: worker.state.RedisState; `working`: a partition's offsets whose requests are being
        worked on (prepared, batched or generated), for the stall check; the in-flight table's if None."""
        self.working = working if working is not None else (lambda tp: table.offsets(tp))
        self.engine_loop = engine_loop
        self.consumer = consumer
        self.partitions = partitions
        self.table = table
        self.redis = redis
        self.metrics = metrics

    def healthz(self) -> tuple[bool, dict]:
        alive = self.engine_loop.alive
        return alive, {"engine_thread": alive}

    def readyz(self) -> tuple[bool, dict]:
        alive = self.engine_loop.alive
        started = self.partitions.active  # the worker's Kafka clients and tasks run
        detail = {
            "engine_thread": alive,
            "kafka_started": started,
            "assigned_partitions": len(self.consumer.assignment()),
            "redis": "ok" if self.redis.healthy else "degraded",
            "in_flight": len(self.table),
            "paused": self.partitions.paused,
            "partitions_awaiting_setup": len(self.partitions.awaiting_setup),
        }
        # Redis down degrades the service but does not make it unready.
        return alive and started, detail

    async def consumer_lags(self) -> dict[str, int]:
        """Per topic, the records of this worker's partitions not yet answered and committed: those not
        fetched yet, and those taken but not released (in flight, or held behind an earlier record)."""
        lags: dict[str, int] = {}
        for tp in list(self.consumer.assignment()):
            try:
                high = self.consumer.highwater(tp)
                pos = await self.consumer.position(tp)
            except Exception:
                continue
            if high is not None:
                tracker = self.partitions.trackers.get(tp)
                taken = tracker.in_flight if tracker is not None else 0
                lags[tp.topic] = lags.get(tp.topic, 0) + max(0, high - pos) + taken
        return lags

    async def check_progress(self) -> None:
        """Resync the partitions that stalled (Partitions.check_progress), from positions read here and
        end offsets asked of the broker; a broker that does not answer skips the fetch check."""
        tps = list(self.partitions.trackers)
        positions: dict[TopicPartition, int] = {}
        ends: dict[TopicPartition, int] = {}
        with contextlib.suppress(Exception):
            async with asyncio.timeout(HOUSEKEEPING_INTERVAL_S):
                for tp in tps:
                    with contextlib.suppress(KafkaError):  # revoked meanwhile
                        positions[tp] = await self.consumer.position(tp)
                ends = await self.consumer.end_offsets(tps) if tps else {}
        for _tp, reason in await self.partitions.check_progress(time.monotonic(), positions, ends, self.working):
            self.metrics.inc_partition_stall(reason)

    async def run_housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            self.partitions.watchdog(time.monotonic())
            await self.check_progress()
            # Dropped fetch buffers are reference cycles that pin whole fetch responses (worker/memory.py).
            self.metrics.observe_gc(*collect_cycles())
            for topic, lag in (await self.consumer_lags()).items():
                self.metrics.set_consumer_lag(topic, lag)
            with contextlib.suppress(Exception):
                rate = await self.redis.cluster_hit_rate()
                if rate is not None:
                    self.metrics.set_cluster_kv_cache_hit_rate(rate)
