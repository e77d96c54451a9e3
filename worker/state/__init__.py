"""What a worker keeps in Redis: the shared prefix index, liveness and load, ASR stream state.

Worker code uses `RedisState` and the types below; the modules split it by concern:
client.py (connection, health, degradation), prefix_index.py, liveness.py,
asr_streams.py, keys.py (the key layout), redis_state.py (lifecycle and sync loop).
"""

from worker.state.asr_streams import CommitResult, StateUnavailable, StreamState
from worker.state.client import REDIS_OPS, RedisAuthError
from worker.state.liveness import WorkerInfo, WorkerLoad
from worker.state.redis_state import RedisState

__all__ = [
    "REDIS_OPS",
    "CommitResult",
    "RedisAuthError",
    "RedisState",
    "StateUnavailable",
    "StreamState",
    "WorkerInfo",
    "WorkerLoad",
]
