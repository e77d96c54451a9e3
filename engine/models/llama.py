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

from engine import hugepages
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.models import decode_split
from engine.models.compact_weights import is_compact
from engine.models.config import ModelConfig
from engine.models.cpu_kernels import cpu_kernels, fused_cpu_ok
from engine.models.linear import (
    PANEL_MAX_ROWS,
    Linear,
    free_plain_weight,
    invariant_enabled,
    is_panel_packed,
    linear,
    packed_bytes,
    prepack,
    prepack_linears,
    return_freed_memory,
)
from engine.models.rope import RotaryEmbedding

_EMPTY = torch.empty(0)  # an absent optional tensor argument of the compiled kernels


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
        if self.fused_rope_kv:  # RoPE in place and K/V into the cache, one launch; the backend skips its write
            from engine.models.fused_ops import rope_write_kv

            rope_write_kv(qkv, positions, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim,
                          kv_cache, meta.slot_mapping)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        del qkv
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if not self.fused_rope_kv:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            rope.apply_(positions, q, k)  # in place: q and k are views of this layer's qkv output
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
        if (not self.triton_fusions and self._fused_decode is not None
                and self._fused_decode_applies(input_ids.shape[0], meta)):
            # The final norm included, and the embedding lookup too where the table is a plain fp32 one.
            table = self._fused_token_table()
            x = input_ids if table is not None else self.embed_tokens(input_ids)
            return self._fused_decode_layers(x, positions, kv_caches, meta, table)
        x = self.embed_tokens(input_ids)
        if self.triton_fusions:
            return self._triton_layers(x, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, kv_cache, meta)
        return self.norm(x)

    # The GPU path (enable_triton_fusions): each residual add is fused into the next RMSNorm.
    triton_fusions: bool = False

    def enable_triton_fusions(self) -> None:
        """Run the decoder with the Triton kernels of engine.models.fused_ops: each layer's MLP output is
        added to the residual stream by the next norm's kernel (the final norm's too), and, where every
        layer's attention allows it, RoPE and the K/V write are one launch. About ten launches per layer
        instead of about thirty; on a GPU their fixed cost is what a small decode step mostly pays.
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

    # The weights of every layer, in decode_layers' order, when the whole decoder can run a
    # decode-only step in one C++ call (engine/models/csrc/decode_layers.cpp); set by prepack_weights.
    _fused_decode: list[torch.Tensor] | None = None
    # Rows per thread from which decode_layers gives each thread its own group of rows (engine/models/
    # decode_split.py); the engine sets it per machine at start.
    decode_split_rows: int = decode_split.MIN_ROWS

    def _fused_decode_applies(self, rows: int, meta: AttentionMetadata) -> bool:
        workspace = self.layers[0].mlp.workspace
        return (not meta.prefills and meta.kv_window is None and meta.num_decodes == rows
                and 0 < rows <= PANEL_MAX_ROWS and (workspace is None or rows <= workspace.rows)
                and not torch.is_grad_enabled() and not invariant_enabled())

    def _fused_token_table(self) -> torch.Tensor | None:
        """The embedding table, where decode_layers can gather the step's rows from it itself: a plain fp32 table
        on the CPU (not quantized, offloaded or freed)."""
        emb = self.embed_tokens
        if type(emb) is not Embedding:
            return None
        w = emb.weight
        if w.is_meta or w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
            return None
        return w.detach()

    def _fused_decode_layers(self, x, positions, kv_caches, meta: AttentionMetadata,
                             token_table: torch.Tensor | None = None) -> torch.Tensor:
        cfg, attn = self.config, self.layers[0].self_attn
        if isinstance(kv_caches[0], torch.Tensor):
            values, scales = kv_caches, []
        else:  # Int8KVCache: int8 values and their fp16 scales
            values, scales = [c.values for c in kv_caches], [c.scales for c in kv_caches]
        return cpu_kernels().decode_layers(
            x.contiguous(), self._fused_decode, values, scales, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, positions, self.rope.cos, self.rope.sin, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, self.norm.eps, attn.backend.scale, self.norm.weight.detach(),
            token_table if token_table is not None else _EMPTY,
            self.decode_split_rows if not meta.multi_row_decodes else 1 << 30)

    @staticmethod
    def layer_linears(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """A decoder layer's projections in the order a step runs them: qkv, o, gate_up, down."""
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def decoder_linears(self) -> list[nn.Module]:
        """Every layer's projections (layer_linears), layer after layer: the 120 products of a step's decoder for
        SmolLM2, the LM head not included."""
        return [m for layer in self.layers for m in self.layer_linears(layer)]

    def choose_decode_split(self) -> decode_split.SplitChoice | None:
        """Measure this machine's GEMM rate and how fast it streams the layers' packed weights, and set
        decode_split_rows from them (decode_split.choose); None where decode_layers does not run."""
        if self._fused_decode is None:
            return None
        linears = self.decoder_linears()
        choice = decode_split.choose([m.packed for m in linears], sum(m.in_features * m.out_features for m in linears))
        self.decode_split_rows = choice.rows
        return choice

    def _enable_fused_decode(self) -> bool:
        """Run decode-only steps through decode_layers where it computes exactly what the layers do:
        fp32 on the CPU, every projection a plain Linear with a panel-packed copy, no q/k norms, the
        C++ paged-attention backend over an fp32 or int8 cache (an int8 cache's full-precision window
        takes the layer path step by step: _fused_decode_applies) and one norm epsilon."""
        from engine.attention.cpu_paged import CpuPagedAttentionBackend
        from engine.attention.int8_backend import CpuPagedInt8AttentionBackend

        self._fused_decode = None
        first = self.layers[0]
        if (self.norm.weight.device.type != "cpu" or self.norm.weight.dtype != torch.float32
                or self.rope.cos.dtype != torch.float32 or cpu_kernels() is None
                or type(first.self_attn.backend) not in (CpuPagedAttentionBackend, CpuPagedInt8AttentionBackend)):
            return False
        eps = self.norm.eps
        weights: list[torch.Tensor] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = self.layer_linears(layer)
            if (attn.q_norm is not None or attn.backend is not first.self_attn.backend
                    or any(type(m) is not Linear or not is_panel_packed(m.packed) for m in linears)
                    or any(m.bias is not None for m in linears[1:])
                    or layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps
                    or layer.input_layernorm.weight.dtype != torch.float32):
                return False
            bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else torch.empty(0)
            weights += [layer.input_layernorm.weight.detach(), attn.qkv_proj.packed, bias.detach(),
                        attn.o_proj.packed, layer.post_attention_layernorm.weight.detach(),
                        mlp.gate_up_proj.packed, mlp.down_proj.packed]
        self._fused_decode = weights
        return True

    def use_workspace(self, workspace: ActivationWorkspace | None) -> None:
        """Share one activation workspace among all layers (None: every MLP runs in one pass)."""
        for layer in self.layers:
            layer.mlp.workspace = workspace

    def prepack_weights(self, compact: bool = True, free_plain: bool = False, only_compact: bool = False) -> int:
        """Packed copies of the fp32 CPU linear weights (linear.prepack), the tied LM head included; bytes added.
        `compact`: exact compact panels where a weight allows them (engine/models/compact_weights.py);
        `only_compact`: no copy for the other weights; `free_plain`: then free the fp32 weights that compact
        panels hold, the tied embedding table included (token lookups rebuild their rows: Embedding.forward)."""
        added = prepack_linears(self, compact, free_plain, only_compact)
        # A tied LM head with plain weights (a quantized table has its own kernels).
        if (self.lm_head is None and type(self.embed_tokens) is Embedding
                and (packed := prepack(self.embed_tokens.weight, compact, only_compact)) is not None):
            self.embed_tokens.packed_head = packed
            added += packed_bytes(packed, self.embed_tokens.weight)
            if free_plain and free_plain_weight(self.embed_tokens, packed):
                return_freed_memory()
        self._enable_fused_decode()
        return added

    def move_decode_weights_to_huge_pages(self, fault_budget_s: float | None = None) -> tuple[int, int]:
        """Move the weights a CPU decode step streams into one region of transparent huge pages
        (engine/hugepages.py): each linear's panel-packed copy, else its fp32 weight, and the tied LM head's
        (its packed copy, else the table). One tensor at a time, each original freed as its copy lands, so
        the peak is the region plus one tensor. `fault_budget_s`: past it, the rest of the region takes 4 KiB
        pages (HugePageArena). Returns the bytes moved and how many of the region's bytes had huge pages
        asked for as they were faulted in ((0, 0) where huge pages are unavailable)."""
        slots: list[tuple[nn.Module, str]] = []
        for m in self.modules():
            if type(m) is Linear:
                if is_panel_packed(m.packed):
                    slots.append((m, "packed"))
                elif m.packed is None and m.weight.device.type == "cpu" and not m.weight.is_meta:
                    slots.append((m, "weight"))
        emb = self.embed_tokens
        if self.lm_head is None and type(emb) is Embedding:
            if is_panel_packed(emb.packed_head):
                slots.append((emb, "packed_head"))
            elif emb.packed_head is None and emb.weight.device.type == "cpu" and not emb.weight.is_meta:
                slots.append((emb, "weight"))
        arena = hugepages.arena_for([(getattr(m, a).shape, getattr(m, a).dtype) for m, a in slots], fault_budget_s)
        if arena is None:
            return 0, 0
        moved = 0
        for m, attr in slots:
            old = getattr(m, attr)
            new = arena.take(old.shape, old.dtype).copy_(old)
            setattr(m, attr, nn.Parameter(new, requires_grad=False) if attr == "weight" else new)
            moved += new.numel() * new.element_size()
            del old
        if self._fused_decode is not None:
            self._enable_fused_decode()  # its weight list held the old copies
        return_freed_memory()
        return moved, min(arena.huge_bytes, moved)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)
