"""The stall watchdog against the real broker: a partition left paused with records waiting is found
through the consumer's real positions and the broker's end offsets, and set up again, after which its
records are fetched. (tests/unit/worker/test_partition_setup.py has the decision table, with fakes.)"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import CollectorRegistry

from worker.config import ServiceConfig
from worker.health import Health
from worker.metrics import WorkerMetrics
from worker.partitions import Partitions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class NoProducers:
    """Stands in for the transactional publisher: this test publishes nothing."""

    async def add_partitions(self, tps):
        return []

    async def remove_partitions(self, tps) -> None:
        pass

    def busy(self, now=None):
        return []


async def _a_partition_left_paused_with_records_waiting_is_set_up_again(bootstrap: str, topic: str, group: str):
    tp = TopicPartition(topic, 0)
    async with AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all") as producer:
        for i in range(5):
            await producer.send_and_wait(topic, b"r%d" % i, partition=0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([tp])
        config = ServiceConfig()
        config = msgspec.structs.replace(config, worker=msgspec.structs.replace(config.worker, stall_resync_s=5.0))
        partitions = Partitions(consumer, NoProducers(), config, asyncio.Event(), forget_work=lambda tp: 0)
        partitions.active = True
        await partitions.on_assigned({tp})
        assert tp in partitions.trackers and await consumer.position(tp) == 0
        consumer.pause(tp)  # the wedge: nothing resumes it, and the five records wait
        metrics = WorkerMetrics(CollectorRegistry())
        health = Health(engine_loop=None, consumer=consumer, partitions=partitions, table=None, redis=None,
                        metrics=metrics, working=lambda tp: set())
        stalls = 0.0
        for _ in range(30):
            await health.check_progress()
            stalls = metrics.registry.get_sample_value("infinilm_partition_stalls_total", {"reason": "not_fetching"})
            if stalls:
                break
            await asyncio.sleep(0.5)
        assert stalls == 1 and tp in partitions.awaiting_setup and tp not in partitions.trackers
        partitions.retry_setups()
        await partitions.setup_retry
        assert tp in partitions.trackers and tp not in consumer.paused()
        fetched = await consumer.getmany(tp, timeout_ms=10_000)
        assert [r.value for r in fetched.get(tp, [])] == [b"r%d" % i for i in range(5)]
    finally:
        await consumer.stop()


def test_a_partition_left_paused_with_records_waiting_is_set_up_again(kafka_bootstrap, make_topic, unique_name):
    asyncio.run(asyncio.wait_for(
        _a_partition_left_paused_with_records_waiting_is_set_up_again(
            kafka_bootstrap, make_topic("stall", partitions=1), unique_name("group")),
        timeout=60))
