"""A request's life inside the engine."""

from __future__ import annotations

import enum
import time

import torch

from engine.attention.metadata import CAUSAL, MaskSpec
from engine.sampling_params import SamplingParams

# Stands in for a sampled token that is still on its way from the device (pipelined scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Token state of one request; the scheduler and the KV cache manager update it.

    NOTE: `token_ids` holds prompt then output tokens in one list, so a
    preempted request recomputes both as one prefix. With pipelined scheduling
    its last `num_pending` entries (at most two) are PLACEHOLDERs for tokens
    launched steps are still sampling.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], mask: MaskSpec = CAUSAL,
                 arrival_time: float | None = None, prompt: str | None = None, images: tuple = ()) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        # Handed out with every RequestOutput of this request: one list, built once, never mutated by the
        # engine (token_ids grows in place), so a step's outputs cost nothing per prompt token.
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.mask = mask
        # engine.vision.llava.ImageSpan per image, in prompt order: whose features fill which positions.
        self.images = images
        self.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing PLACEHOLDER tokens
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.banned_sequences: tuple[tuple[int, ...], ...] = ()  # token forms of params.banned_phrases
        self.generator: torch.Generator | None = None
        # Speculative decoding: the most draft tokens the next step may verify (None: the engine's k).
        self.draft_limit: int | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    def image_key(self, start: int, end: int) -> bytes:
        """The content hashes of the images with positions in [start, end), for the prefix-cache key."""
        return b"".join(b"img:%d:" % span.start + span.image.content_hash for span in self.images
                        if span.start < end and start < span.start + span.length)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
