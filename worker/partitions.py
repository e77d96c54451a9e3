"""The partitions this worker owns: assign, revoke, set-up, fencing, pause, resume, watchdog.

`Partitions` owns each partition's tracker (worker.offsets), from its set-up until it is
revoked, lost or resynced; intake, completion and the flusher use the trackers it holds.
A partition is set up (producer, then position) before anything is taken from it, and
stays paused while it waits for that. All partitions pause while too much is in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from worker.offsets import PartitionTracker

log = structlog.get_logger("infinilm.worker")

STALL_LOG_AFTER_S = 10.0  # the watchdog reports a transaction or a set-up this old
STALL_LOG_EVERY_S = 30.0  # and again at most this often per partition


@dataclass
class SetUpWait:
    reason: str
    since: float
    retry_at: float


class Partitions:
    def __init__(self, consumer: AIOKafkaConsumer, publisher, config, stopping: asyncio.Event,
                 forget_work: Callable[[TopicPartition], int]) -> None:
        """`publisher`: the results publisher (it holds a producer per partition); `forget_work`:
        drops a partition's requests from intake and the in-flight table, returning how many."""
        self.consumer = consumer
        self.publisher = publisher
        self.config = config
        self._stopping = stopping
        self._forget_work = forget_work
        self.trackers: dict[TopicPartition, PartitionTracker] = {}
        # Assigned partitions not set up yet (no producer, no tracker), kept paused: their set-up
        # is in progress, failed, or waits after a fence or an unknown transaction outcome.
        self.awaiting_setup: dict[TopicPartition, SetUpWait] = {}
        self.paused = False
        self.active = False  # between the worker's start and its shutdown: flow control applies
        self._setup_lock = asyncio.Lock()  # set-ups and revocations one at a time
        self.setup_retry: asyncio.Task | None = None
        self._stall_logged: dict[tuple, float] = {}
        # Partitions with records waiting: what their progress looked like, and since when unchanged.
        self._progress: dict[TopicPartition, tuple[tuple, float]] = {}

    # ---- flow control --------------------------------------------------------
    def update_pause(self) -> None:
        if not self.active:
            return
        in_flight = sum(t.in_flight for t in self.trackers.values())
        limit = self.config.worker.max_inflight
        assigned = list(self.consumer.assignment())
        if not self.paused and in_flight >= limit:
            self.paused = True
            self.consumer.pause(*assigned)
            log.info("engine full: pausing partitions", in_flight=in_flight)
        elif self.paused and in_flight < limit * 0.75 and not self._stopping.is_set():
            self.paused = False
            self.consumer.resume(*(tp for tp in assigned if tp in self.trackers))

    def fetched_before_setup(self, tp: TopicPartition, offset: int) -> None:
        """A record came from a partition with no tracker: go back to it if the partition is ours.

        NOTE: aiokafka installs a new assignment, and may fetch for it, before on_assigned has
        finished starting the partition's producer. Skipping the record would lose it: the
        consumer's position has moved past it, and the next commit on this partition would cover
        it. Otherwise the partition was revoked while the fetch was in flight; its new owner reads it.
        """
        if tp not in self.consumer.assignment():
            return
        self.consumer.seek(tp, offset)
        self.consumer.pause(tp)
        if tp not in self.awaiting_setup:
            # on_assigned is on its way; the flush loop steps in only if it never comes.
            self.await_setup(tp, "assignment in progress", retry_in_s=5.0)
            log.info("partition not set up yet; will fetch again", partition=str(tp), offset=offset)

    # ---- assign and revoke ---------------------------------------------------
    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        t0 = time.monotonic()
        await self._set_up(assigned, "assigned")
        if self.paused or self._stopping.is_set():
            # Pausing is lost on reassignment; keep not fetching while full.
            self.consumer.pause(*assigned)
        log.info("partitions assigned", partitions=sorted(str(tp) for tp in assigned),
                 not_set_up=sorted(str(tp) for tp in assigned if tp not in self.trackers),
                 setup_s=round(time.monotonic() - t0, 3))

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Forget partitions whose finished results have been flushed (Rebalance does that first)."""
        dropped = 0
        async with self._setup_lock:  # a set-up in progress must not start a producer after this
            for tp in revoked:
                self.awaiting_setup.pop(tp, None)
                dropped += self.drop(tp)
            await self.publisher.remove_partitions(list(revoked))
        log.info("partitions revoked", partitions=sorted(str(tp) for tp in revoked), dropped_in_flight=dropped)

    def drop(self, tp: TopicPartition) -> int:
        """Forget a partition this worker no longer owns; returns how many in-flight requests it dropped
        (the partition's next owner redoes them from the committed offset)."""
        self.trackers.pop(tp, None)
        return self._forget_work(tp)

    def lost(self, tp: TopicPartition) -> None:
        """Fenced: another worker has set the partition up, so this one is a zombie that will be
        told by the next rebalance; in case the fencer was the zombie, this worker sets the
        partition up again if no rebalance comes first."""
        dropped = self.drop(tp)
        log.warning("partition lost to another worker", partition=str(tp), dropped_in_flight=dropped)
        self.await_setup(tp, "fenced by another producer", retry_in_s=self._fenced_retry_s())

    def resync(self, tp: TopicPartition, reason: str) -> None:
        """Set the partition up again from the committed offset: a transaction's outcome is unknown,
        or the partition stalled (check_progress)."""
        dropped = self.drop(tp)
        log.warning("resyncing partition: its in-flight work is dropped and redone from the committed offset",
                    partition=str(tp), reason=reason, dropped_in_flight=dropped)
        self.await_setup(tp, f"resync: {reason}", retry_in_s=0.0)

    # ---- set-up ---------------------------------------------------------------
    async def _set_up(self, tps, reason: str) -> None:
        """Take partitions on: start their producers, then seek to the group's committed offsets.

        NOTE: the order is what makes the offsets right. A producer's InitProducerId fences the
        partition's previous owner and finishes whatever transaction it left (committing a
        prepared one), so only after it does the committed offset cover every result already
        published. aiokafka reads committed offsets on assignment, concurrently with this, so
        the position is read again here. A partition that fails to set up stays paused in
        `awaiting_setup`, and the flush loop tries again.
        """
        async with self._setup_lock:
            tps = [tp for tp in sorted(tps) if tp in self.consumer.assignment() and tp not in self.trackers]
            if not tps:
                return
            failed = set(await self.publisher.add_partitions(tps))
            offsets = await self._committed_offsets([tp for tp in tps if tp not in failed])
            now = time.monotonic()
            for tp in tps:
                if tp not in self.consumer.assignment():
                    await self.publisher.remove_partitions([tp])  # revoked meanwhile
                elif tp in offsets and self._seek(tp, offsets[tp]):
                    self.trackers[tp] = PartitionTracker(tp.topic, tp.partition, start_offset=offsets[tp])
                    waited = self.awaiting_setup.pop(tp, None)
                    if waited is not None and now - waited.since > 1.0:
                        log.info("partition set up", partition=str(tp), after=waited.reason,
                                 waited_s=round(now - waited.since, 1))
                    if not (self.paused or self._stopping.is_set()):
                        self.consumer.resume(tp)
                else:
                    self.await_setup(tp, f"{reason}: set-up failed", retry_in_s=1.0)

    def _seek(self, tp: TopicPartition, committed: int | None) -> bool:
        """Move the position to `committed`; with nothing committed, to offset 0 (a resynced
        partition may have been read further). Below the log's start, 0 is out of range and the
        consumer's auto_offset_reset ("earliest") applies. No round trip: set-up must stay quick,
        as the group waits for it."""
        try:
            self.consumer.seek(tp, 0 if committed is None else committed)
            return True
        except KafkaError as exc:  # IllegalStateError: revoked meanwhile
            log.warning("could not set the position; will retry", partition=str(tp), error=repr(exc))
            return False

    async def _committed_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None: nothing committed yet); a
        partition whose offset could not be read is left out."""
        async def one(tp):
            async with asyncio.timeout(self.config.kafka.request_timeout_ms / 1000):
                return await self.consumer.committed(tp)

        outcomes = await asyncio.gather(*(one(tp) for tp in tps), return_exceptions=True)
        offsets = {}
        for tp, outcome in zip(tps, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                log.warning("could not read the committed offset; will retry", partition=str(tp), error=repr(outcome))
            else:
                offsets[tp] = outcome
        return offsets

    def await_setup(self, tp: TopicPartition, reason: str, retry_in_s: float) -> None:
        if tp not in self.consumer.assignment():
            return  # revoked: the next owner sets it up
        now = time.monotonic()
        wait = self.awaiting_setup.get(tp)
        if wait is None:
            self.awaiting_setup[tp] = SetUpWait(reason, now, now + retry_in_s)
        else:
            wait.reason, wait.retry_at = reason, now + retry_in_s
        self.consumer.pause(tp)

    def _fenced_retry_s(self) -> float:
        # Long enough for a rebalance to reach a zombie (session timeout), so the two do not fence in turn.
        return max(10.0, 2 * self.config.kafka.session_timeout_ms / 1000)

    def retry_setups(self) -> None:
        """Set up again, beside the flush loop, the partitions whose wait is over."""
        if self.setup_retry is not None and not self.setup_retry.done():
            return
        now = time.monotonic()
        due = [tp for tp, wait in self.awaiting_setup.items() if wait.retry_at <= now]
        if due:
            self.setup_retry = asyncio.create_task(self._set_up(due, "retry"), name="partition-setup")
            self.setup_retry.add_done_callback(_log_failure)

    # ---- watchdog -------------------------------------------------------------
    def watchdog(self, now: float) -> None:
        """Log what keeps a partition from progressing: a slow transaction or a set-up that waits."""
        seen = set()
        for tp, stage, age in self.publisher.busy(now):
            if age >= STALL_LOG_AFTER_S:
                seen.add(("txn", tp))
                self._log_stall(("txn", tp), now, "Kafka transaction is slow", partition=str(tp), stage=stage,
                                seconds=round(age, 1))
        for tp, wait in self.awaiting_setup.items():
            if now - wait.since >= STALL_LOG_AFTER_S:
                seen.add(("setup", tp))
                self._log_stall(("setup", tp), now, "partition is waiting to be set up", partition=str(tp),
                                reason=wait.reason, seconds=round(now - wait.since, 1))
        for key in set(self._stall_logged) - seen:
            del self._stall_logged[key]

    async def check_progress(self, now: float, positions: dict[TopicPartition, int],
                             ends: dict[TopicPartition, int],
                             working: Callable[[TopicPartition], set[int]]) -> list[tuple[TopicPartition, str]]:
        """Set up again each partition that has records waiting and has not moved for `stall_resync_s`.

        Waiting: taken records that nothing works on (no request of theirs is being prepared, batched or
        generated: `working` gives a partition's busy offsets), which would hold back every later offset
        for good; or records between the position (`positions`) and the end of the log (`ends`, the last
        stable offsets) that are not fetched while fetching is allowed. Neither happens by design, but a
        Kafka client can wedge a partition after an outage; setting it up again (a resync) redoes its
        uncommitted work from the committed offset, so nothing is lost or answered twice. A release being
        published is progress (bounded by the publish timeout): the clock runs on, but no stall is declared
        under it. Returns the partitions resynced, each with its reason (PARTITION_STALL_REASONS)."""
        if not self.active or self._stopping.is_set():
            self._progress.clear()
            return []
        limit = self.config.worker.stall_resync_s
        stalled = []
        for tp, tracker in list(self.trackers.items()):
            if tp in self.awaiting_setup:
                self._progress.pop(tp, None)
                continue
            busy = working(tp)
            orphans = [o for o in tracker.unfinished_offsets() if o not in busy]
            pos, end = positions.get(tp), ends.get(tp)
            # While the engine is full, not fetching is flow control, not a stall.
            unfetched = 0 if pos is None or end is None or self.paused else max(0, end - pos)
            if not orphans and not unfetched:
                self._progress.pop(tp, None)
                continue
            marker = (pos, tracker.next_offset, tracker.committed, tuple(orphans))
            seen = self._progress.get(tp)
            if seen is None or seen[0] != marker:
                self._progress[tp] = (marker, now)
                continue
            if now - seen[1] < limit or tracker.publishing:
                continue
            if orphans:
                reason, detail = "orphaned", f"{len(orphans)} taken records nothing works on (from offset {orphans[0]})"
            else:
                reason, detail = "not_fetching", f"{unfetched} records after offset {pos} not fetched"
            log.error("partition stalled; setting it up again", partition=str(tp), reason=reason, detail=detail,
                      seconds=round(now - seen[1], 1))
            del self._progress[tp]
            # NOTE: the producer goes first, as in a revocation (under the partition's transaction lock).
            # The set-up then starts a new one, whose InitProducerId finishes anything the old one left
            # before the committed offset is read; a kept producer would fence nothing, and a transaction
            # still committing could then cover offsets the new set-up reads again.
            await self.publisher.remove_partitions([tp])
            if self.trackers.get(tp) is not tracker:
                continue  # revoked or resynced meanwhile
            self.resync(tp, f"no progress for {now - seen[1]:.0f} s: {detail}")
            stalled.append((tp, reason))
        for tp in set(self._progress) - set(self.trackers):
            del self._progress[tp]
        return stalled

    def _log_stall(self, key: tuple, now: float, event: str, **fields) -> None:
        if now - self._stall_logged.get(key, -1e9) >= STALL_LOG_EVERY_S:
            self._stall_logged[key] = now
            log.warning(event, **fields)


class Rebalance(ConsumerRebalanceListener):
    """The consumer's rebalance listener: a revoked partition's finished results are flushed
    (`flush`) before the partition is given up."""

    def __init__(self, partitions: Partitions, flush: Callable[[list[TopicPartition]], Awaitable[None]]) -> None:
        self.partitions = partitions
        self.flush = flush

    async def on_partitions_revoked(self, revoked):
        revoked = set(revoked)
        if not revoked:
            return
        await self.flush(list(revoked))
        await self.partitions.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned):
        await self.partitions.on_assigned(set(assigned))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", task=task.get_name(), error=repr(task.exception()))
