"""What the attention backends need to know about one step's flat token batch.

The runner lays tokens out as [decode tokens (one per sequence) | prefill
chunks]. Decodes are handled as one batch; each prefill chunk is a span.
NOTE: rows in the KV cache are addressed by slot (block_id * block_size +
offset). Positions only feed RoPE; masks are defined on row indices within a
sequence, so packed segments can restart positions without changing slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MaskSpec:
    """A request's attention-mask policy, in row indices of that sequence.

    - causal: row i sees rows <= i.
    - chunk_bidirectional: rows in [start, end) see each other fully and
      everything before `start`; other rows are causal.
    - prefix_bidirectional: rows < end see all rows < end (prefix-LM); later rows
      are causal.
    - packed_segments: rows >= start are split at `segment_starts` (absolute
      rows, ascending, the first equal to `start`); a row sees rows < start
      (a shared prefix) and earlier rows of its own segment.
    """

    policy: str = "causal"
    start: int = 0
    end: int = 0
    segment_starts: tuple[int, ...] = ()

    @property
    def is_causal(self) -> bool:
        return self.policy == "causal"

    def cache_key(self) -> bytes:
        """Extra key for the prefix-cache hash: the same tokens under another mask have other KV."""
        if self.is_causal:
            return b""
        return f"{self.policy}:{self.start}:{self.end}:{','.join(map(str, self.segment_starts))}".encode()


CAUSAL = MaskSpec()


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    token_start: int  # offset of the chunk in the flat batch
    num_tokens: int
    num_cached: int  # rows of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for num_cached + num_tokens
    mask: MaskSpec = CAUSAL

    @property
    def kv_len(self) -> int:
        return self.num_cached + self.num_tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, including the new token
    decode_max_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
