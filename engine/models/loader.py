"""Load a Hugging Face model folder into our Llama-family module.

The module is built on the meta device, so constructing it allocates nothing.
Each checkpoint tensor is then converted once to the target dtype and device
and assigned in place of its meta parameter; the fused qkv and gate_up weights
are allocated once and filled slice by slice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.vision.llava import checkpoint_part

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# checkpoint suffix -> (our suffix, shard index within the fused tensor)
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"missing weight shard(s): {', '.join(str(m) for m in missing)}")
    return files


def empty_model(cfg: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> LlamaForCausalLM:
    """The module on the meta device, weights still to be assigned; only the RoPE tables, which are
    derived rather than loaded, are built for real."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, dtype, torch.device("meta"))
    model.rope = type(model.rope)(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)
    return model


def dummy_model(cfg: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """The model with random weights made directly on the device (no checkpoint read)."""
    model = empty_model(cfg, backend, max_positions, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        value = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            value.fill_(1.0)
        else:
            value.normal_(0.0, 0.02, generator=gen)
        _assign(model, name, value)
    return model.eval()


def load_model(folder: Path, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """A full-precision checkpoint; a quantized folder loads through engine.quant.checkpoint.load_quantized."""
    if cfg.quantization:
        raise ModelLoadError(f"{folder} holds quantized weights: load it with engine.quant.checkpoint.load_quantized")
    model = empty_model(cfg, backend, max_positions, dtype, device)
    params = dict(model.named_parameters())
    fused_sizes = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[str] = set()
    for path in safetensors_files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if _IGNORED.search(ckpt_name):
                    continue
                text_name = ckpt_name
                if cfg.vision is not None:  # a LLaVA folder: the vision half loads in engine.vision.llava
                    part, text_name = checkpoint_part(ckpt_name)
                    if part == "vision":
                        continue
                target, shard = _map_name(text_name)
                if target not in params:
                    if target == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store a copy
                    raise ModelLoadError(f"{path.name}: unexpected tensor {ckpt_name!r}")
                tensor = f.get_tensor(ckpt_name)
                if shard is None:
                    _assign(model, target, _convert(tensor, params[target].shape, ckpt_name, dtype, device))
                else:
                    _fill_shard(model, params, target, shard, tensor, fused_sizes, dtype, device, ckpt_name)
                loaded.add(f"{target}#{shard}")

    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"checkpoint in {folder} lacks weights for: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    _check_fused_complete(model, loaded, fused_sizes)
    model.eval()
    return model


def _map_name(name: str) -> tuple[str, int | None]:
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.match(name)
    if not m:
        return name, None
    layer, rest = m.groups()
    if rest in _FUSED:
        ours, shard = _FUSED[rest]
        return f"layers.{layer}.{ours}", shard
    return f"layers.{layer}.{rest}", None


def _convert(tensor: torch.Tensor, shape: torch.Size, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.shape != shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}")
    out = tensor.to(device=device, dtype=dtype).contiguous()
    # safe_open's tensors are views of the file's memory map, which stays mapped, and resident, while any of
    # them lives (the whole file, the shards copied into fused weights included): an own copy lets it go.
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


def _assign(model: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    module_name, _, attr = target.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def _fill_shard(model, params, target, shard, tensor, fused_sizes, dtype, device, ckpt_name) -> None:
    key = next(k for k in fused_sizes if k in target)
    sizes = fused_sizes[key]
    start = sum(sizes[:shard])
    current = model.get_parameter(target)
    if current.is_meta:
        current = torch.nn.Parameter(torch.empty(params[target].shape, dtype=dtype, device=device),
                                     requires_grad=False)
        _assign(model, target, current)
        current = model.get_parameter(target)
    expected = (sizes[shard], *params[target].shape[1:])
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the config implies {expected}")
    with torch.no_grad():
        current[start:start + sizes[shard]].copy_(tensor)


def _check_fused_complete(model, loaded: set[str], fused_sizes) -> None:
    for name, _ in model.named_parameters():
        for key, sizes in fused_sizes.items():
            if key in name:
                absent = [i for i in range(len(sizes)) if f"{name}#{i}" not in loaded]
                if absent:
                    raise ModelLoadError(f"checkpoint lacks part {absent} of fused weight {name!r}")
