"""Decode steps replayed from CUDA graphs, captured for bucketed batch sizes.

A decode step's shapes depend only on the number of sequences, so the forward
pass is captured once per bucket (1, 2, 4, ..., max) and a step runs the
smallest bucket that holds it, with the extra rows padded: their K/V go to the
scratch block past the block manager's pool, their block tables point there
too, and their outputs are dropped. These are the seed's bucketed micro-batches
on the device. With `use_graphs=False` the same padding runs eagerly, which is
how the CPU tests check the padding itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= batch), None)


@dataclass
class _Static:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    hidden: torch.Tensor | None = None
    graph: object = None


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, scratch_block: int, max_blocks: int,
                 max_batch: int, device: torch.device, use_graphs: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_blocks = max_blocks
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.buckets = tuple(b for b in BUCKETS if b <= max_batch) or (max_batch,)
        self._static: dict[int, _Static] = {}
        self._pool = None

    def _buffers(self, bucket: int) -> _Static:
        st = self._static.get(bucket)
        if st is None:
            dev = self.device
            scratch_slot = self.scratch_block * self.block_size
            st = _Static(
                input_ids=torch.zeros(bucket, dtype=torch.long, device=dev),
                positions=torch.zeros(bucket, dtype=torch.long, device=dev),
                slot_mapping=torch.full((bucket,), scratch_slot, dtype=torch.long, device=dev),
                block_tables=torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.long, device=dev),
                seq_lens=torch.ones(bucket, dtype=torch.long, device=dev),
            )
            self._static[bucket] = st
        return st

    def _meta(self, st: _Static, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=st.slot_mapping, num_decodes=bucket, decode_block_tables=st.block_tables,
                                 decode_seq_lens=st.seq_lens, decode_max_len=self.max_blocks * self.block_size)

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        if not self.use_graphs:
            return
        for bucket in sorted(self.buckets, reverse=True):
            st = self._buffers(bucket)
            meta = self._meta(st, bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up allocators and autotuning outside the graph
                    self.model(st.input_ids, st.positions, self.kv_caches, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                st.hidden = self.model(st.input_ids, st.positions, self.kv_caches, meta)
            self._pool = graph.pool()
            st.graph = graph

    def can_run(self, batch: int) -> bool:
        return bucket_for(batch, self.buckets) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states of a decode step of `len(input_ids)` sequences."""
        batch = input_ids.shape[0]
        bucket = bucket_for(batch, self.buckets)
        st = self._buffers(bucket)
        st.input_ids[:batch].copy_(input_ids, non_blocking=True)
        st.positions[:batch].copy_(positions, non_blocking=True)
        st.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        st.slot_mapping[batch:].fill_(self.scratch_block * self.block_size)
        st.block_tables[:batch].fill_(self.scratch_block)
        st.block_tables[:batch, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        st.block_tables[batch:].fill_(self.scratch_block)
        st.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        st.seq_lens[batch:].fill_(1)
        if st.graph is not None:
            st.graph.replay()
            return st.hidden[:batch]
        hidden = self.model(st.input_ids, st.positions, self.kv_caches, self._meta(st, bucket))
        return hidden[:batch]
