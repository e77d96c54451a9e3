"""The tensor-parallel Llama: the same module as engine.models.llama, built at one rank's shape, plus the
collectives that join the shards.

- qkv and gate_up are column-parallel: each rank computes its heads and its slice of the MLP width, with
  no communication.
- o and down are row-parallel: each rank's product is a partial sum, all-reduced in place by a forward
  hook, so the layers' own code (workspace chunks, quantized modules, the Triton path) runs unchanged.
- The embedding holds a slice of the vocabulary's rows: a token outside it looks up zeros, and one
  all-reduce gives every rank the full row. The LM head (tied or not) computes each rank's slice of
  the logits; they are all-gathered and the padding past vocab_size is cut off.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.models.linear import invariant_enabled
from engine.models.llama import Embedding, LlamaForCausalLM
from engine.parallel.sharding import ShardPlan
from engine.quant.modules import QuantizedEmbedding


class Leader(Protocol):
    """Rank 0's channel to the other ranks: each message is a command they run next (rank.serve)."""

    def send(self, message: tuple) -> None: ...


def _vocab_parallel_lookup(lookup, input_ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows of the whole vocabulary from a table holding rows [start, start + count): others look up zeros,
    and the all-reduce adds each row from the one rank that holds it."""
    local = input_ids - start
    outside = (local < 0) | (local >= count)
    rows = lookup(local.masked_fill(outside, 0))
    rows.masked_fill_(outside.unsqueeze(-1), 0.0)
    dist.all_reduce(rows)
    return rows


class VocabParallelEmbedding(Embedding):
    vocab_start: int = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_lookup(lambda ids: F.embedding(ids, self.weight), input_ids, self.vocab_start,
                                      self.num_embeddings)


class VocabParallelQuantizedEmbedding(QuantizedEmbedding):
    vocab_start: int = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_lookup(super().forward, input_ids, self.vocab_start, self.num_embeddings)


def _all_reduce_output(module, inputs, output: torch.Tensor) -> None:
    dist.all_reduce(output)  # in place: the partial sums of a row-parallel product become the full product


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard. On rank 0 (`leader` set), forward() and compute_logits() first tell the other
    ranks to run the same call, so every collective is entered by every rank in the same order."""

    leader: Leader | None = None
    plan: ShardPlan
    # NOTE: the CPU one-call decoder (fused_decode) runs every layer in one C++ call with no place for the
    # all-reduces, so a shard always runs the layers: whatever tune_model installs is dropped.
    fused_decoder = property(lambda self: None, lambda self, value: None)

    def finish_sharding(self, plan: ShardPlan) -> None:
        """Turn the modules built at the rank's shape into their parallel forms; call after loading."""
        self.plan = plan
        quantized = isinstance(self.embed_tokens, QuantizedEmbedding)
        self.embed_tokens.__class__ = VocabParallelQuantizedEmbedding if quantized else VocabParallelEmbedding
        self.embed_tokens.vocab_start = plan.vocab[0]
        self.install_row_parallel_hooks()

    def install_row_parallel_hooks(self) -> None:
        """Hooks on whatever modules o_proj and down_proj are now (after any module swap)."""
        for layer in self.layers:
            for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                if not getattr(module, "_tp_hooked", False):
                    module.register_forward_hook(_all_reduce_output)
                    module._tp_hooked = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, embeds: torch.Tensor | None = None) -> torch.Tensor:
        if embeds is not None:  # image features: vision models are refused at start-up (validation.py)
            raise RuntimeError("a tensor-parallel model takes token ids, not embeddings")
        if self.leader is not None:
            self.leader.send(("forward", input_ids, positions, meta, invariant_enabled()))
        return super().forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary for `hidden`'s rows. On the other ranks `hidden` is a buffer of
        the right shape that rank 0's rows are broadcast into."""
        if self.leader is not None:
            self.leader.send(("logits", hidden.shape[0], invariant_enabled()))
            hidden = hidden.contiguous()
        dist.broadcast(hidden, src=0)
        local = super().compute_logits(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.plan.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, :self.plan.vocab_size]
