"""Which slice of each weight a rank holds (`ShardPlan`), and the per-rank model shape it implies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.models.config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: row ranges (start, end) into the checkpoint's tensors.

    NOTE: query heads are split in order, so rank r's heads are one contiguous run; with fewer KV heads
    than ranks, that run lies inside one KV head's group, and the rank holds a copy of that KV head."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the padded vocabulary; rows past vocab_size are zeros
    head_dim: int
    vocab_size: int  # the model's, unpadded

    @classmethod
    def for_rank(cls, mc: ModelConfig, rank: int, size: int) -> ShardPlan:
        hq = mc.num_heads // size
        if mc.num_kv_heads >= size:
            hkv = mc.num_kv_heads // size
            kv = (rank * hkv, (rank + 1) * hkv)
        else:
            replicas = size // mc.num_kv_heads
            kv = (rank // replicas, rank // replicas + 1)
        inter = mc.intermediate_size // size
        per_rank_vocab = -(-mc.vocab_size // size)
        return cls(rank, size, (rank * hq, (rank + 1) * hq), kv, (rank * inter, (rank + 1) * inter),
                   (rank * per_rank_vocab, (rank + 1) * per_rank_vocab), mc.head_dim, mc.vocab_size)

    @property
    def q_rows(self) -> tuple[int, int]:
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    @property
    def local_vocab(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local_config(self, mc: ModelConfig) -> ModelConfig:
        """The shape of this rank's model: its heads, its MLP width and its rows of the vocabulary."""
        return dataclasses.replace(mc, num_heads=self.q_heads[1] - self.q_heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   vocab_size=self.local_vocab)
