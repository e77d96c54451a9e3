"""Risk scoring: packed label log-likelihoods equal HF transformers' for each (item, label) alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM
from schemas import RiskItem, RiskRequest
from tests.reference.test_engine_reference import smollm2_pair  # noqa: F401 - fixture
from worker.config import load_config
from worker.handlers import HandlerContext
from worker.handlers.risk import RiskHandler, risk_template

pytestmark = pytest.mark.reference

ITEMS = [
    "Wire transfer of $9,900 to a new overseas account, third one today.",
    "Monthly rent payment to the usual landlord.",
    "Card used in two countries within ten minutes.",
    "Refund of a $12 coffee order.",
]


def test_packed_label_loglikelihoods_match_hf(smollm2_pair):  # noqa: F811 - fixture imported above
    path, hf = smollm2_pair
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=512)
    ctx = HandlerContext(tokenizer=llm.tokenizer, max_model_len=llm.engine.max_model_len,
                         max_num_batched_tokens=128, worker_id="t", model_name="smollm2", config=load_config(None))
    req = RiskRequest(id="r", items=[RiskItem(id=str(i), text=t) for i, t in enumerate(ITEMS)],
                      labels=["low", "medium", "high"])
    handler = RiskHandler()
    prepared = asyncio.run(handler.prepare(req, ctx))
    assert len(prepared.work) >= 2, "expected the items to need several packed requests at this budget"
    outputs = llm.generate([w.prompt_token_ids for w in prepared.work], [w.params for w in prepared.work],
                           masks=[w.mask for w in prepared.work])

    head, tail = risk_template(ctx, req)
    tok = llm.tokenizer
    for layout, out in zip(prepared.state, outputs, strict=True):
        for seg in layout:
            item_ids = tok.encode(ITEMS[seg.item], add_special_tokens=False)
            label_ids = tok.encode(" " + req.labels[seg.label], add_special_tokens=False)
            ids = head + item_ids + tail + label_ids
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            n = len(label_ids)
            ref = sum(logprobs[len(ids) - n - 1 + k, label_ids[k]].item() for k in range(n))
            ours = sum(out.prompt_logprobs[p] for p in seg.label_positions)
            assert ours == pytest.approx(ref, abs=1e-4)

    result = asyncio.run(handler.finish(req, prepared, outputs, ctx))
    assert [it.id for it in result.items] == ["0", "1", "2", "3"]
    for it in result.items:
        assert sum(it.scores.values()) == pytest.approx(1.0, abs=1e-9)
        assert it.label == max(it.scores, key=it.scores.get)
    # The shared template prefix is computed once, then served from the prefix cache.
    assert outputs[1].num_cached_tokens >= (len(head) // 16) * 16 > 0
