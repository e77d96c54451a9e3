"""The 8-bit KV caches (cache_bits: 8; int8 or fp8 by cache_format) and their full-precision window of recent rows.

Storage, per layer: K and V as int8 [2, blocks, block_size, kv_heads, head_dim] with one fp16
scale per (token, kv head) [2, blocks, block_size, kv_heads], addressed by the same slots as the
full-precision cache, so the block manager, prefix cache and LRU eviction are unchanged. A row
costs head_dim + 2 bytes instead of 4 * head_dim (fp32) or 2 * head_dim (bf16).

Dynamic precision (`kv_fp_window` W > 0): each running sequence also keeps its last W rows at full
precision in a ring [2, slots, W, kv_heads, head_dim] (row r at r % W of its slot). A query at row
i reads rows >= i + 1 - W from the ring and older rows from the int8 pool, in decode and in prefill
alike, so chunking never changes the numbers. Rows the sequence did not compute itself (a
prefix-cache hit) exist only in int8. Semantics with W = 0: every read, including a prefill chunk
attending to itself, sees the stored int8 values, which is what perplexity then measures.

fp8 (cache_format: fp8): K and V as float8_e4m3fn with one fp32 scale per (K|V, kv head) [2, kv_heads]
for the whole layer, a static scale rather than a dynamic one, so a stored code never changes meaning
and prefix-cache blocks stay valid. engine/quant/kv_scales.py sets `scales` once at start-up (kv_scales):
E4M3 holds +-448 with 3 mantissa bits, and rows saturate at that bound. A row costs head_dim bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.transfer import to_device

KV_SCALE_DTYPE = torch.float16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
CACHE_FORMATS = ("int8", "fp8")
_SCALE_MIN = float(torch.finfo(torch.float16).tiny)  # rows smaller than 127 * this round to 0
_SCALE_MAX = float(torch.finfo(torch.float16).max)


@dataclass
class Int8KVCache:
    """One layer's 8-bit K/V, their scales, and the optional full-precision ring.

    int8: values int8, scales fp16 [2, blocks, block_size, kv_heads]; fp8: values float8_e4m3fn,
    scales fp32 [2, kv_heads]."""

    values: torch.Tensor
    scales: torch.Tensor
    window: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.values.dtype == FP8_DTYPE

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, window: int, slots: int,
                 dtype: torch.dtype, device: torch.device, cache_format: str = "int8") -> Int8KVCache:
        ring = (torch.zeros(2, slots, window, kv_heads, head_dim, dtype=dtype, device=device)
                if window else None)
        if cache_format == "fp8":
            values = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.uint8, device=device)
            return cls(values.view(FP8_DTYPE), torch.ones(2, kv_heads, dtype=torch.float32, device=device), ring)
        return cls(torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.int8, device=device),
                   torch.zeros(2, num_blocks, block_size, kv_heads, dtype=KV_SCALE_DTYPE, device=device), ring)


def resolve_cache_format(requested: str, device: torch.device) -> str:
    """cache_format for cache_bits 8 on `device`. auto is int8 everywhere: per-head fp8, even with calibrated
    scales, loses more perplexity than per-token int8 (docs/perf/gpu.md), so fp8 is opt-in. fp8 needs CUDA
    sm_89+ on a GPU; on the CPU it runs the torch reference."""
    cuda_fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if requested == "auto":
        return "int8"
    if requested == "fp8" and device.type == "cuda" and not cuda_fp8:
        from engine.errors import ModelLoadError

        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ModelLoadError(f"quantization.cache_format: fp8 needs a CUDA GPU of compute capability 8.9 or "
                             f"newer (this one is {cap}); use int8 or auto")
    if requested not in CACHE_FORMATS:
        raise ValueError(f"unknown cache_format {requested!r}")
    return requested


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> int8 codes and one fp16 scale per row (absmax / 127, rounded to fp16
    first, so the codes are computed with the scale that is stored)."""
    scale = (x.detach().abs().amax(-1).float() / 127).clamp(_SCALE_MIN, _SCALE_MAX).to(KV_SCALE_DTYPE)
    codes = torch.round(x.float() / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype) * scale.to(dtype).unsqueeze(-1)


def quantize_fp8(x: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] -> E4M3 codes of x / head_scale [kv_heads], saturated at +-448."""
    return (x.float() / head_scale.view(-1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def write_int8(cache: Int8KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, nb, bs, kvh, hd = cache.values.shape
    if cache.is_fp8:  # index_copy_ through a byte view: not every device implements it for fp8
        values = cache.values.view(torch.uint8).view(2, nb * bs, kvh, hd)
        for i, x in enumerate((k, v)):
            values[i].index_copy_(0, slot_mapping, quantize_fp8(x, cache.scales[i]).view(torch.uint8))
        return
    values = cache.values.view(2, nb * bs, kvh, hd)
    scales = cache.scales.view(2, nb * bs, kvh)
    for i, x in enumerate((k, v)):
        codes, scale = quantize_rows(x)
        values[i].index_copy_(0, slot_mapping, codes)
        scales[i].index_copy_(0, slot_mapping, scale)


def gather_dequantized(cache: Int8KVCache, block_tables: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the block tables as [B, blocks * block_size, kv_heads, head_dim] in `dtype`."""
    _, _, bs, kvh, hd = cache.values.shape
    b, nb = block_tables.shape
    idx = block_tables.reshape(-1)
    out = []
    if cache.is_fp8:
        values = cache.values.view(torch.uint8)
        for i in range(2):
            codes = values[i].index_select(0, idx).view(FP8_DTYPE).view(b, nb * bs, kvh, hd)
            out.append((codes.float() * cache.scales[i].float().view(1, 1, kvh, 1)).to(dtype))
        return out[0], out[1]
    for i in range(2):
        codes = cache.values[i].index_select(0, idx).view(b, nb * bs, kvh, hd)
        scale = cache.scales[i].index_select(0, idx).view(b, nb * bs, kvh)
        out.append(dequantize_rows(codes, scale, dtype))
    return out[0], out[1]


# ---- the full-precision window -------------------------------------------------------------------

@dataclass
class KVWindowMetadata:
    """What the backends need to read and write the rings in one step."""

    size: int
    write_rows: torch.Tensor  # rows of the flat batch whose K/V go into a ring
    write_index: torch.Tensor  # their ring rows: slot * size + position % size
    decode_slots: torch.Tensor | None = None  # [num_decodes]
    decode_lo: torch.Tensor | None = None  # [num_decodes]: first row read from the ring
    span_slots: list[int] = field(default_factory=list)  # per prefill span
    span_ring_start: list[int] = field(default_factory=list)  # first row the span's sequence holds in its ring

    def fp_start(self, span_index: int, num_cached: int) -> int:
        """First row of a prefill span's sequence that some query of the span reads at full precision."""
        return max(num_cached + 1 - self.size, self.span_ring_start[span_index], 0)


def write_ring(cache: Int8KVCache, k: torch.Tensor, v: torch.Tensor, meta: KVWindowMetadata) -> None:
    ring = cache.window
    _, slots, w, kvh, hd = ring.shape
    flat = ring.view(2, slots * w, kvh, hd)
    flat[0].index_copy_(0, meta.write_index, k.index_select(0, meta.write_rows))
    flat[1].index_copy_(0, meta.write_index, v.index_select(0, meta.write_rows))


def read_ring(cache: Int8KVCache, slot: int, rows: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one sequence's ring, as [len(rows), kv_heads, head_dim] copies."""
    ring = cache.window
    w = ring.shape[2]
    idx = to_device([slot * w + r % w for r in rows], ring.device, torch.long)
    flat = ring.view(2, -1, *ring.shape[3:])
    return flat[0].index_select(0, idx), flat[1].index_select(0, idx)


class KVWindowSlots:
    """Which ring slot each running sequence holds (the model runner's side of the window).

    A sequence takes a slot when it is first scheduled and gives it back when the scheduler reports
    it finished or preempted; at most max_num_seqs run at once, so that many slots suffice.
    """

    def __init__(self, size: int, num_slots: int) -> None:
        self.size = size
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._ring_start: dict[str, int] = {}

    def release(self, request_ids) -> None:
        for rid in request_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
                self._ring_start.pop(rid, None)

    def metadata(self, decodes, prefills, device: torch.device) -> KVWindowMetadata:
        """Metadata for a step laid out as [decode rows | prefill chunks] (ScheduledRequests)."""
        w = self.size
        rows, index = [], []
        offset = 0
        for s in [*decodes, *prefills]:
            if s.request_id not in self._slot:
                if not self._free:
                    raise RuntimeError("more running sequences than KV window slots")
                self._slot[s.request_id] = self._free.pop()
                self._ring_start[s.request_id] = s.start
            slot, n = self._slot[s.request_id], len(s.token_ids)
            for j in range(max(0, n - w), n):  # only the last W rows of a chunk survive in the ring
                rows.append(offset + j)
                index.append(slot * w + (s.start + j) % w)
            offset += n
        meta = KVWindowMetadata(
            size=w,
            write_rows=to_device(rows, device, torch.long),
            write_index=to_device(index, device, torch.long),
            span_slots=[self._slot[s.request_id] for s in prefills],
            span_ring_start=[self._ring_start[s.request_id] for s in prefills],
        )
        if decodes:
            meta.decode_slots = to_device([self._slot[s.request_id] for s in decodes], device, torch.long)
            meta.decode_lo = to_device([max(s.start + 1 - w, self._ring_start[s.request_id]) for s in decodes],
                                       device, torch.long)
        return meta
