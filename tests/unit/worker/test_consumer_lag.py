"""infinilm_consumer_lag counts what the group has not committed: records not fetched yet, and records
taken but not answered (in flight, or held behind an earlier record of their partition)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry

from worker.health import Health
from worker.metrics import WorkerMetrics
from worker.offsets import PartitionTracker


class Consumer:
    def __init__(self, ends: dict[TopicPartition, tuple[int, int]]) -> None:
        self.ends = ends  # tp -> (highwater, position)

    def assignment(self):
        return set(self.ends)

    def highwater(self, tp):
        return self.ends[tp][0]

    async def position(self, tp):
        return self.ends[tp][1]


def test_lag_counts_records_taken_but_not_answered():
    a, b = TopicPartition("chat", 0), TopicPartition("chat", 1)
    tracker = PartitionTracker("chat", 0, start_offset=10)
    for offset in (10, 11, 12):
        tracker.register(offset)
    tracker.complete(11, [])  # answered, but held behind offset 10
    tracker.complete(12, [])
    health = Health(engine_loop=None, consumer=Consumer({a: (20, 13), b: (5, 5)}),
                    partitions=SimpleNamespace(trackers={a: tracker}), table=None, redis=None, metrics=None)
    # Partition 0: 7 records not fetched, 3 taken and not released; partition 1: nothing.
    assert asyncio.run(health.consumer_lags()) == {"chat": 10}
    tracker.complete(10, [])
    tracker.release()
    assert asyncio.run(health.consumer_lags()) == {"chat": 7}


def test_the_stall_check_reads_positions_and_end_offsets_and_counts_each_resync():
    a, b = TopicPartition("chat", 0), TopicPartition("chat", 1)

    class Ends(Consumer):
        async def end_offsets(self, tps):
            return {tp: self.ends[tp][0] for tp in tps}

    seen = {}

    async def check_progress(now, positions, ends, working):
        seen.update(positions=positions, ends=ends, working=working(a))
        return [(a, "not_fetching")]

    metrics = WorkerMetrics(CollectorRegistry())
    health = Health(engine_loop=None, consumer=Ends({a: (20, 13), b: (5, 5)}),
                    partitions=SimpleNamespace(trackers={a: None, b: None}, check_progress=check_progress),
                    table=None, redis=None, metrics=metrics, working=lambda tp: {13})
    asyncio.run(health.check_progress())
    assert seen == {"positions": {a: 13, b: 5}, "ends": {a: 20, b: 5}, "working": {13}}
    assert metrics.registry.get_sample_value("infinilm_partition_stalls_total", {"reason": "not_fetching"}) == 1
