"""The ASR handler's wait for a missing chunk: it ends with sequence_gap and leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from engine import RequestError
from schemas import AsrRequest
from worker.config import load_config
from worker.handlers import HandlerContext
from worker.handlers.asr import AsrHandler
from worker.state import StreamState


class StreamStore:
    """Stands in for RedisState: a stream whose last committed chunk is 0, and no stored results."""

    def __init__(self, healthy: bool = True, final: bool = False) -> None:
        self.healthy = healthy
        self.final = final

    async def get_stream(self, stream_id: str) -> StreamState:
        return StreamState(stream_id=stream_id, last_seq=0, text="hello", owner="w-0", updated_ms=0, final=self.final)

    async def get_chunk_result(self, stream_id: str, seq: int) -> None:
        return None


def context(redis: StreamStore) -> HandlerContext:
    config = load_config(None, env={"INFINILM__ASR__GAP_TIMEOUT_S": "0.3"})
    return HandlerContext(tokenizer=None, max_model_len=512, max_num_batched_tokens=512, worker_id="w-1",
                          model_name="m", config=config, redis=redis)


def test_a_chunk_after_a_gap_times_out_with_sequence_gap_and_drops_its_wait_state():
    handler = AsrHandler()
    request = AsrRequest(id="c3", stream_id="s-1", seq=3, text="later words")
    with pytest.raises(RequestError) as err:
        asyncio.run(handler.prepare(request, context(StreamStore())))
    assert err.value.code == "sequence_gap"
    assert "waited" in str(err.value) and "chunk 1" in str(err.value)
    assert handler._committed == {}


def test_a_chunk_while_stream_state_is_down_is_refused_as_overloaded_and_drops_its_wait_state():
    handler = AsrHandler()
    request = AsrRequest(id="c1", stream_id="s-2", seq=1, text="next words")
    handler._committed["s-2"] = asyncio.Event()  # left by an earlier wait on this stream
    with pytest.raises(RequestError) as err:
        asyncio.run(handler.prepare(request, context(StreamStore(healthy=False))))
    assert err.value.code == "overloaded"
    assert handler._committed == {}


def test_a_chunk_after_the_final_one_is_refused_at_once():
    handler = AsrHandler()
    request = AsrRequest(id="c1", stream_id="s-3", seq=1, text="one more thing")
    with pytest.raises(RequestError) as err:
        asyncio.run(handler.prepare(request, context(StreamStore(final=True))))
    assert err.value.code == "invalid_request"
    assert "stream 's-3' ended with chunk 0 (final)" in str(err.value) and "new stream_id" in str(err.value)
    assert handler._committed == {}
