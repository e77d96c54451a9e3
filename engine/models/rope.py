"""Rotary position embeddings (rotate-half layout, as in HF checkpoints)."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.kernels.cpu_build import cpu_kernels, fused_cpu_ok


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # and the band in between is interpolated smoothly.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, interpolated, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if torch.device(device).type == "meta":
            # A placeholder in a model built on meta (loader.empty_model builds the real tables);
            # computing on meta would run torch's Python decompositions, which import torch._dynamo.
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(max_positions, head_dim, dtype=dtype, device=device),
                                     persistent=False)
            return
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, dim], k: [T, kv_heads, dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


    def apply_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """forward() in place (q and k may be views of the fused qkv output).

        fp32 on the CPU runs one fused kernel (engine/models/csrc/fused_cpu.cpp), which may round
        differently from forward() where the compiler fuses a multiply and an add; elsewhere
        apply_torch_().
        """
        if fused_cpu_ok(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64:
            cpu_kernels().rope_rows_(q, k, self.cos, self.sin, positions.contiguous())
            return
        self.apply_torch_(positions, q, k)

    def apply_torch_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """forward() in place with torch ops and half-width temporaries.

        Each element gets the same arithmetic as forward() (x1*cos - x2*sin, x2*cos + x1*sin), so the
        results are bitwise equal; cos and sin repeat across the two halves of the table.
        """
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions, :half].unsqueeze(1)
        sin = self.sin[positions, :half].unsqueeze(1)
        for x in (q, k):
            x1, x2 = x[..., :half], x[..., half:]
            x1_sin, x2_sin = x1 * sin, x2 * sin
            x1.mul_(cos).sub_(x2_sin)
            x2.mul_(cos).add_(x1_sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
