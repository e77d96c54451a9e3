"""Scheduler behaviour driven directly, with made-up sampled tokens."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make(rid: str, n: int, max_tokens: int = 4, start: int = 10) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   frozenset({2}))


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    return out, sched.update(out, sampled)


def test_token_budget_chunks_long_prompts_and_mixes_decode_with_prefill():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=128)
    sched.add(make("a", 3))
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 3, True)]
    sched.add(make("b", 20, start=100))
    out, _ = step(sched)
    # a decodes one token; b gets the remaining 7 tokens of budget and does not sample yet.
    assert [(s.request_id, len(s.token_ids), s.start, s.sample) for s in out.scheduled] == [
        ("a", 1, 3, True), ("b", 7, 0, False)]
    assert out.num_scheduled_tokens == 8
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.start) for s in out.scheduled] == [("a", 1, 4), ("b", 7, 7)]
    out, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.start, s.sample) for s in out.scheduled] == [
        ("a", 1, 5, True), ("b", 6, 14, True)]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_num_batched_tokens=100, max_model_len=128)
    for i in range(3):
        sched.add(make(f"r{i}", 5, start=10 * i))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_requests_finish_at_max_tokens_and_free_their_blocks():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    req = make("a", 5, max_tokens=3)
    sched.add(req)
    finished = []
    while sched.has_unfinished():
        _, steps = step(sched)
        finished += [s.request.request_id for s in steps if s.finished]
    assert finished == ["a"]
    assert req.finish_reason == "length" and req.num_output_tokens == 3
    assert req.status is RequestStatus.FINISHED and req.block_ids == []
    assert bm.usage == 0.0


def test_stop_token_finishes_with_stop():
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=10), frozenset({2}))
    sched.add(req)
    _, steps = step(sched, token=2)
    assert steps[0].finished and req.finish_reason == "stop"


def test_running_out_of_blocks_preempts_the_newest_request_and_recomputes_it():
    bm = BlockManager(6, BS)  # 24 token slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24)
    a, b = make("a", 8, max_tokens=8), make("b", 8, max_tokens=8, start=50)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 2 blocks each + 1 token of output
    assert bm.num_free_blocks == 2
    preempted = []
    while sched.has_unfinished():
        out, _ = step(sched)
        preempted += out.preempted_ids
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1
    # Both still produced all their tokens, and b kept the ones it had before preemption.
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert bm.usage == 0.0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_request_is_resumed_with_prompt_and_output_as_one_prefix(prefix_caching):
    bm = BlockManager(5, BS, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20)
    a, b = make("a", 7, max_tokens=6), make("b", 7, max_tokens=6, start=50)
    sched.add(a)
    sched.add(b)
    resumed = []
    was_preempted = False
    while sched.has_unfinished():
        out, _ = step(sched)
        for s in out.scheduled:
            if s.request_id == "b" and was_preempted:
                resumed.append((s.start, list(s.token_ids), s.sample))
                was_preempted = False
        was_preempted = was_preempted or "b" in out.preempted_ids
    assert resumed, "b was never preempted and resumed"
    start, tokens, sample = resumed[0]
    # The recompute runs over prompt and earlier output as one prefix and samples;
    # with prefix caching its full blocks are reused, so only the tail is computed.
    assert sample and tokens == b.token_ids[start:start + len(tokens)]
    assert start + len(tokens) > b.num_prompt_tokens
    if prefix_caching:
        assert start > 0 and start % BS == 0
    else:
        assert start == 0


def test_abort_removes_a_waiting_or_running_request():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    a, b = make("a", 5), make("b", 5, start=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.abort("b") is b and b.finish_reason == "abort"
    assert sched.abort("a") is a and bm.usage == 0.0
    assert not sched.has_unfinished()
    assert sched.abort("missing") is None
