"""Memory the prefix cache's bookkeeping holds per cached block, and its bound for a KV pool.

    .venv/bin/python -m bench.prefix_metadata
    .venv/bin/python -m bench.prefix_metadata --blocks 50000

A block that holds a full, hashed block of tokens keeps, while it stays cached (in use or free
in LRU order), its chained hash, its token ids and its entries in the block manager's maps. That
is Python heap that grows with every distinct block the engine has computed, until every block of
the pool holds one; after that, eviction replaces entries and the total stays flat. This script
fills a BlockManager of `--blocks` blocks with distinct 10-block requests, each freed after its
blocks are registered (as finished requests are), and measures the heap it then holds with
tracemalloc. It also reports the bound that implies for two pools: the soak's (tiny random-weight
Llama, 256 MiB) and SmolLM2-135M's in fp32, next to the KV bytes of one block.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from bench.report import (
    REPO,
    console,
    invocation,
    markdown_table,
    print_table,
    update_docs_section,
    write_json,
)

RELIABILITY = REPO / "docs" / "reliability.md"
BLOCK_SIZE = 16
# name, layers, KV heads, head dim, bytes per element, pool bytes
POOLS = (("tiny random-weight Llama (the soak's), fp32", 2, 2, 16, 4, 256 * 2**20),
         ("SmolLM2-135M, fp32", 30, 3, 64, 4, 256 * 2**20))


def bytes_per_cached_block(num_blocks: int, seed: int) -> tuple[float, int]:
    from engine.block_manager import BlockManager
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    bm = BlockManager(num_blocks, BLOCK_SIZE)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    per_request = 10
    for i in range((num_blocks - per_request) // per_request):
        tokens = [rng.randrange(1, 50_000) for _ in range(BLOCK_SIZE * per_request)]
        req = Request(f"r{i}", tokens, params, frozenset())
        if not bm.allocate(req, len(tokens)):
            raise SystemExit(f"request {i}: the pool of {num_blocks} blocks ran out before it was full")
        req.num_computed_tokens = len(tokens)
        bm.register_full_blocks(req)
        bm.take_events()  # the worker publishes and drops them
        bm.free(req)
    del req, tokens
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    cached = bm.num_cached_blocks
    if not cached:
        raise SystemExit("no block was cached: is prefix caching off?")
    return held / cached, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20_000, help="blocks in the measured pool (default 20000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.blocks < 20:
        raise SystemExit("--blocks must be at least 20")
    command = invocation("bench.prefix_metadata")
    console.print(f"[bold]$ {command}[/]")
    per_block, cached = bytes_per_cached_block(args.blocks, args.seed)
    rows = []
    for name, layers, kv_heads, head_dim, elem, pool in POOLS:
        kv_block = 2 * layers * kv_heads * head_dim * elem * BLOCK_SIZE
        blocks = pool // kv_block
        rows.append((name, f"{pool / 2**20:.0f} MiB", f"{kv_block:,}", f"{blocks:,}",
                     f"{blocks * per_block / 2**20:.1f} MiB", f"{100 * per_block / kv_block:.2f}%"))
    title = f"Prefix-cache bookkeeping: {per_block:.0f} bytes of Python heap per cached block ({cached:,} measured)"
    headers = ["model and KV dtype", "KV pool", "KV bytes per block", "blocks in the pool",
               "bookkeeping when every block is cached", "bookkeeping ÷ KV per block"]
    print_table(title, headers, rows)
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json("prefix_metadata.json", {"command": command, "date": date, "blocks": args.blocks,
                                        "cached_blocks": cached, "bytes_per_cached_block": per_block,
                                        "pools": [dict(zip(headers, r, strict=True)) for r in rows]})
    update_docs_section("prefix_metadata", "\n\n".join([
        "### Prefix-cache bookkeeping per cached block",
        f"Measured {date} with `{command}`: a BlockManager of {args.blocks:,} blocks of {BLOCK_SIZE} tokens filled "
        "with distinct requests, each freed once its blocks are registered; tracemalloc counts the Python heap "
        "still held, divided by the blocks cached. The bound assumes every block of the pool holds a distinct "
        "cached block, which a long run of distinct prompts reaches; eviction keeps it flat after that.",
        markdown_table(title, headers, rows),
    ]), RELIABILITY)


if __name__ == "__main__":
    main()
