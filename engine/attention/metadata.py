"""What the attention backends need to know about one step's flat token batch.

The runner lays tokens out as [decode tokens (one per sequence) | prefill
chunks]. Decodes are handled as one batch; each prefill chunk is a span.
NOTE: rows in the KV cache are addressed by slot (block_id * block_size +
offset). Positions only feed RoPE; masks are defined on row indices within a
sequence, so packed segments can restart positions without changing slots.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.kv_int8 import KVWindowMetadata


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

    def block_key(self, block_end: int, token_ids: list[int]) -> bytes:
        """Extra prefix-cache key for the block of rows ending at `block_end` (exclusive).

        The same tokens under another mask have other KV, so the key says how the
        mask shapes this block's rows: nothing for rows that are plain causal (so a
        shared causal prefix is reused across policies), the region for rows in a
        bidirectional region, plus the region's tokens when rows of this block see
        tokens after it. Later blocks inherit the difference through the chained hash.
        """
        if self.is_causal or block_end <= self.start:
            return b""
        if self.policy == "packed_segments":
            starts = [s for s in (self.segment_starts or (self.start,)) if s < block_end]
            return f"packed:{self.start}:{','.join(map(str, starts))}".encode()
        key = f"{self.policy}:{self.start}:{self.end}".encode()
        if block_end < self.end:
            key += array("q", token_ids[self.start:self.end]).tobytes()
        return key


CAUSAL = MaskSpec()


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    token_start: int  # offset of the chunk in the flat batch
    num_tokens: int
    num_cached: int  # rows of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for num_cached + num_tokens
    mask: MaskSpec = CAUSAL
    # The same block ids on the host (the runner sets them), so GPU backends can build their launch
    # tables without reading block_table back from the device.
    block_ids: list[int] | None = None

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
    # An int8 KV cache's full-precision window of recent rows (kv_fp_window > 0), else None.
    kv_window: KVWindowMetadata | None = None
    # NOTE: a speculative draft's rows are decode rows of one sequence (row j sees rows <= its own); every
    # backend writes the step's K/V rows before any decode row reads them, and the fused CPU decoder keeps
    # such a step's rows in one group so that holds there too.
    multi_row_decodes: bool = False
    # What a backend derives from this metadata once per step and reuses in every layer (the GPU
    # backends' launch tables), by backend name.
    backend_cache: dict[str, object] = field(default_factory=dict)
