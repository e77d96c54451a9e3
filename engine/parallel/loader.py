"""Load one rank's shard of a Hugging Face checkpoint: each tensor's slice is read from the file with
safetensors' get_slice, so no rank ever holds the whole model."""

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
    if seed is not None:
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
