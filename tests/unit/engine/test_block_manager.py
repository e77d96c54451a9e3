"""Exact tests of block ids, reference counts, prefix hits and LRU eviction order."""

from __future__ import annotations

from engine.attention.metadata import MaskSpec
from engine.block_manager import BlockManager, hash_block
from engine.kv_events import BlockRemoved, BlockStored
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], mask: MaskSpec | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), frozenset({2}), mask or MaskSpec())


def run_prefill(bm: BlockManager, req: Request) -> list[int]:
    """Allocate like the scheduler does, mark all tokens computed, register full blocks."""
    computed = bm.get_computed_blocks(req)
    num_cached = len(computed) * BS
    assert bm.allocate(req, req.num_tokens - num_cached, computed)
    bm.record_lookup(req.num_tokens, num_cached)
    req.num_computed_tokens = req.num_tokens
    bm.register_full_blocks(req)
    return computed


def test_allocation_takes_blocks_in_order_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10, 20)))  # 10 tokens -> 3 blocks
    run_prefill(bm, req)
    assert req.block_ids == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == 3 / 8


def test_prefix_hit_shares_blocks_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10, 22)))  # 12 tokens = 3 full blocks
    run_prefill(bm, a)
    b = make_request("b", list(range(10, 22)))
    computed = run_prefill(bm, b)
    # Fully cached and block-aligned: the last block is recomputed so its logits exist.
    assert computed == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert bm.prefix_hits == 8 and bm.prefix_queries == 24


def test_hash_is_chained_and_includes_the_extra_key():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"packed") != first
    bm = BlockManager(num_blocks=8, block_size=BS)
    run_prefill(bm, make_request("a", list(range(10, 19))))
    other_mask = make_request("b", list(range(10, 19)), MaskSpec("prefix_bidirectional", end=3))
    assert bm.get_computed_blocks(other_mask) == []


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    import engine.block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens, extra=b"": 42)
    bm = BlockManager(num_blocks=8, block_size=BS)
    run_prefill(bm, make_request("a", [1, 2, 3, 4, 5]))
    assert bm.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5])) == []
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == [0]


def test_free_keeps_cached_blocks_and_evicts_in_lru_order():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(100, 109)))  # blocks 0,1 full; 2 partial
    run_prefill(bm, a)
    b = make_request("b", list(range(200, 209)))  # blocks 3,4 full; 5 partial
    run_prefill(bm, b)
    bm.take_events()
    bm.free(a)
    # Partial block 2 (never cached) is reused first; then a's tail block before its head.
    assert bm.free_queue() == [2, 1, 0]
    bm.free(b)
    assert bm.free_queue() == [5, 2, 1, 0, 4, 3]
    assert bm.usage == 0.0

    # Touching a cached block takes it out of the queue; the rest keep their order.
    c = make_request("c", list(range(100, 106)))  # hits block 0 only
    computed = bm.get_computed_blocks(c)
    assert computed == [0]
    assert bm.allocate(c, c.num_tokens - BS, computed)
    assert c.block_ids == [0, 5]
    assert bm.free_queue() == [2, 1, 4, 3]

    # Allocating past the uncached blocks evicts the least recently freed cached one.
    d = make_request("d", list(range(300, 312)))
    assert bm.allocate(d, d.num_tokens)
    assert d.block_ids == [2, 1, 4]
    events = bm.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [a.block_hashes[1], b.block_hashes[1]]
    assert bm.cached_block(a.block_hashes[1]) is None
    assert bm.cached_block(a.block_hashes[0]) == 0


def test_allocate_fails_without_side_effects_when_the_pool_is_short():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    run_prefill(bm, a)
    b = make_request("b", list(range(50, 60)))
    before = (bm.free_queue(), list(b.block_ids))
    assert not bm.allocate(b, b.num_tokens)
    assert (bm.free_queue(), b.block_ids) == before


def test_stored_events_carry_hashes_parents_and_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(1, 10)))
    run_prefill(bm, a)
    (event,) = bm.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == a.block_hashes[:2]
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(1, 9))
    # Decode fills block 2; only it is stored, chained to block 1.
    a.token_ids.extend([10, 11, 12])
    assert bm.allocate(a, 3)
    a.num_computed_tokens = a.num_tokens
    bm.register_full_blocks(a)
    (event,) = bm.take_events()
    assert event.block_hashes == [a.block_hashes[2]] and event.parent_block_hash == a.block_hashes[1]


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    run_prefill(bm, make_request("a", list(range(12))))
    assert bm.get_computed_blocks(make_request("b", list(range(12)))) == []
    assert bm.take_events() == []


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_request("b", list(range(9)))) == []


def test_cached_block_count_grows_to_the_pool_and_stays_there():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(10, 19)))  # 9 tokens: 2 full blocks cached, the partial third is not
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    assert bm.num_cached_blocks == 2  # freed blocks stay cached for reuse
    b = make_request("b", list(range(50, 66)))  # 16 distinct tokens: 4 blocks, two of them evict a's
    run_prefill(bm, b)
    assert bm.num_cached_blocks == 4 == bm.num_blocks
    bm.free(b)
    c = make_request("c", list(range(90, 98)))  # 2 more distinct blocks replace 2 of b's
    run_prefill(bm, c)
    assert bm.num_cached_blocks == 4
