"""What a request leaves out, the worker's config fills in: chat.default_max_tokens, risk.default_labels."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest

from engine import LLM
from schemas import ChatRequest, Message, RiskItem, RiskRequest, decode_request
from worker.config import load_config
from worker.handlers import HandlerContext
from worker.handlers.chat import ChatHandler
from worker.handlers.risk import RiskHandler


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32")


def ctx_for(llm: LLM, *, default_max_tokens: int = 256, default_labels=("low", "medium", "high")) -> HandlerContext:
    cfg = load_config(None)
    cfg = msgspec.structs.replace(cfg, chat=msgspec.structs.replace(cfg.chat, default_max_tokens=default_max_tokens),
                                  risk=msgspec.structs.replace(cfg.risk, default_labels=tuple(default_labels)))
    return HandlerContext(tokenizer=llm.tokenizer, max_model_len=llm.engine.max_model_len, max_num_batched_tokens=512,
                          worker_id="t", model_name="tiny", config=cfg)


def test_a_chat_without_max_tokens_gets_the_configured_default(llm):
    ctx = ctx_for(llm, default_max_tokens=7)
    left_out = decode_request(b'{"id": "c", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}')
    assert left_out.max_tokens is None
    (work,) = asyncio.run(ChatHandler().prepare(left_out, ctx)).work
    assert work.params.max_tokens == 7
    given = ChatRequest(id="c", messages=[Message(role="user", content="hi")], max_tokens=3)
    (work,) = asyncio.run(ChatHandler().prepare(given, ctx)).work
    assert work.params.max_tokens == 3


def test_a_risk_request_without_labels_is_scored_on_the_configured_ones(llm):
    ctx = ctx_for(llm, default_labels=("yes", "no"))
    req = decode_request(b'{"id": "r", "kind": "risk", "items": [{"id": "a", "text": "wire $9,900"}]}')
    assert req.labels == []
    handler = RiskHandler()
    prepared = asyncio.run(handler.prepare(req, ctx))
    outputs = llm.generate([w.prompt_token_ids for w in prepared.work], [w.params for w in prepared.work],
                           masks=[w.mask for w in prepared.work])
    result = asyncio.run(handler.finish(req, prepared, outputs, ctx))
    (item,) = result.items
    assert set(item.scores) == {"yes", "no"} and item.label in ("yes", "no")
    assert sum(item.scores.values()) == pytest.approx(1.0)
    # Labels the request names win over the defaults.
    named = RiskRequest(id="r2", items=[RiskItem(id="a", text="rent")], labels=["ok", "fraud", "spam"])
    prepared = asyncio.run(handler.prepare(named, ctx))
    outputs = llm.generate([w.prompt_token_ids for w in prepared.work], [w.params for w in prepared.work],
                           masks=[w.mask for w in prepared.work])
    assert set(asyncio.run(handler.finish(named, prepared, outputs, ctx)).items[0].scores) == {"ok", "fraud", "spam"}


def test_a_risk_request_packs_its_items_within_the_models_context_as_well_as_one_step(llm):
    """A context shorter than a step's token budget (the tiny model's 512 against 2048) bounds each packed
    prompt: before, 60 items by 8 labels were packed past it and answered prompt_too_long."""
    ctx = dataclasses.replace(ctx_for(llm), max_num_batched_tokens=2048)
    assert ctx.max_model_len < 1024  # PACK_TOKENS, the other bound
    req = RiskRequest(id="r", items=[RiskItem(id=f"i{i}", text="a payment") for i in range(60)],
                      labels=[f"risk-level-{j}" for j in range(8)])
    prepared = asyncio.run(RiskHandler().prepare(req, ctx))
    assert len(prepared.work) > 1 and all(len(w.prompt_token_ids) <= ctx.max_model_len for w in prepared.work)
    outputs = llm.generate([w.prompt_token_ids for w in prepared.work], [w.params for w in prepared.work],
                           masks=[w.mask for w in prepared.work])
    result = asyncio.run(RiskHandler().finish(req, prepared, outputs, ctx))
    assert len(result.items) == 60 and all(len(item.scores) == 8 for item in result.items)
