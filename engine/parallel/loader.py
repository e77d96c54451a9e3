"""Load one rank's shard of a checkpoint: each tensor's slice is read from the file with safetensors'
get_slice, so no rank ever holds the whole model. Two layouts: a Hugging Face folder (separate q, k, v,
gate and up tensors) and a quantized folder written by `infinilm quantize` (our fused names, int8 or int4
codes with their scales: engine/quant/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.loader import _IGNORED, _assign, _map_name, safetensors_files
from engine.parallel.layers import TensorParallelLlama
from engine.parallel.sharding import ShardPlan
from engine.quant.convert import convert_for_runtime, quantized_buffer_names

# our suffix -> how the checkpoint tensor is split: "rows" (column-parallel outputs), "cols" (row-parallel
# inputs), "vocab" (embedding and LM head rows); anything else (norms) is replicated.
_SPLITS = {
    "self_attn.o_proj.weight": "cols",
    "mlp.down_proj.weight": "cols",
    "embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
}


def empty_shard(cfg: ModelConfig, plan: ShardPlan, backend: AttentionBackend, max_positions: int,
                dtype: torch.dtype, device: torch.device) -> TensorParallelLlama:
    """The rank's module on the meta device, at the rank's shape; RoPE tables built for real."""
    local = plan.local_config(cfg)
    with torch.device("meta"):
        model = TensorParallelLlama(local, backend, max_positions, dtype, torch.device("meta"))
    model.rope = type(model.rope)(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    return model


def load_shard(folder: Path | None, cfg: ModelConfig, plan: ShardPlan, backend: AttentionBackend,
               max_positions: int, dtype: torch.dtype, device: torch.device,
               seed: int | None = None) -> TensorParallelLlama:
    """The rank's shard from `folder`; with `seed` instead, random weights (load_format dummy)."""
    model = empty_shard(cfg, plan, backend, max_positions, dtype, device)
    if cfg.quantization:
        _read_quantized(Path(folder), model, cfg, plan, dtype, device)
    elif seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + plan.rank)
        for name, param in list(model.named_parameters()):
            value = torch.empty(param.shape, dtype=dtype, device=device)
            value.fill_(1.0) if name.endswith("norm.weight") else value.normal_(0.0, 0.02, generator=gen)
            _assign(model, name, value)
    else:
        _read_slices(Path(folder), model, plan, dtype, device)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint in {folder} lacks weights for: {', '.join(missing[:8])}")
    model.finish_sharding(plan)
    return model.eval()


def _read_slices(folder: Path, model: TensorParallelLlama, plan: ShardPlan, dtype: torch.dtype,
                 device: torch.device) -> None:
    params = dict(model.named_parameters())
    q, kv, inter = plan.q_rows, plan.kv_rows, plan.intermediate
    # fused target suffix -> each part's (checkpoint rows, offset in our fused tensor)
    fused_parts = {
        "self_attn.qkv_proj": [(q, 0), (kv, q[1] - q[0]), (kv, q[1] - q[0] + kv[1] - kv[0])],
        "mlp.gate_up_proj": [(inter, 0), (inter, inter[1] - inter[0])],
    }
    filled: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if _IGNORED.search(ckpt_name):
                    continue
                target, part = _map_name(ckpt_name)
                if target not in params:
                    if target == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue
                    raise ModelLoadError(f"{path.name}: unexpected tensor {ckpt_name!r}")
                shape = params[target].shape
                piece = f.get_slice(ckpt_name)
                if part is not None:
                    key = next(k for k in fused_parts if k in target)
                    (start, end), offset = fused_parts[key][part]
                    value = _fused_buffer(model, target, shape, dtype, device)
                    with torch.no_grad():
                        value[offset:offset + end - start].copy_(piece[start:end])
                    filled.add(f"{target}#{part}")
                    continue
                split = next((how for suffix, how in _SPLITS.items() if target.endswith(suffix)), None)
                if split == "cols":
                    start, end = (q if "o_proj" in target else inter)
                    tensor = piece[:, start:end]
                elif split == "vocab":
                    tensor = _vocab_rows(piece, plan, shape)
                else:
                    tensor = piece[:]
                if tuple(tensor.shape) != tuple(shape):
                    raise ModelLoadError(f"tensor {ckpt_name!r}: rank {plan.rank}'s slice has shape "
                                         f"{tuple(tensor.shape)}, the config implies {tuple(shape)}")
                _assign(model, target, tensor.to(device=device, dtype=dtype).contiguous())
    for name in params:
        key = next((k for k in fused_parts if k in name), None)
        if key is not None and not name.endswith("bias"):
            absent = [i for i in range(len(fused_parts[key])) if f"{name}#{i}" not in filled]
            if absent:
                raise ModelLoadError(f"checkpoint lacks part {absent} of fused weight {name!r}")


def _fused_buffer(model, target: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    current = model.get_parameter(target)
    if current.is_meta:
        _assign(model, target, torch.empty(shape, dtype=dtype, device=device))
        current = model.get_parameter(target)
    return current


def _vocab_rows(piece, plan: ShardPlan, shape) -> torch.Tensor:
    """The rank's rows of the padded vocabulary; the padding past vocab_size is zeros."""
    start, end = plan.vocab
    rows = piece[start:min(end, plan.vocab_size)]
    if rows.shape[0] == shape[0]:
        return rows
    padded = torch.zeros(shape, dtype=rows.dtype)
    padded[:rows.shape[0]] = rows
    return padded


def _read_quantized(folder: Path, model: TensorParallelLlama, cfg: ModelConfig, plan: ShardPlan,
                    dtype: torch.dtype, device: torch.device) -> None:
    """A quantized folder's tensors, each cut to the rank's rows (qkv, gate_up, vocabulary) or inputs
    (o, down: int8 codes by column, int4 codes two columns a byte and their group scales by group)."""
    qconfig = cfg.quantization
    with torch.device("meta"):
        convert_for_runtime(model, qconfig, dtype)
    model.requires_grad_(False)
    keep = quantized_buffer_names(qconfig)
    h, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    (q0, q1), (k0, k1), (i0, i1) = plan.q_rows, plan.kv_rows, plan.intermediate
    rows = {  # module suffix -> its rows of the full fused tensor
        "self_attn.qkv_proj": [(q0, q1), (h + k0, h + k1), (h + d + k0, h + d + k1)],
        "mlp.gate_up_proj": [(i0, i1), (cfg.intermediate_size + i0, cfg.intermediate_size + i1)],
    }
    inputs = {"self_attn.o_proj": (q0, q1), "mlp.down_proj": (i0, i1)}
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                module, _, kind = name.rpartition(".")
                piece = f.get_slice(name)
                if (key := next((k for k in rows if module.endswith(k)), None)) is not None:
                    tensor = torch.cat([piece[a:b] for a, b in rows[key]])
                elif (key := next((k for k in inputs if module.endswith(k)), None)) is not None:
                    tensor = _input_slice(piece, kind, inputs[key], qconfig["modules"].get(module))
                elif module in ("embed_tokens", "embed_tokens.table", "lm_head"):
                    tensor = _vocab_rows(piece, plan, (plan.local_vocab, *piece.get_shape()[1:]))
                else:
                    tensor = piece[:]
                state[name] = (tensor if name in keep else tensor.to(dtype)).to(device)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"rank {plan.rank}'s shard of the quantized checkpoint does not fit: {exc}") from None


def _input_slice(piece, kind: str, span: tuple[int, int], record: dict | None) -> torch.Tensor:
    """A row-parallel module's share of its inputs; an int8 per-row scale is the same on every rank."""
    start, end = span
    if kind == "weight":
        return piece[:, start:end]
    if record is None or kind == "bias":
        return piece[:]
    if record["bits"] == 8:
        return piece[:, start:end] if kind == "qweight" else piece[:]
    if kind == "qweight":  # int4: two codes a byte, along the inputs
        return piece[:, start // 2:end // 2]
    group = record["group_size"]
    return piece[:, start // group:end // group]  # scales and offsets, one per group of inputs
