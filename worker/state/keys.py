"""The Redis key layout every worker shares.

Key layout (`P` = key_prefix, `M` = model name, hashes in decimal):

    P:kv:M:block:<hash>          zset    worker id -> expiry (epoch ms); key TTL index_ttl_s
    P:kv:M:worker:<worker>       set     block hashes this worker registered; TTL index_ttl_s
    P:workers                    zset    worker id -> heartbeat expiry (epoch ms)
    P:worker:<worker>            string  msgpack `WorkerInfo`; TTL 3 x heartbeat_interval_s
    P:asr:<digest>               hash    stream_id, seq (last committed), text, owner, updated_ms
    P:asr:<digest>:result:<seq>  string  the encoded result of chunk <seq>; both TTL stream_state_ttl_s

NOTE: each (block, worker) pair carries its own expiry as the zset score, since
a key TTL alone would keep a dead worker listed for as long as any live worker
refreshes the same block. Readers skip expired members; they vanish with the key.
NOTE: `<digest>` is a BLAKE2b digest of the stream id, so client-supplied ids
never become key names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class KeyLayout:
    """The key names of one (key prefix, model, worker)."""

    prefix: str
    model: str
    worker_id: str

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def block_prefix(self) -> str:
        return f"{self.prefix}:kv:{self.model}:block:"

    def block(self, block_hash: int) -> str:
        return self.block_prefix + str(block_hash)

    @property
    def own_blocks(self) -> str:
        return f"{self.prefix}:kv:{self.model}:worker:{self.worker_id}"

    def stream(self, stream_id: str) -> str:
        return f"{self.prefix}:asr:" + hashlib.blake2b(stream_id.encode(), digest_size=16).hexdigest()

    def chunk_result(self, stream_id: str, seq: int) -> str:
        return f"{self.stream(stream_id)}:result:{seq}"
