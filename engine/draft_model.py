"""Draft-model speculative decoding: a smaller model with the target's tokenizer proposes the draft.

The draft model runs in an engine of its own (`EngineCore`, with its own paged
KV cache and prefix cache), greedily. Each proposal is a short request of that
engine over the target request's verified tokens: its full blocks come from the
draft engine's prefix cache, so a proposal prefills only the tokens since the
last full block and then decodes the draft, one draft-model step per token.
Verification (engine/speculative.py) treats the draft as a point mass, as it
does prompt-lookup drafts, so outputs keep the target's distribution.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request


def draft_config(target: EngineConfig, max_model_len: int) -> EngineConfig:
    """The draft engine's config: the target's, with the draft model, its own KV budget, no speculation and
    no forced block count (a test's num_kv_blocks sizes the target's pool, not the draft's)."""
    return target.replace(model=target.draft_model, draft_model=None, speculative_method=None,
                          kv_cache_memory_bytes=target.draft_kv_cache_bytes, num_kv_blocks=None,
                          max_model_len=max_model_len, enable_prefix_caching=True, async_scheduling=False)


class DraftModelProposer:
    """Greedy drafts from `engine`, a draft model's engine whose token ids mean what the target's mean."""

    # engine: an EngineCore (not imported here: engine_core builds this proposer).
    def __init__(self, engine: Any, target_vocab_size: int, target_vocab: dict[str, int] | None) -> None:
        draft_vocab = engine.tokenizer.vocab() if engine.tokenizer is not None else None
        if engine.model_config.vocab_size > target_vocab_size or (
                draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab):
            raise InvalidRequestError(
                f"draft_model {engine.config.model!r} does not share the target model's tokenizer (vocabulary "
                f"{engine.model_config.vocab_size} vs {target_vocab_size} ids); a draft's token ids must mean "
                "the same text in both models")
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = request.token_ids
        if max_tokens <= 0 or len(tokens) + max_tokens > self.engine.max_model_len:
            return []
        rid = f"draft-{next(self._ids)}"
        self.engine.add_request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        draft: list[int] = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == rid:
                    draft = list(out.token_ids)
        # The draft engine's KV events would only pile up: nobody indexes its blocks.
        self.engine.take_kv_events()
        return draft[:max_tokens]
