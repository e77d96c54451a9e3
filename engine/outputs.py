"""What the engine hands back: per-request outputs and per-step stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import RequestError


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step. `new_*` fields hold only this step's part."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    num_cached_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: RequestError | None = None
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    prompt_logprobs: dict[int, float] | None = None


@dataclass
class EngineStats:
    """A snapshot after one step; the worker turns these into metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_num_tokens: int = 0
    step_num_seqs: int = 0
    step_token_budget: int = 0
    step_prefill_tokens: int = 0
    step_decode_seqs: int = 0
    step_time_s: float = 0.0
    steps_total: int = 0
    finished_ids: list[str] = field(default_factory=list)
    # Seconds the device sat idle before the last collected step (measured with CUDA events; None on CPU).
    device_idle_s: float | None = None
    # Speculative decoding, since the engine started: draft tokens proposed, and of those verified.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def batch_utilization(self) -> float:
        return self.step_num_tokens / self.step_token_budget if self.step_token_budget else 0.0
