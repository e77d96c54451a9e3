"""memory.kv_prefault: the KV pool is resident from the start, so a worker's RSS does not climb with traffic."""

from __future__ import annotations

import re

import pytest

from engine import LLM
from worker.config import ServiceConfig

POOL = 96 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read())[1]) * 1024


@pytest.mark.parametrize("cache_bits", [16, 8])
def test_prefault_makes_the_pool_resident_at_start(tiny_llama, cache_bits):
    before = rss_bytes()
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=POOL, kv_prefault=True,
              cache_bits=cache_bits)
    grown = rss_bytes() - before
    pool = sum(t.nbytes for c in llm.engine.kv_caches
               for t in ([c] if hasattr(c, "nbytes") else [v for v in vars(c).values() if hasattr(v, "nbytes")]))
    assert pool >= 0.9 * POOL
    assert grown >= 0.95 * pool, (grown, pool)


def test_without_prefault_the_pool_is_only_mapped(tiny_llama):
    before = rss_bytes()
    LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=POOL)
    assert rss_bytes() - before < POOL / 2


def test_workers_prefault_by_default():
    config = ServiceConfig()
    assert config.memory.kv_prefault is True
    assert config.engine_config().kv_prefault is True
