"""Per-layer choice of quantization scales by output error on calibration activations.

For a layer y = x W^T and a weight error E = W - Q(W), the output error over the calibration rows
is sum_n E_n H E_n^T with H = mean x^T x (calibration.LayerStats). Evaluated exactly that costs
N K^2 per candidate, which for every candidate of every layer is minutes on a CPU; `ErrorMetric`
evaluates it in N K r instead, from H's top-r eigen-directions (where the activations' outlier
channels live and rounding errors correlate) plus the diagonal H leaves once those are taken out
(where independent rounding errors land). Two searches use it:

- Activation-aware input scaling: weights of input channels with large activations matter more,
  so scale them up by s = mean|x|^alpha before quantizing (and fold 1/s into the previous op);
  alpha is searched on the layer's output error, alpha = 0 (no scaling) included.
- Clipping: a narrower range trades error on outliers for finer steps everywhere else; the ratio
  is chosen per output channel (int8; the error is separable per channel, so this is the exact
  optimum over the grid; fp8 likewise, where a ratio moves each weight on E4M3's uneven grid and
  keeps small weights out of its subnormal range) or per group (int4; using the group's block of H, as AWQ's clip search
  does, which leaves out the cross-group terms).
Without statistics every ratio is 1: plain round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.quantizers import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    dequantize_int4_codes,
    dequantize_int8,
    fp8_scales,
    int4_params,
    int8_scales,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

INT8_CLIPS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8)
FP8_CLIPS = (1.0, 0.985, 0.97, 0.955, 0.94, 0.92, 0.9, 0.875)
INT4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
ALPHAS = (0.0, 0.15, 0.3, 0.45, 0.6)
METRIC_RANK = 32
_ROWS_PER_CHUNK = 8192  # output rows per error evaluation, to bound memory on the LM head


@dataclass(frozen=True)
class ErrorMetric:
    """E H E^T per output row, approximated as ||E B||^2 + (E * E) d, where B B^T is H's best
    rank-r part and d the diagonal of what remains (exact when r = K)."""

    basis: torch.Tensor  # [K, r]
    diag: torch.Tensor  # [K]

    @classmethod
    def from_hessian(cls, hessian: torch.Tensor, rank: int = METRIC_RANK) -> ErrorMetric:
        h = hessian.float()
        rank = min(rank, h.shape[0])
        # H is symmetric PSD, so its eigenvalues are its singular values.
        gen = torch.Generator(device=h.device).manual_seed(0)
        u, s, _ = _svd_lowrank(h, rank, gen)
        basis = u * s.clamp(min=0).sqrt()
        return cls(basis, (torch.diagonal(h) - basis.pow(2).sum(1)).clamp(min=0))

    def scaled(self, s: torch.Tensor) -> ErrorMetric:
        """The metric of the inputs x / s (weights W diag(s))."""
        return ErrorMetric(self.basis / s[:, None], self.diag / s.pow(2))

    def rows(self, err: torch.Tensor) -> torch.Tensor:
        """Per output row; `err` is overwritten."""
        projected = (err @ self.basis).pow_(2).sum(1)
        return projected.add_(err.square_() @ self.diag)


def _svd_lowrank(h: torch.Tensor, rank: int, gen: torch.Generator, oversample: int = 8):
    """H's top-`rank` eigenpairs by a randomized range finder with one power iteration (Halko et
    al.), seeded so that quantization is reproducible (torch.svd_lowrank draws from the global
    generator)."""
    k = h.shape[0]
    q = min(k, rank + oversample)
    y = h @ (h @ torch.randn(k, q, generator=gen, device=h.device, dtype=h.dtype))
    basis, _ = torch.linalg.qr(y)
    vals, vecs = torch.linalg.eigh(basis.T @ h @ basis)
    top = vals.argsort(descending=True)[:rank]
    return basis @ vecs[:, top], vals[top], None


def int8_rounding_error(w: torch.Tensor, clip: torch.Tensor | float = 1.0,
                        absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Q(w) - w for int8 per-channel rounding at `clip`, without building the codes (the searches
    evaluate many candidates, and this is 4 passes over the weight instead of 8)."""
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scales = (absmax * clip / INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)[:, None]
    t = w / scales
    return t.round_().clamp_(-INT8_MAX, INT8_MAX).mul_(scales).sub_(w)


def fp8_rounding_error(w: torch.Tensor, clip: torch.Tensor | float = 1.0,
                       absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Q(w) - w for fp8 (E4M3) per-channel rounding at `clip`."""
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scales = (absmax * clip / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)[:, None]
    t = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return t.mul_(scales).sub_(w)


@dataclass
class QuantizedWeight:
    bits: int
    qweight: torch.Tensor  # int8 or float8_e4m3fn [N, K], or packed int4 [N, K/2]
    scales: torch.Tensor  # fp32 [N] or fp16 [N, K/G]
    offsets: torch.Tensor | None = None  # int4: fp16 [N, K/G]
    codes: torch.Tensor | None = None  # int4: unpacked codes, kept for the error search

    @property
    def group_size(self) -> int | None:
        return None if self.bits == 8 else self.qweight.shape[1] * 2 // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        if self.bits == 8:  # int8 or fp8 codes times their row's scale
            return dequantize_int8(self.qweight, self.scales)
        assert self.codes is not None and self.offsets is not None
        return dequantize_int4_codes(self.codes, self.scales, self.offsets)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales}
        if self.offsets is not None:
            out[f"{prefix}.offsets"] = self.offsets
        return out


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None,
                    clip: torch.Tensor | float = 1.0, fp8: bool = False) -> QuantizedWeight:
    w = w.float()
    if fp8:
        assert bits == 8
        scales = fp8_scales(w, clip)
        return QuantizedWeight(8, quantize_fp8(w, scales), scales)
    if bits == 8:
        scales = int8_scales(w, clip)
        return QuantizedWeight(8, quantize_int8(w, scales), scales)
    assert group_size is not None
    scale, offset = int4_params(w, group_size, clip)
    codes = quantize_int4(w, scale, offset)
    return QuantizedWeight(4, pack_int4(codes), scale, offset, codes)


def output_error(err: torch.Tensor, hessian: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Per output row E_n H E_n^T ([N]); with a group size, per (row, group) using H's diagonal
    blocks ([N, K/G])."""
    n, k = err.shape
    out = []
    for start in range(0, n, _ROWS_PER_CHUNK):
        e = err[start:start + _ROWS_PER_CHUNK]
        if group_size is None:
            out.append(((e @ hessian) * e).sum(1))
        else:
            ng = k // group_size
            blocks = hessian.reshape(ng, group_size, ng, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
            eg = e.reshape(-1, ng, group_size)
            out.append(torch.einsum("ngi,gij,ngj->ng", eg, blocks, eg))
    return torch.cat(out)


def search_clip(w: torch.Tensor, bits: int, group_size: int | None, hessian: torch.Tensor,
                metric: ErrorMetric | None = None, fp8: bool = False) -> QuantizedWeight:
    """The clipping ratio per output channel (int8, fp8) or group (int4) with the least output error
    (8 bits: by `metric` when given, else exactly)."""
    w = w.float()
    grid = FP8_CLIPS if fp8 else INT8_CLIPS if bits == 8 else INT4_CLIPS
    best_err = best_clip = None
    absmax = w.abs().amax(dim=1)
    rounding_error = fp8_rounding_error if fp8 else int8_rounding_error
    for ratio in grid:
        if bits == 8 and metric is not None:
            err = metric.rows(rounding_error(w, ratio, absmax))
        else:
            q = quantize_weight(w, bits, group_size, ratio, fp8)
            err = output_error(w - q.dequantize(), hessian, None if bits == 8 else group_size)
        if best_err is None:
            best_err, best_clip = err, torch.full_like(err, ratio)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_clip = torch.where(better, torch.full_like(err, ratio), best_clip)
    return quantize_weight(w, bits, group_size, best_clip, fp8)


def search_input_scale(w: torch.Tensor, bits: int, group_size: int | None, metric: ErrorMetric,
                       mean_abs: torch.Tensor) -> torch.Tensor | None:
    """Per-input-channel scales s (W -> W diag(s), x -> x / s) minimising the layer's output error
    after round-to-nearest; None when no scaling (alpha = 0) is best."""
    w = w.float()
    act = mean_abs.float().clamp(min=1e-6)
    best_err, best = None, None
    for alpha in ALPHAS:
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        ws = w * s
        if bits == 8:  # the error of the scaled layer, measured on the inputs x / s it will see
            err = metric.scaled(s).rows(int8_rounding_error(ws)).sum().item()
        else:
            err = metric.rows(w - quantize_weight(ws, bits, group_size).dequantize() / s).sum().item()
        if best_err is None or err < best_err:
            best_err, best = err, (None if alpha == 0 else s)
    return best


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01) -> QuantizedWeight:
    """int4 with error feedback (GPTQ): columns are rounded one at a time and each rounding error is
    spread over the columns not yet rounded, through the inverse of H, so the layer's output error
    (not each weight's) is what gets minimised. A group's scale and offset are fixed when its first
    column comes up, from the weights as updated so far, with the clip ratio of least H-weighted error.
    """
    w = w.float().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty(n, k, dtype=torch.uint8)
    groups = k // group_size
    scales = torch.empty(n, groups, dtype=torch.float16)
    offsets = torch.empty(n, groups, dtype=torch.float16)
    block = group_size  # blocks aligned to groups, so a group's weights are up to date when it starts
    for b0 in range(0, k, block):
        b1 = b0 + block
        g = b0 // group_size
        scales[:, g], offsets[:, g] = _best_group_params(w[:, b0:b1], torch.diagonal(hessian)[b0:b1].float())
        s, o = scales[:, g].float(), offsets[:, g].float()
        wb, hb = w[:, b0:b1], hinv[b0:b1, b0:b1]
        errs = torch.empty_like(wb)
        for i in range(block):
            col = wb[:, i]
            q = torch.round((col - o) / s).clamp_(0, 15)
            codes[:, b0 + i] = q.to(torch.uint8)
            err = (col - (q * s + o)) / hb[i, i]
            wb[:, i:] -= err[:, None] * hb[i, i:][None, :]
            errs[:, i] = err
        w[:, b1:] -= errs @ hinv[b0:b1, b1:]
    return QuantizedWeight(4, pack_int4(codes), scales, offsets, codes)


def _best_group_params(wg: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset of one group of columns ([N, G]) with the clip ratio of least
    diag(H)-weighted rounding error."""
    best = best_err = None
    for ratio in INT4_CLIPS:
        scale, offset = int4_params(wg, wg.shape[1], ratio)
        deq = dequantize_int4_codes(quantize_int4(wg, scale, offset), scale, offset)
        err = ((wg - deq) ** 2 * weight).sum(1)
        if best is None:
            best, best_err = (scale[:, 0].clone(), offset[:, 0].clone()), err
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, scale[:, 0], best[0]), torch.where(better, offset[:, 0], best[1]))
    return best


def scale_hessian(hessian: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """H of the inputs x / s."""
    return hessian / s[:, None] / s[None, :]
