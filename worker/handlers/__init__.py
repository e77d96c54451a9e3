"""Task handlers: turn a decoded request into engine work and engine outputs into a Result.

A handler never talks to Kafka. It may use Redis state through the context
(the ASR handler does). The service owns ids, offsets, deltas and publishing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import MaskSpec, RequestOutput, SamplingParams
from engine.attention.metadata import CAUSAL
from schemas import Result, Usage


@dataclass
class Work:
    """One engine request a handler asks for."""

    prompt_token_ids: list[int]
    params: SamplingParams
    mask: MaskSpec = CAUSAL
    stream: bool = False  # publish this job's text deltas
    images: tuple = ()  # engine ImageInputs for the prompt's image placeholders, in order
    image_positions: int = 0  # prompt positions the placeholders add when the engine expands them


def usage_of(outputs: list[RequestOutput | None]) -> Usage:
    """The tokens the engine processed for these outputs, finished or not: prompts, tokens generated
    (the end-of-sequence token included), prompt tokens served from the prefix cache."""
    done = [o for o in outputs if o is not None]
    return Usage(prompt_tokens=sum(len(o.prompt_token_ids) for o in done),
                 completion_tokens=sum(len(o.token_ids) for o in done),
                 cached_tokens=sum(o.num_cached_tokens for o in done))


@dataclass
class Prepared:
    work: list[Work] = field(default_factory=list)
    result: Result | None = None  # an immediate answer (usually an error); then `work` is empty
    state: Any = None  # handler-private, handed back to finish()


class Handler(Protocol):
    kind: str

    async def prepare(self, request: Any, ctx: HandlerContext) -> Prepared: ...

    async def finish(self, request: Any, prepared: Prepared, outputs: list[RequestOutput],
                     ctx: HandlerContext) -> Result: ...


@dataclass
class HandlerContext:
    """What handlers may use: the tokenizer, limits, config, shared state."""

    tokenizer: Any
    max_model_len: int
    max_num_batched_tokens: int
    worker_id: str
    model_name: str
    config: Any
    redis: Any = None
    metrics: Any = None
    images: Any = None  # worker.handlers.images.ImageReader for a vision model; None: text only
