"""Risk batch scoring: one label distribution per item, from label log-likelihoods.

Prefill only. The templated prompt up to the item text is a shared prefix
(computed once, then served from the prefix cache); each (item, label) pair is
a segment `item text + template tail + label tokens` packed densely behind it
with the `packed_segments` mask, whose segments restart their positions, so a
segment is scored exactly as if it followed the prefix alone. A label's score
is the summed log-probability of its tokens; scores are normalised over the
labels (a softmax of the log-likelihoods).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine import MaskSpec, RequestError, RequestOutput, SamplingParams
from schemas import Result, RiskItemResult, RiskRequest, Usage
from worker.handlers import HandlerContext, Prepared, Work

ITEM_MARK = "\x00ITEM\x00"
# Each engine request is prefilled in one step (a custom mask must be), so its packed
# segments are kept under this many tokens.
PACK_TOKENS = 1024


@dataclass
class Segment:
    item: int
    label: int
    label_positions: tuple[int, ...]


def labels_of(req: RiskRequest, ctx: HandlerContext) -> list[str]:
    """The request's labels, or the worker's risk.default_labels when it names none."""
    return list(req.labels) or list(ctx.config.risk.default_labels)


def risk_template(ctx: HandlerContext, req: RiskRequest) -> tuple[list[int], list[int]]:
    """Token ids of the prompt before and after the item text."""
    instruction = req.instruction or ctx.config.risk.instruction
    labels = ", ".join(labels_of(req, ctx))
    messages = [
        {"role": "system", "content": f"{instruction}\nLabels: {labels}."},
        {"role": "user", "content": f"Text: {ITEM_MARK}"},
    ]
    text = ctx.tokenizer.apply_chat_template(messages)
    head, _, tail = text.partition(ITEM_MARK)
    return ctx.tokenizer.encode(head, add_special_tokens=False), ctx.tokenizer.encode(tail, add_special_tokens=False)


def pack(prefix: list[int], segments: list[tuple[list[int], int, int, int]]) -> tuple[list[int], MaskSpec, list[Segment]]:
    """One packed prompt: prefix, then each (tokens, item, label, label_len) as a segment."""
    tokens = list(prefix)
    starts: list[int] = []
    layout: list[Segment] = []
    for seg_tokens, item, label, label_len in segments:
        starts.append(len(tokens))
        tokens.extend(seg_tokens)
        end = len(tokens)
        layout.append(Segment(item, label, tuple(range(end - label_len, end))))
    mask = MaskSpec("packed_segments", start=len(prefix), segment_starts=tuple(starts))
    return tokens, mask, layout


class RiskHandler:
    kind = "risk"

    async def prepare(self, req: RiskRequest, ctx: HandlerContext) -> Prepared:
        tok = ctx.tokenizer
        head, tail = risk_template(ctx, req)
        label_ids = [tok.encode(" " + label, add_special_tokens=False) for label in labels_of(req, ctx)]
        pending: list[tuple[list[int], int, int, int]] = []
        for i, item in enumerate(req.items):
            item_ids = tok.encode(item.text, add_special_tokens=False)
            for j, lab in enumerate(label_ids):
                pending.append((item_ids + tail + lab, i, j, len(lab)))
        # A packed request is one prompt: it must fit the model's context as well as one step.
        budget = min(PACK_TOKENS, ctx.max_num_batched_tokens, ctx.max_model_len) - len(head)
        if budget <= 0 or any(len(seg) > budget for seg, *_ in pending):
            raise RequestError(
                f"a risk item with its template and label needs more than the {budget} tokens one packed "
                "prefill may hold; shorten the item text", code="prompt_too_long")
        work, layouts, group, used = [], [], [], 0
        for seg in [*pending, None]:
            if seg is None or used + len(seg[0]) > budget:
                if group:
                    tokens, mask, layout = pack(head, group)
                    positions = tuple(p for s in layout for p in s.label_positions)
                    work.append(Work(tokens, SamplingParams(max_tokens=1, temperature=0.0,
                                                            score_positions=positions), mask))
                    layouts.append(layout)
                group, used = [], 0
            if seg is not None:
                group.append(seg)
                used += len(seg[0])
        return Prepared(work=work, state=layouts)

    async def finish(self, req: RiskRequest, prepared: Prepared, outputs: list[RequestOutput],
                     ctx: HandlerContext) -> Result:
        labels = labels_of(req, ctx)
        ll = [[0.0] * len(labels) for _ in req.items]
        for layout, out in zip(prepared.state, outputs, strict=True):
            scores = out.prompt_logprobs or {}
            for seg in layout:
                ll[seg.item][seg.label] = sum(scores[p] for p in seg.label_positions)
        items = []
        for item, lls in zip(req.items, ll, strict=True):
            top = max(lls)
            weights = [math.exp(x - top) for x in lls]
            total = sum(weights)
            probs = {label: w / total for label, w in zip(labels, weights, strict=True)}
            items.append(RiskItemResult(id=item.id, scores=probs, label=max(probs, key=probs.get)))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return Result(id=req.id, kind="risk", items=items, finish_reason="stop",
                      usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=cached))
