"""Per-partition bookkeeping of consumed offsets and their finished outputs.

NOTE: an offset may be committed only together with (or after) the outputs of
every record before it. Requests finish out of order, so each partition keeps
its finished outputs until the contiguous prefix is done; then the outputs of
that prefix and the offset after it are released as one unit, which the
publisher writes in one Kafka transaction. A crash before the commit
redelivers exactly the records whose outputs were not committed.

NOTE: a partition has at most one release being published at a time. `restore` puts
back exactly that release, so a second one taken meanwhile (a rebalance's or a
shutdown's flush beside the flush loop) would make it rewind over offsets that
the second release still carries, and a commit of the second would then skip
the first's outputs.

NOTE: a release lists its outputs in the order they were completed, not by
offset. An ASR chunk that arrived before its predecessor waits for it, so it
completes after it even though its offset is lower; completion order is what
keeps one stream's results in seq order on the results topic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutRecord:
    """One record to produce: topic, key, value and headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass
class Release:
    """Outputs ready to publish for one partition and the offset to commit with them."""

    topic: str
    partition: int
    records: list[OutRecord]
    commit_offset: int  # the next offset to consume, as Kafka expects
    offsets: list[int] = field(default_factory=list)


class PartitionTracker:
    """Tracks one input partition. Offsets are registered in consumption order."""

    def __init__(self, topic: str, partition: int, start_offset: int | None = None) -> None:
        self.topic = topic
        self.partition = partition
        # The lowest offset not taken yet: the committed offset the partition was set up at, then
        # one past the last registered. Records below it are re-fetches and are skipped.
        self.next_offset = start_offset or 0
        self._pending: dict[int, list[OutRecord] | None] = {}  # offset -> outputs when done
        self._completed_at: dict[int, int] = {}  # offset -> its place in completion order
        self._completions = 0
        self._order: list[int] = []  # registered offsets, ascending
        self._head = 0  # index into _order of the first offset not yet released
        self.committed: int | None = None  # last commit_offset handed out
        self._outstanding: Release | None = None  # taken by release(), not yet committed or restored

    def register(self, offset: int) -> None:
        if self._order and offset <= self._order[-1]:
            raise ValueError(f"{self.topic}[{self.partition}]: offset {offset} registered out of order")
        self._pending[offset] = None
        self._order.append(offset)
        self.next_offset = offset + 1

    def awaits(self, offset: int) -> bool:
        """Whether `offset` is registered here and not completed yet (a result for it is wanted)."""
        return offset in self._pending and self._pending[offset] is None

    def complete(self, offset: int, records: Iterable[OutRecord]) -> None:
        if offset not in self._pending:
            raise KeyError(f"{self.topic}[{self.partition}]: offset {offset} was never registered")
        if self._pending[offset] is not None:
            raise ValueError(f"{self.topic}[{self.partition}]: offset {offset} completed twice")
        self._pending[offset] = list(records)
        self._completed_at[offset] = self._completions
        self._completions += 1

    def release(self) -> Release | None:
        """Take the outputs of the longest done prefix; None when nothing new is done, or while the
        previous release is still being published (see `publishing`)."""
        if self._outstanding is not None:
            return None
        offsets: list[int] = []
        i = self._head
        while i < len(self._order) and self._pending[self._order[i]] is not None:
            offsets.append(self._order[i])
            i += 1
        if not offsets:
            return None
        records: list[OutRecord] = []
        for off in sorted(offsets, key=self._completed_at.__getitem__):
            records.extend(self._pending.pop(off))
            del self._completed_at[off]
        self._head = i
        self._outstanding = Release(self.topic, self.partition, records, offsets[-1] + 1, offsets)
        return self._outstanding

    @property
    def publishing(self) -> bool:
        """A release was taken and is neither committed nor restored yet."""
        return self._outstanding is not None

    def _settle(self, release: Release) -> None:
        if release is not self._outstanding:
            raise ValueError(f"{self.topic}[{self.partition}]: not the release being published")
        self._outstanding = None

    def mark_committed(self, release: Release) -> None:
        self._settle(release)
        self.committed = release.commit_offset
        if self._head > 1024:  # keep the list short without shifting on every release; restore() needs none
            self._order = self._order[self._head:]
            self._head = 0

    def restore(self, release: Release) -> None:
        """Put a release back after a failed publish, so the next flush retries it."""
        self._settle(release)
        self._head -= len(release.offsets)
        for off in release.offsets:
            self._pending[off] = []
            self._completed_at[off] = -1  # before anything completed since
        # All the records go back on the first offset, in their order: they are published together anyway.
        self._pending[release.offsets[0]] = list(release.records)

    @property
    def in_flight(self) -> int:
        """Registered offsets not yet released."""
        return len(self._order) - self._head

    def unfinished_offsets(self) -> list[int]:
        return [o for o in self._order[self._head:] if self._pending.get(o) is None]
