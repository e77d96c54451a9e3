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
    no forced block count (a test's num_kv_blocks sizes the target's pool, not the draft's). A small draft runs
    whole in the target's process (rank 0 under tensor parallelism)."""
    return target.replace(model=target.draft_model, draft_model=None, speculative_method=None,
                          kv_cache_memory_bytes=target.draft_kv_cache_bytes, num_kv_blocks=None,
                          max_model_len=max_model_len, enable_prefix_caching=True, async_scheduling=False,
                          tensor_parallel_size=1)


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
        return self.propose_many([(request, max_tokens)])[0]

    def propose_many(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        """One draft per (request, max_tokens), the requests run as one batch of the draft engine."""
        ids: dict[str, int] = {}
        for i, (request, max_tokens) in enumerate(asks):
            if max_tokens > 0 and len(request.token_ids) + max_tokens <= self.engine.max_model_len:
                rid = f"draft-{next(self._ids)}"
                self.engine.add_request(rid, list(request.token_ids),
                                        SamplingParams(max_tokens=max_tokens, temperature=0.0))
                ids[rid] = i
        drafts: list[list[int]] = [[] for _ in asks]
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    drafts[ids[out.request_id]] = list(out.token_ids)
        # The draft engine's KV events would only pile up: nobody indexes its blocks.
        self.engine.take_kv_events()
        return [draft[:max_tokens] for draft, (_, max_tokens) in zip(drafts, asks, strict=True)]
