"""The one-call decoder: a decode-only step runs every layer, and the final norm, in one C++ call.

`install(model)` puts a FusedDecoder on a LlamaForCausalLM (`model.fused_decoder`) where decode_layers
(engine/models/csrc/decode_layers.cpp) computes exactly what the layers do: fp32 on the CPU, every
projection a plain Linear with a panel-packed copy, no q/k norms, the C++ paged-attention backend over an
fp32 or int8 cache, and one norm epsilon. Elsewhere it installs None and the model runs its layers. The
model's forward hands a step over when `applies` says so; the results are bitwise those of the layers.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.cpu_paged import CpuPagedAttentionBackend
from engine.attention.int8_backend import CpuPagedInt8AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu_build import cpu_kernels
from engine.models import decode_split
from engine.models.linear import PANEL_MAX_ROWS, Linear, invariant_enabled, is_panel_packed
from engine.models.llama import Embedding, LlamaForCausalLM

_EMPTY = torch.empty(0)  # an absent optional tensor argument of the compiled kernels


class FusedDecoder:
    """The model's layers as decode_layers takes them. Holds the model's parts, not the model."""

    def __init__(self, model: LlamaForCausalLM, weights: list[torch.Tensor],
                 split_rows: int = decode_split.MIN_ROWS) -> None:
        self.weights = weights  # every layer's, in decode_layers' order
        # Rows per thread from which decode_layers gives each thread its own group of rows
        # (engine/models/decode_split.py); the engine sets it per machine at start.
        self.split_rows = split_rows
        self.config = model.config
        self.embed_tokens = model.embed_tokens
        self.norm = model.norm
        self.rope = model.rope
        self.first_mlp = model.layers[0].mlp
        self.scale = model.layers[0].self_attn.backend.scale
        self.linears = model.decoder_linears()

    def applies(self, rows: int, meta: AttentionMetadata) -> bool:
        """A decode-only step of at most PANEL_MAX_ROWS rows (and no more than the MLP workspace holds), no
        full-precision KV window, and nothing that needs the layer path (autograd, batch-invariant mode)."""
        workspace = self.first_mlp.workspace
        return (not meta.prefills and meta.kv_window is None and meta.num_decodes == rows
                and 0 < rows <= PANEL_MAX_ROWS and (workspace is None or rows <= workspace.rows)
                and not torch.is_grad_enabled() and not invariant_enabled())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        # The embedding lookup too, where the table is a plain fp32 one.
        table = self._token_table()
        x = input_ids if table is not None else self.embed_tokens(input_ids)
        return self.run_layers(x, positions, kv_caches, meta, table)

    def _token_table(self) -> torch.Tensor | None:
        """The embedding table, where decode_layers can gather the step's rows from it itself: a plain fp32 table
        on the CPU (not quantized, offloaded or freed)."""
        emb = self.embed_tokens
        if type(emb) is not Embedding:
            return None
        w = emb.weight
        if w.is_meta or w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
            return None
        return w.detach()

    def run_layers(self, x, positions, kv_caches, meta: AttentionMetadata,
                   token_table: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        if isinstance(kv_caches[0], torch.Tensor):
            values, scales = kv_caches, []
        else:  # Int8KVCache: int8 values and their fp16 scales
            values, scales = [c.values for c in kv_caches], [c.scales for c in kv_caches]
        return cpu_kernels().decode_layers(
            x.contiguous(), self.weights, values, scales, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, positions, self.rope.cos, self.rope.sin, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, self.norm.eps, self.scale, self.norm.weight.detach(),
            token_table if token_table is not None else _EMPTY,
            # A draft's rows read each other's K/V: one thread takes them all (see multi_row_decodes).
            self.split_rows if not meta.multi_row_decodes else 1 << 30)

    def choose_split(self) -> decode_split.SplitChoice:
        """Measure this machine's GEMM rate and how fast it streams the layers' packed weights, and set
        split_rows from them (decode_split.choose)."""
        linears = self.linears
        choice = decode_split.choose([m.packed for m in linears], sum(m.in_features * m.out_features for m in linears))
        self.split_rows = choice.rows
        return choice


def install(model: LlamaForCausalLM) -> FusedDecoder | None:
    """Put a FusedDecoder on the model where decode_layers computes exactly what its layers do, else None.
    Called again after the weights move (huge pages), it rebuilds the weight list and keeps split_rows."""
    previous = model.fused_decoder
    weights = _decoder_weights(model)
    model.fused_decoder = None if weights is None else FusedDecoder(
        model, weights, previous.split_rows if previous is not None else decode_split.MIN_ROWS)
    return model.fused_decoder


def _decoder_weights(model: LlamaForCausalLM) -> list[torch.Tensor] | None:
    first = model.layers[0]
    if (model.norm.weight.device.type != "cpu" or model.norm.weight.dtype != torch.float32
            or model.rope.cos.dtype != torch.float32 or cpu_kernels() is None
            or type(first.self_attn.backend) not in (CpuPagedAttentionBackend, CpuPagedInt8AttentionBackend)
            or first.self_attn.backend.key_rotation is not None):  # decode_layers does not rotate q and k
        return None
    eps = model.norm.eps
    weights: list[torch.Tensor] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears: tuple[nn.Module, ...] = model.layer_linears(layer)
        if (attn.q_norm is not None or attn.backend is not first.self_attn.backend
                or any(type(m) is not Linear or not is_panel_packed(m.packed) for m in linears)
                or any(m.bias is not None for m in linears[1:])
                or layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps
                or layer.input_layernorm.weight.dtype != torch.float32):
            return None
        bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else torch.empty(0)
        weights += [layer.input_layernorm.weight.detach(), attn.qkv_proj.packed, bias.detach(),
                    attn.o_proj.packed, layer.post_attention_layernorm.weight.detach(),
                    mlp.gate_up_proj.packed, mlp.down_proj.packed]
    return weights
