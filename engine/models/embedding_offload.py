"""memory.embedding_offload: keep the input embedding table in host memory and gather rows there.

A step only needs the rows of its own tokens, so on a GPU the table (vocab x hidden, 328 MB for
Llama-2-13B in fp16) can stay in host RAM: the host gathers the step's rows and copies them over,
a few KB per token, and the device memory goes to the KV cache instead (the seed article's
"embedding layer offloaded to the CPU"). On a CPU-only engine the table is in host memory either
way, so nothing is saved; the same code path runs, and the tests check it changes nothing.
With tied embeddings the LM head multiplies by the same table on the device every step, so
offloading it would save nothing there either, and the engine leaves the table where it is.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class HostEmbedding(nn.Module):
    """Wraps an embedding module (full precision or quantized) kept on the host."""

    def __init__(self, inner: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.inner = inner
        self.device = device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.inner(ids.to("cpu"))
        if self.device.type == "cuda":
            rows = rows.pin_memory()  # so the copy below does not wait on the host
        return rows.to(self.device, non_blocking=True)


def offload_embedding(model: nn.Module, device: torch.device) -> bool:
    """Move the model's input embedding to the host; False (and a log line) when it cannot help."""
    if getattr(model, "lm_head", None) is None:
        log.warning("embedding_offload has no effect with tied embeddings: the LM head needs the table on "
                    "the device")
        return False
    if isinstance(model.embed_tokens, HostEmbedding):
        return True
    model.embed_tokens = HostEmbedding(model.embed_tokens.to("cpu"), device)
    return True
