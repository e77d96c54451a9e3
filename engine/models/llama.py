"""Llama-family decoder over a flat token batch with a paged KV cache.

Covers Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2 (qkv bias), Qwen3
(per-head q/k RMSNorm) and SmolLM2 (tied embeddings, GQA). Projections are
fused (qkv, gate_up) so each layer runs four GEMMs; the loader fills the fused
weights from the checkpoint's separate tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.linear import Linear, linear
from engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in fp32, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Embedding(nn.Embedding):
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits over the vocabulary from hidden states."""
        return linear(hidden, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            from engine.models.fused_ops import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, meta) -> torch.Tensor:
        if x.is_cuda:
            # Fused on the GPU: the residual add and the next norm in one pass over the hidden state.
            from engine.models.fused_ops import add_rms_norm

            h, _ = add_rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
            attn = self.self_attn(h, positions, rope, kv_cache, meta)
            h, x = add_rms_norm(attn, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, x)
            return x + self.mlp(h)
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """forward() maps flat token ids to hidden states; compute_logits() projects chosen rows."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE tables are computed, not loaded, so they are built for real right away.
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                    dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)
