"""A fixed orthogonal rotation of every query and key row after RoPE, for 8-bit KV caches.

For an orthogonal R, (q R)(k R)^T = q k^T: attention scores, and so the output, are unchanged in exact
arithmetic, whatever backend runs. What changes is what the cache stores. K rows after RoPE carry a few
large channels, and E4M3's 3 mantissa bits round the many small ones coarsely; a normalised Hadamard
matrix spreads every row's energy evenly over its channels first, which cuts fp8 K's rounding loss
(docs/perf/gpu.md, "8-bit KV caches"). V is not rotated: its loss is small, and rotating it measured worse.

NOTE: the rotation is part of what the cache means: cached blocks and the full-precision window hold
rotated keys, so it is fixed for the engine's life, like the fp8 scales.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError

CHOICES = ("auto", "hadamard", "none")


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester-Hadamard matrix scaled by 1/sqrt(n) (orthogonal and symmetric); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # [[H, H], [H, -H]]: a few lines, not worth a scipy dependency
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).float()


def resolve_key_rotation(requested: str, cache_format: str, head_dim: int,
                         device: torch.device) -> torch.Tensor | None:
    """The rotation an 8-bit cache of `cache_format` uses, or None. auto: Hadamard for fp8 where head_dim is a
    power of two (int8's per-row scales lose little, so it stays unrotated); hadamard: on either format."""
    if requested not in CHOICES:
        raise InvalidRequestError(f"kv_key_rotation must be auto, hadamard or none, got {requested!r}")
    power_of_two = head_dim > 0 and not head_dim & (head_dim - 1)
    if requested == "hadamard" and not power_of_two:
        raise InvalidRequestError(f"kv_key_rotation hadamard needs a power-of-two head_dim, the model's is {head_dim}: "
                                  f"use auto or none")
    if requested == "none" or (requested == "auto" and (cache_format != "fp8" or not power_of_two)):
        return None
    return hadamard(head_dim).to(device)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ rotation, computed in fp32 and returned in x's dtype."""
    return (x.float() @ rotation).to(x.dtype)
