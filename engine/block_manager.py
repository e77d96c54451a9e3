"""Paged KV blocks, their reference counts and the prefix cache.

The block manager alone owns this state; the scheduler sees only block ids.

Prefix cache: each full block is keyed by a chained hash over (parent hash,
token ids, extra key). The extra key holds the content hash of every image
whose positions the block covers, so blocks after an image differ too. On a hash match the token ids are compared too, so a
hash collision can never hand a request someone else's KV. A block whose
reference count drops to zero keeps its hash and joins the tail of the free
queue; allocation takes from the head, so cached blocks are evicted in LRU
order, and only then lose their hash (a BlockRemoved event).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.request import Request

_NO_PARENT = 0x9E3779B97F4A7C15  # stands in for "no parent" so the first block also has a seed


def hash_block(parent_hash: int | None, token_ids: list[int], extra_key: bytes = b"") -> int:
    """Chained 64-bit block hash (xxh3) over parent hash, token ids and extra key."""
    h = xxhash.xxh3_64(seed=_NO_PARENT if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(extra_key)
    return h.intdigest()


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the head goes first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        self.deterministic_chunk = 256  # grid of deterministic prefills (the engine sets it)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found cached

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def free_queue(self) -> list[int]:
        """Free block ids in the order they would be reused (tests use this)."""
        return list(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a full block in the prefix cache, in use or free."""
        return len(self._cached)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ---- prefix cache --------------------------------------------------
    def compute_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens."""
        bs = self.block_size
        mask = request.mask
        # Deterministic requests reuse only KV that deterministic prefills computed.
        det = b"det:%d" % self.deterministic_chunk if request.params.deterministic else b""
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_known_tokens // bs):
            parent = hashes[-1] if hashes else None
            extra = mask.block_key((i + 1) * bs, request.token_ids) + det
            if request.images:
                extra += request.image_key(i * bs, (i + 1) * bs)
            if det and (i + 1) * bs > request.num_prompt_tokens:
                # Rows written by decode steps have other numerics than a prefill of the same
                # tokens would: keep them apart from prompt blocks.
                extra += b":gen"
            hashes.append(hash_block(parent, request.token_ids[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks that cover the longest prefix of the request's tokens.

        At least the last token is always left to compute, since its logits are
        needed to sample; a fully cached block-aligned prompt gives up its last block.
        """
        self.compute_block_hashes(request)
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        last_needed = request.num_tokens - 1
        if request.params.score_positions:
            # The row before each scored token must be computed, not taken from the cache.
            last_needed = min(last_needed, min(request.params.score_positions) - 1)
        if request.params.deterministic:
            # Resume only on the deterministic grid, so the rows after a hit are grouped
            # exactly as in a cold run.
            last_needed = last_needed // self.deterministic_chunk * self.deterministic_chunk
        max_blocks = last_needed // bs
        hits: list[int] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            if self._blocks[block_id].token_ids != tuple(request.token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: never share KV of other tokens
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted request's prefix lookup for the hit rate."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_cached

    def register_full_blocks(self, request: Request) -> None:
        """Offer the request's newly completed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # A row computed for a pending (PLACEHOLDER) token waits until its token is known.
        num_full = min(min(request.num_computed_tokens, request.num_known_tokens) // bs, len(request.block_ids))
        if num_full <= request.num_registered_blocks:
            return
        self.compute_block_hashes(request)
        stored: list[int] = []
        start = request.num_registered_blocks
        for i in range(start, num_full):
            block = self._blocks[request.block_ids[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.token_ids = tuple(request.token_ids[i * bs:(i + 1) * bs])
                self._cached[block_hash] = block.block_id
                stored.append(block_hash)
        request.num_registered_blocks = num_full
        if stored:
            parent = request.block_hashes[start - 1] if start else None
            self._events.append(BlockStored(stored, parent, request.token_ids[start * bs:num_full * bs], bs))

    # ---- allocation ----------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        total = request.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids) - num_computed_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        # Touching a free cached block takes it out of the free queue.
        reclaimed = sum(1 for b in computed_blocks if self._blocks[b].ref_cnt == 0)
        return self.blocks_needed(request, num_new_tokens, len(computed_blocks)) <= len(self._free) - reclaimed

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any cached ones).

        Returns False, changing nothing, when the pool can't hold them.
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        needed = self.blocks_needed(request, num_new_tokens, len(computed_blocks))
        for block_id in computed_blocks:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1
        request.block_ids.extend(computed_blocks)
        if computed_blocks:
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_registered_blocks = len(request.block_ids)
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            self._evict(self._blocks[block_id])
            self._blocks[block_id].ref_cnt = 1
            request.block_ids.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Never cached: no reason to keep it, so reuse it before cached ones.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._blocks:
            block.block_hash, block.token_ids = None, None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def _evict(self, block: _Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        self._events.append(BlockRemoved([block.block_hash]))
        block.block_hash, block.token_ids = None, None
