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
from engine.attention.key_rotation import rotate
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu_build import cpu_kernels, fused_cpu_ok
from engine.models.compact_weights import is_compact
from engine.models.config import ModelConfig
from engine.models.linear import Linear, linear, prefill_step
from engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.dim() == 2 and x.stride(-1) == 1 and fused_cpu_ok(x):
                return cpu_kernels().rms_norm_rows(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in fp32, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta in place, then this norm of the sum (one pass on the fp32 CPU path)."""
        if residual.dim() == 2 and residual.stride(-1) == 1 and delta.stride(-1) == 1 and fused_cpu_ok(residual):
            return cpu_kernels().add_rms_norm_rows(residual, delta, self.weight, self.eps)
        return self(residual.add_(delta))


class Embedding(nn.Embedding):
    packed_head: torch.Tensor | None = None  # the weight packed for the LM head (prepack_linears)

    def reset_parameters(self) -> None:
        # A meta weight has no values to initialize; torch's meta path for normal_ would import
        # torch._dynamo (and with it Triton) for nothing. The loader assigns the real weights.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:  # freed: the rows come from the compact panels of the tied head (the same bits)
            if not is_compact(self.packed_head):
                raise RuntimeError("the embedding table was freed but has no compact panels to rebuild rows from")
            rows = cpu_kernels().compact_rows(self.packed_head, input_ids, self.num_embeddings)
            return rows.view(*input_ids.shape, self.embedding_dim)
        return super().forward(input_ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits over the vocabulary from hidden states."""
        return linear(hidden, self.weight, packed=self.packed_head)


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
        self.fused_rope_kv = False  # RoPE and the K/V write in one Triton launch (LlamaForCausalLM.enable_triton_fusions)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        rotation = self.backend.key_rotation
        if self.fused_rope_kv:  # RoPE, any key rotation and K/V into the cache, one launch; the backend skips its write
            from engine.models.fused_ops import rope_write_kv

            rope_write_kv(qkv, positions, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim,
                          kv_cache, meta.slot_mapping, rotation)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        del qkv
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if not self.fused_rope_kv:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            rope.apply_(positions, q, k)  # in place: q and k are views of this layer's qkv output
        if rotation is not None and not self.fused_rope_kv:  # fused: the kernel has rotated q and k already
            q, k = rotate(q, rotation), rotate(k, rotation)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        del q, k, v  # the qkv output is not needed past attention: free it before o_proj allocates
        return self.o_proj(out)


class ActivationWorkspace:
    """MLP buffers that every layer reuses for prefills of more than `rows` tokens.

    Such a prefill runs its MLP in chunks of `rows` tokens, into these buffers, and adds each
    chunk's output to the residual stream in place. Without it a 4096-token prefill holds
    [4096, 2 * intermediate] and [4096, intermediate] activations at once (measured in
    docs/BENCHMARKS.md). Layers run one at a time, so one workspace serves them all.
    """

    def __init__(self, rows: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = rows
        self.gate_up = torch.empty(rows, 2 * intermediate, dtype=dtype, device=device)
        self.down = torch.empty(rows, hidden, dtype=dtype, device=device)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.workspace: ActivationWorkspace | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activate(self.gate_up_proj(x)))

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up; on the CPU written over the gate half of `gate_up`, which nothing else reads."""
        if gate_up.is_cuda:
            from engine.models.fused_ops import silu_mul

            return silu_mul(gate_up)
        if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and fused_cpu_ok(gate_up):
            cpu_kernels().silu_mul_rows_(gate_up, self.intermediate)  # one pass, bitwise the two ops below
            return gate_up[:, :self.intermediate]
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def delta(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """MLP(x), for the caller to add to the residual stream; None when a prefill larger than the
        workspace has already been added to `residual` chunk by chunk."""
        ws = self.workspace
        if ws is None or x.shape[0] <= ws.rows:
            return self(x)
        self.add_to(x, residual)
        return None

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += MLP(x), in place; in workspace-sized chunks when x has more rows than the workspace."""
        ws = self.workspace
        if ws is None or x.shape[0] <= ws.rows:
            return residual.add_(self(x))
        for start in range(0, x.shape[0], ws.rows):
            end = min(start + ws.rows, x.shape[0])
            act = self._activate(_project(self.gate_up_proj, x[start:end], ws.gate_up[:end - start]))
            residual[start:end].add_(_project(self.down_proj, act, ws.down[:end - start]))
        return residual


def _project(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A plain Linear writes into the workspace; quantized modules return their own tensor."""
    if isinstance(module, Linear):
        return module(x, out=out)
    return module(x.contiguous())


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
            return self.mlp.add_to(h, x)
        # The residual stream is this forward pass's own tensor (the embedding output): added to in place.
        attn = self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return self.mlp.add_to(self.post_attention_layernorm.add_and_norm(x, attn), x)


class LlamaForCausalLM(nn.Module):
    """forward() maps flat token ids to hidden states; compute_logits() projects chosen rows."""

    # Decode-only steps in one C++ call (engine.models.fused_decode.FusedDecoder), installed by the engine at
    # start where it computes exactly what the layers do; None: the layers run.
    fused_decoder = None

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
                meta: AttentionMetadata, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`embeds`, when given, replaces the token embeddings (image features at image positions)."""
        fused = self.fused_decoder
        if embeds is None and not self.triton_fusions and fused is not None and fused.applies(input_ids.shape[0], meta):
            return fused(input_ids, positions, kv_caches, meta)
        x = self.embed_tokens(input_ids) if embeds is None else embeds
        if self.triton_fusions:
            return self._triton_layers(x, positions, kv_caches, meta)
        # A step with prompt tokens lets linears with a bf16 copy (cpu_prefill_dtype) run in bf16.
        with prefill_step(bool(meta.prefills)):
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x = layer(x, positions, self.rope, kv_cache, meta)
        return self.norm(x)

    # The GPU path (enable_triton_fusions): each residual add is fused into the next RMSNorm.
    triton_fusions: bool = False

    def enable_triton_fusions(self) -> None:
        """Run the decoder with the Triton kernels of engine.models.fused_ops: each layer's MLP output is
        added to the residual stream by the next norm's kernel (the final norm's too), and, where every
        layer's attention allows it, RoPE, any key rotation and the K/V write are one launch. About ten
        launches per layer instead of about thirty; on a GPU their fixed cost is what a small decode step
        mostly pays.
        The engine turns this on for CUDA devices; under TRITON_INTERPRET=1 it runs on the CPU (tests)."""
        self.triton_fusions = True
        backend = self.layers[0].self_attn.backend
        rope_ok = (self.rope.cos.shape[-1] == self.config.head_dim and backend.accepts_prewritten_kv
                   and all(layer.self_attn.q_norm is None and layer.self_attn.backend is backend
                           for layer in self.layers))
        for layer in self.layers:
            layer.self_attn.fused_rope_kv = rope_ok
        backend.kv_prewritten = rope_ok

    def _triton_layers(self, x, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        from engine.models.fused_ops import add_rms_norm

        residual, delta = x, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            norm = layer.input_layernorm
            h, residual = add_rms_norm(delta if delta is not None else residual, norm.weight, norm.eps,
                                       residual if delta is not None else None)
            attn = layer.self_attn(h, positions, self.rope, kv_cache, meta)
            norm = layer.post_attention_layernorm
            h, residual = add_rms_norm(attn, norm.weight, norm.eps, residual)
            delta = layer.mlp.delta(h, residual)
        out, _ = add_rms_norm(delta if delta is not None else residual, self.norm.weight, self.norm.eps,
                              residual if delta is not None else None)
        return out

    @staticmethod
    def layer_linears(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """A decoder layer's projections in the order a step runs them: qkv, o, gate_up, down."""
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def decoder_linears(self) -> list[nn.Module]:
        """Every layer's projections (layer_linears), layer after layer: the 120 products of a step's decoder for
        SmolLM2, the LM head not included."""
        return [m for layer in self.layers for m in self.layer_linears(layer)]

    def use_workspace(self, workspace: ActivationWorkspace | None) -> None:
        """Share one activation workspace among all layers (None: every MLP runs in one pass)."""
        for layer in self.layers:
            layer.mlp.workspace = workspace

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)
