"""Turns one SchedulerOutput into a forward pass and sampled tokens.

The flat batch is laid out as [decode tokens | prefill chunks]; only the rows
whose logits are needed (the last row of each request that samples) go
through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.kv_int8 import KVWindowSlots
from engine.attention.masks import mask_positions
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.logits_processors import apply_bans, banned_next_tokens
from engine.models.linear import batch_invariant
from engine.models.llama import LlamaForCausalLM
from engine.sampler import SampleResult, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    # request id -> {position: log P(token at position | tokens before)}
    prompt_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # Reference tests set this to compare logits with another implementation.
        self.capture_logits = False
        # Decode steps replayed from CUDA graphs (engine.cuda_graphs), when the engine sets them up.
        self.graphs = None
        # Ring slots of an int8 KV cache's full-precision window (kv_fp_window > 0), set by the engine.
        self.kv_window: KVWindowSlots | None = None
        self._pinned: dict[str, torch.Tensor] = {}
        self.last_logits: dict[str, torch.Tensor] = {}

    def release(self, out: SchedulerOutput) -> None:
        """Drop per-sequence state of the requests the scheduler finished or preempted."""
        if self.kv_window is not None:
            self.kv_window.release([*out.finished_ids, *out.preempted_ids])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.release(out)
        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        ordered = decodes + prefills
        input_ids, positions, meta = self._prepare(decodes, prefills)
        if self.kv_window is not None:
            meta.kv_window = self.kv_window.metadata(decodes, prefills, self.device)
        invariant = any(s.params.deterministic for s in ordered)
        with batch_invariant(invariant):
            if self.graphs is not None and not prefills and not invariant and self.graphs.can_run(len(decodes)):
                hidden = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                         meta.decode_seq_lens)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            return self._finish(ordered, hidden)

    def _finish(self, ordered, hidden: torch.Tensor) -> RunnerOutput:

        rows, sampling = [], []
        score_rows: list[int] = []
        score_targets: list[tuple[str, int, int]] = []  # (request id, position, token)
        offset = 0
        for s in ordered:
            if s.params.score_positions:
                # Row r's logits predict the token at r + 1.
                for pos in s.params.score_positions:
                    if s.start < pos <= s.start + len(s.token_ids) and pos < len(s.history):
                        score_rows.append(offset + pos - 1 - s.start)
                        score_targets.append((s.request_id, pos, s.history[pos]))
            offset += len(s.token_ids)
            if s.sample:
                rows.append(offset - 1)
                sampling.append(s)
        prompt_logprobs = self._score(hidden, score_rows, score_targets) if score_rows else {}
        if not sampling:
            return RunnerOutput({}, {}, prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]).float().cpu()
        if self.capture_logits:
            self.last_logits = {s.request_id: logits[i].clone() for i, s in enumerate(sampling)}
        if any(s.banned for s in sampling):
            apply_bans(logits, [banned_next_tokens(s.history, s.banned) if s.banned else [] for s in sampling])
        result: SampleResult = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        sampled = {s.request_id: t for s, t in zip(sampling, result.token_ids, strict=True)}
        logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    def _score(self, hidden: torch.Tensor, rows: list[int], targets: list[tuple[str, int, int]],
               chunk: int = 256) -> dict[str, dict[int, float]]:
        """Log-probabilities of given prompt tokens, a chunk of rows at a time to bound memory."""
        out: dict[str, dict[int, float]] = {}
        for i in range(0, len(rows), chunk):
            idx = torch.tensor(rows[i:i + chunk], device=hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            tokens = torch.tensor([t for _, _, t in targets[i:i + chunk]], device=logprobs.device)
            picked = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
            for (rid, pos, _), lp in zip(targets[i:i + chunk], picked, strict=True):
                out.setdefault(rid, {})[pos] = lp
        return out

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
        meta = AttentionMetadata(
            slot_mapping=self._upload("slots", np.concatenate(slot_chunks)),
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
            meta.decode_block_tables = self._upload("tables", tables)
            meta.decode_seq_lens = self._upload("lens", np.asarray(seq_lens, dtype=np.int64))
            meta.decode_max_len = max(seq_lens)
        input_ids = self._upload("ids", np.asarray(ids, dtype=np.int64))
        positions = self._upload("positions", np.concatenate(pos_chunks))
        return input_ids, positions, meta

    def _upload(self, name: str, array: np.ndarray) -> torch.Tensor:
        """A step input on the device. On CUDA it goes through a reused pinned buffer with a
        non-blocking copy, so building the next inputs overlaps the transfer; the step's
        sampling synchronises before the buffer is reused."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < host.numel():
            buf = torch.empty(max(host.numel(), 4096), dtype=host.dtype).pin_memory()
            self._pinned[name] = buf
        staged = buf[:host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)
