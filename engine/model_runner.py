"""Turns one SchedulerOutput into a forward pass and sampled tokens.

The flat batch is laid out as [decode tokens | prefill chunks]; only the rows
whose logits are needed (the last row of each request that samples, every
row of a speculative draft's chunk) go through the LM head.

A step is `launch`ed, then `collect`ed. Launching queues the forward pass and
the sampling on the device and starts copying the chosen token ids back,
without waiting; collecting waits for them. Between the two the engine builds
the next step (pipelined scheduling): that step's decode rows whose input is
a token still being sampled carry `PLACEHOLDER`, and the launch fills them in
on the device from the previous step's sampled ids. On a GPU each step also
records two CUDA events, so the device's idle time between steps is measured,
not guessed.
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
from engine.request import PLACEHOLDER
from engine.sampler import DeviceSample, sample_on_device
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.speculative import verify
from engine.transfer import to_device
from engine.vision.llava import step_embeddings


@dataclass
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    # request id -> {position: log P(token at position | tokens before)}
    prompt_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Seconds the device sat idle between the previous step's work and this one's (CUDA only).
    device_idle_s: float | None = None
    # request id -> the tokens a drafted request keeps (engine/speculative.py)
    verified: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepHandle:
    """A launched step: its choices are on their way to the host."""

    sampling: list[ScheduledRequest]
    rows: dict[str, int]  # request id -> row of its sampled token in sample.token_ids
    sample: DeviceSample | None
    host: list[torch.Tensor] | None  # the sample's tensors, being copied to (pinned) host memory
    prompt_logprobs: dict[str, dict[int, float]]
    done: torch.cuda.Event | None = None  # the copies to the host have landed
    started: torch.cuda.Event | None = None  # the device began this step's work
    previous_end: torch.cuda.Event | None = None  # the device finished the step before
    logits: dict[str, torch.Tensor] | None = None  # captured logits (capture_logits)
    verified: dict[str, list[int]] = field(default_factory=dict)  # drafted requests' kept tokens, on the host


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
        self.last_logits: dict[str, torch.Tensor] = {}
        # The vision tower and projector of a LLaVA model (engine.vision.llava.VisionEncoder), set by the engine.
        self.vision = None
        self._last_end: torch.cuda.Event | None = None  # the last launched step's end, on CUDA

    def release(self, out: SchedulerOutput) -> None:
        """Drop per-sequence state of the requests the scheduler finished or preempted."""
        if self.kv_window is not None:
            self.kv_window.release([*out.finished_ids, *out.preempted_ids])

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: StepHandle | None = None) -> StepHandle:
        """Queue the step's forward pass and sampling; `previous` supplies the tokens of PLACEHOLDER rows."""
        self.release(out)
        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        ordered = decodes + prefills
        input_ids, positions, meta = self._prepare(decodes, prefills, previous)
        if self.kv_window is not None:
            meta.kv_window = self.kv_window.metadata(decodes, prefills, self.device)
        invariant = any(s.params.deterministic for s in ordered)
        cuda = self.device.type == "cuda"
        # Recorded once the host has built the inputs: the gap since the previous step's end is time the
        # device had nothing to do (the small input copies queued before it take microseconds).
        started = torch.cuda.Event(enable_timing=True) if cuda else None
        if started is not None:
            started.record()
        with batch_invariant(invariant):
            embeds = step_embeddings(self.vision, self.model.embed_tokens, ordered, input_ids, invariant) \
                if self.vision is not None else None
            if embeds is not None:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, embeds=embeds)
            elif (self.graphs is not None and not prefills and not invariant
                    and self.graphs.can_run(meta.num_decodes)):
                hidden = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                         meta.decode_seq_lens)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            handle = self._sample(ordered, hidden)
        if cuda:
            handle.started, handle.previous_end = started, self._last_end
            handle.done = torch.cuda.Event(enable_timing=True)
            handle.done.record()
            self._last_end = handle.done
        return handle

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's tokens and hand them out per request."""
        idle = None
        if handle.done is not None:
            handle.done.synchronize()
            if handle.previous_end is not None:
                idle = handle.previous_end.elapsed_time(handle.started) / 1000
        if handle.logits is not None:
            self.last_logits = handle.logits
        if handle.sample is None:
            return RunnerOutput({}, {}, handle.prompt_logprobs, idle, handle.verified)
        result = handle.sample.to_host(handle.host)
        sampled = {s.request_id: t for s, t in zip(handle.sampling, result.token_ids, strict=True)}
        logprobs = {s.request_id: lp for s, lp in zip(handle.sampling, result.logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, logprobs, handle.prompt_logprobs, idle, handle.verified)

    def _sample(self, ordered, hidden: torch.Tensor) -> StepHandle:
        rows, sampling = [], []
        draft_rows, drafted = [], []
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
            if s.num_draft:
                draft_rows.extend(range(offset - s.num_draft - 1, offset))
                drafted.append(s)
            elif s.sample:
                rows.append(offset - 1)
                sampling.append(s)
        prompt_logprobs = self._score(hidden, score_rows, score_targets) if score_rows else {}
        if not sampling and not drafted:
            return StepHandle([], {}, None, None, prompt_logprobs)
        # Rows rise strictly, so n of them ending at n - 1 are every row (a decode-only step): no gather.
        chosen_rows = hidden if not drafted and len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1 \
            else hidden[to_device(rows + draft_rows, hidden.device)]
        logits = self.model.compute_logits(chosen_rows).float()
        # Verification reads its choices back at once: drafted steps are never pipelined.
        verified = {s.request_id: run for s, run in zip(drafted, verify(logits[len(rows):], drafted), strict=True)} \
            if drafted else {}
        if not sampling:
            return StepHandle([], {}, None, None, prompt_logprobs, verified=verified)
        logits = logits[:len(rows)]
        captured = {s.request_id: logits[i].cpu().clone() for i, s in enumerate(sampling)} \
            if self.capture_logits else None
        if any(s.banned for s in sampling):
            apply_bans(logits, [banned_next_tokens(s.history, s.banned) if s.banned else [] for s in sampling])
        chosen: DeviceSample = sample_on_device(logits, [s.params for s in sampling],
                                                [s.generator for s in sampling])
        tensors = chosen.tensors()
        if logits.is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        else:
            host = tensors
        return StepHandle(sampling, {s.request_id: i for i, s in enumerate(sampling)}, chosen, host,
                          prompt_logprobs, logits=captured, verified=verified)

    def _score(self, hidden: torch.Tensor, rows: list[int], targets: list[tuple[str, int, int]],
               chunk: int = 256) -> dict[str, dict[int, float]]:
        """Log-probabilities of given prompt tokens, a chunk of rows at a time to bound memory."""
        out: dict[str, dict[int, float]] = {}
        for i in range(0, len(rows), chunk):
            idx = to_device(rows[i:i + chunk], hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            tokens = to_device([t for _, _, t in targets[i:i + chunk]], logprobs.device)
            picked = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
            for (rid, pos, _), lp in zip(targets[i:i + chunk], picked, strict=True):
                out.setdefault(rid, {})[pos] = lp
        return out

    def _prepare(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest],
                 previous: StepHandle | None = None):
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        drafts = any(s.num_draft for s in decodes)
        if drafts:  # a drafted request's rows are decode rows of one sequence (engine/speculative.py)
            decodes = [_DecodeRow(s, j) for s in decodes for j in range(len(s.token_ids))]
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
            span_table = table[: -(-(s.start + n) // bs)]
            spans.append(PrefillSpan(
                token_start=len(ids) - n, num_tokens=n, num_cached=s.start,
                block_table=to_device(span_table, self.device), mask=s.mask,
                block_ids=span_table.tolist(),
            ))
        meta = AttentionMetadata(
            slot_mapping=self._upload(np.concatenate(slot_chunks)),
            num_decodes=nd,
            prefills=spans,
            multi_row_decodes=drafts,
        )
        if nd:
            seq_lens = [s.start + 1 for s in decodes]
            max_blocks = -(-max(seq_lens) // bs)
            tables = np.zeros((nd, max_blocks), dtype=np.int64)
            for i, s in enumerate(decodes):
                n = -(-seq_lens[i] // bs)
                tables[i, :n] = s.block_table[:n]
            meta.decode_block_tables = self._upload(tables)
            meta.decode_seq_lens = self._upload(np.asarray(seq_lens, dtype=np.int64))
            meta.decode_max_len = max(seq_lens)
        input_ids = self._upload(np.asarray(ids, dtype=np.int64))
        holes = [(row, s.request_id) for row, s in enumerate(decodes) if s.token_ids[0] == PLACEHOLDER]
        # A placeholder is always its request's last token, so only a chunk's last row can hold one.
        holes += [(span.token_start + span.num_tokens - 1, s.request_id)
                  for span, s in zip(spans, prefills, strict=True) if s.token_ids[-1] == PLACEHOLDER]
        if holes:
            self._fill_placeholders(input_ids, holes, previous)
        positions = self._upload(np.concatenate(pos_chunks))
        return input_ids, positions, meta

    def _fill_placeholders(self, input_ids: torch.Tensor, holes: list[tuple[int, str]],
                           previous: StepHandle | None) -> None:
        """Put the previous step's sampled tokens, still on the device, into the PLACEHOLDER rows."""
        if previous is None or previous.sample is None or any(rid not in previous.rows for _, rid in holes):
            raise RuntimeError("a step has placeholder tokens that the previous step did not sample")
        dst = to_device([row for row, _ in holes], self.device)
        src = to_device([previous.rows[rid] for _, rid in holes], self.device)
        input_ids[dst] = previous.sample.token_ids[src]

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A step input on the device, copied without waiting for the steps queued before it."""
        return to_device(array, self.device)


class _DecodeRow:
    """Row j of a drafted decode: its token at row start + j, seeing the rows before it."""

    __slots__ = ("block_table", "request_id", "start", "token_ids")

    def __init__(self, s: ScheduledRequest, j: int) -> None:
        self.request_id, self.block_table = s.request_id, s.block_table
        self.start, self.token_ids = s.start + j, s.token_ids[j:j + 1]
