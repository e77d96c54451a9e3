"""Turns one SchedulerOutput into a forward pass and sampled tokens.

The flat batch is laid out as [decode tokens | prefill chunks]; only the rows
whose logits are needed (the last row of each request that samples) go
through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.masks import mask_positions
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.models.llama import LlamaForCausalLM
from engine.sampler import SampleResult, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # Reference tests set this to compare logits with another implementation.
        self.capture_logits = False
        self.last_logits: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        ordered = decodes + prefills
        input_ids, positions, meta = self._prepare(decodes, prefills)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        rows, sampling = [], []
        offset = 0
        for s in ordered:
            offset += len(s.token_ids)
            if s.sample:
                rows.append(offset - 1)
                sampling.append(s)
        if not sampling:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).float().cpu()
        if self.capture_logits:
            self.last_logits = {s.request_id: logits[i].clone() for i, s in enumerate(sampling)}
        result: SampleResult = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        sampled = {s.request_id: t for s, t in zip(sampling, result.token_ids, strict=True)}
        logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, logprobs)

    def _prepare(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        nd = len(decodes)
        if nd:
            starts = np.fromiter((s.start for s in decodes), dtype=np.int64, count=nd)
            last_blocks = np.fromiter((s.block_table[s.start // bs] for s in decodes), dtype=np.int64, count=nd)
            ids.extend(s.token_ids[0] for s in decodes)
            pos_chunks.append(starts)
            slot_chunks.append(last_blocks * bs + starts % bs)
        spans: list[PrefillSpan] = []
        for s in prefills:
            n = len(s.token_ids)
            rows = np.arange(s.start, s.start + n, dtype=np.int64)
            table = np.asarray(s.block_table, dtype=np.int64)
            ids.extend(s.token_ids)
            slot_chunks.append(table[rows // bs] * bs + rows % bs)
            if s.mask.is_causal:
                pos_chunks.append(rows)
            else:
                pos_chunks.append(mask_positions(s.mask, torch.from_numpy(rows)).numpy())
            spans.append(PrefillSpan(
                token_start=len(ids) - n, num_tokens=n, num_cached=s.start,
                block_table=torch.from_numpy(table[: -(-(s.start + n) // bs)]).to(self.device), mask=s.mask,
            ))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks)).to(dev),
            num_decodes=nd,
            prefills=spans,
        )
        if nd:
            seq_lens = [s.start + 1 for s in decodes]
            max_blocks = -(-max(seq_lens) // bs)
            tables = np.zeros((nd, max_blocks), dtype=np.int64)
            for i, s in enumerate(decodes):
                n = -(-seq_lens[i] // bs)
                tables[i, :n] = s.block_table[:n]
            meta.decode_block_tables = torch.from_numpy(tables).to(dev)
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
            meta.decode_max_len = max(seq_lens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_chunks)).to(dev)
        return input_ids, positions, meta
