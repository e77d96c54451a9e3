"""Small host values onto the device without waiting for the work already queued there.

`torch.tensor(values, device="cuda")` copies from pageable memory, and a
blocking host-to-device copy synchronises the stream: the host would wait for
every step already queued, which undoes pipelined scheduling. `to_device`
stages the values in pinned memory (torch's caching host allocator, which
keeps the block until the copy has read it) and copies without blocking. On
the CPU it is a plain tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, a numpy array or a CPU tensor) as a tensor on `device`."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu")  # on the host even under a default device
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    if host.device.type != "cpu":  # already on a device: a device-side copy, nothing to pin
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)
