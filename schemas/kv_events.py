"""Wire forms of the engine's KV-cache events, for the shared prefix index.

The engine reports these as its own dataclasses; the worker converts them and
publishes a `KVEventBatch` (to Kafka or Redis) so an indexer can map block
hashes to the workers that hold them. Events are tagged by `type`.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from schemas.version import version_field


class _KVEventBase(msgspec.Struct, tag_field="type", frozen=True, omit_defaults=True, kw_only=True):
    pass


class BlockStored(_KVEventBase, tag="block_stored", kw_only=True):
    """Full blocks entered the prefix cache.

    `block_hashes` run in chain order; the first one's parent is
    `parent_block_hash` (None at the start of a sequence). Hashes are unsigned
    64-bit. `token_ids` are the blocks' tokens, concatenated (optional: the
    index needs only hashes). `lora_id` and `medium` (e.g. "gpu", "cpu") scope
    the blocks when a worker holds more than one kind.
    """

    type: ClassVar[str] = "block_stored"

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_KVEventBase, tag="block_removed", kw_only=True):
    """Blocks were evicted from the prefix cache."""

    type: ClassVar[str] = "block_removed"

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_KVEventBase, tag="all_blocks_cleared", kw_only=True):
    """The worker dropped its whole prefix cache (e.g. on restart or reset)."""

    type: ClassVar[str] = "all_blocks_cleared"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """The events of one engine step from one worker, in order.

    `ts_ms` is Unix epoch milliseconds. `model` scopes the hashes: the same
    tokens hash alike under every model, so an index shared by workers serving
    different models must not mix them.
    """

    v: int = version_field()
    worker: str
    ts_ms: int
    events: list[KVEvent]
    model: str = ""
