"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

# Large enough for any real context; a bound so a hostile value can't make us
# reserve absurd amounts of state.
MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy. top_k 0 or -1 and top_p == 1 disable those
    filters. A `seed` gives the request its own generator, so the same seed
    gives the same tokens whatever else shares the batch.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Number of top logprobs to return per generated token (None: none).
    logprobs: int | None = None
    # Phrases that must never be generated; enforced at the logits.
    banned_phrases: tuple[str, ...] = field(default=())
    # Prompt positions t whose token's log-probability given tokens < t is returned
    # (RequestOutput.prompt_logprobs); only those rows go through the LM head.
    score_positions: tuple[int, ...] = ()
    # Batch invariance: the same tokens whatever else shares the batch (see docs/determinism).
    deterministic: bool = False
    # Speculative decoding for this request, where the engine has it on (EngineConfig.speculative_method);
    # False: one token a step.
    speculative: bool = True

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples: the object is frozen and shared.
        for name in ("stop", "stop_token_ids", "banned_phrases", "score_positions"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, ())
            elif isinstance(value, str):
                object.__setattr__(self, name, (value,))
            else:
                object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise bad(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        # A request's generator takes the seed as a 64-bit value, signed or not (the wire schema's bounds).
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise bad(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.banned_phrases):
            raise bad("banned phrases must be non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.score_positions):
            raise bad("score_positions must be integers >= 1 (a token is scored given the tokens before it)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "deterministic",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
