"""fp8 checkpoints in the layouts other tools publish: loaded as they are, and written by
`infinilm quantize --format fp8`.

- compressed-tensors (llm-compressor; `quant_method` "compressed-tensors", format "float-quantized"):
  each quantized linear's `weight` is E4M3 and its fp32 `weight_scale` has one value per output
  channel ([N, 1]), one for the tensor ([1]), or one per block (strategy "block").
- block-wise fp8 (`quant_method` "fp8", `weight_block_size` [128, 128]; Qwen3-FP8, DeepSeek-V3):
  E4M3 `weight` with fp32 `weight_scale_inv` per block of 128 x 128 (a multiplier, despite the name).

The engine's Fp8Linear holds one scale per output channel. Channel and tensor scales map onto that
exactly. NOTE: block scales do not, so a block-wise weight is dequantized at load and quantized
again per output channel (one more E4M3 rounding: half a step, at most 1/16 of a weight): the
row-wise scaled_mm kernel then serves every layout.
Static activation scales (`input_scale`) are not read: activations are scaled per token at run time,
which is at least as accurate. A layer whose compressed-tensors group has `input_activations: null`
is weight-only (Fp8Linear.act_fp8 False), and is written so: such groups list their layers by name,
which takes precedence over a class target ("Linear") in compressed-tensors' matching. The fused qkv and gate_up weights are assembled from the checkpoint's
separate q/k/v and gate/up tensors, with their scales, so the load ends in the same
`build_quantized_model` as our own checkpoints.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import _FUSED, _IGNORED, _map_name, safetensors_files
from engine.quant.checkpoint import build_quantized_model
from engine.quant.convert import FORMAT_VERSION
from engine.quant.quantizers import FP8_DTYPE, fp8_scales, quantize_fp8

# Checkpoint tensors with no counterpart here: static activation scales, and KV-cache scales.
_UNREAD = ("input_scale", "k_scale", "v_scale", "output_scale")
_SCALES = ("weight_scale", "weight_scale_inv")
# How many shards each fused weight of ours is assembled from.
_SHARDS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}


def is_external_fp8(qconfig: dict | None) -> bool:
    return bool(qconfig) and qconfig.get("quant_method") in ("compressed-tensors", "fp8")


def block_size(qconfig: dict) -> tuple[int, int]:
    """The scale blocks of a block-wise checkpoint (what its config declares, else 128 x 128); ModelLoadError
    for what this loader does not read: weights that are not 8-bit floats, and non-E4M3 formats."""
    method = qconfig.get("quant_method")
    if method == "fp8":
        if qconfig.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"fp8 checkpoint format {qconfig.get('fmt')!r} is not supported; only e4m3")
        block = qconfig.get("weight_block_size") or (128, 128)
        return int(block[0]), int(block[1])
    if qconfig.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {qconfig.get('format')!r} is not supported; "
                             "only fp8 weights (float-quantized) load")
    block = (128, 128)
    for name, group in (qconfig.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise ModelLoadError(f"compressed-tensors group {name!r} holds {weights.get('num_bits')}-bit "
                                 f"{weights.get('type')} weights; only 8-bit float (fp8) weights load")
        if weights.get("strategy") not in ("channel", "tensor", "block"):
            raise ModelLoadError(f"compressed-tensors group {name!r}: weight strategy {weights.get('strategy')!r} "
                                 "is not supported (channel, tensor or block)")
        if weights.get("block_structure"):
            block = tuple(int(b) for b in weights["block_structure"])
    return block


def channel_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes [N, K], fp32 scales [N]) of a checkpoint weight and its scale, one scale per output channel."""
    n, k = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        return weight, scale.reshape(1).expand(n).contiguous()
    if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
        return weight, scale.reshape(n).contiguous()
    bn, bk = block
    if scale.shape != (-(-n // bn), -(-k // bk)):
        raise ModelLoadError(f"an fp8 weight of shape {(n, k)} has scales of shape {tuple(scale.shape)}: "
                             f"neither per channel, per tensor nor per {bn}x{bk} block")
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w = weight.float() * full
    scales = fp8_scales(w)
    return quantize_fp8(w, scales), scales


def load_external_fp8(folder: Path, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                      dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An fp8 checkpoint in either layout, as Fp8Linear layers; what it left in full precision stays so."""
    if cfg.vision is not None:
        raise ModelLoadError(f"{folder}: fp8 vision-language checkpoints are not supported")
    block = block_size(cfg.quantization)
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if not _IGNORED.search(name) and name.rpartition(".")[2] not in _UNREAD:
                    tensors[name] = f.get_tensor(name)
    parts: dict[str, dict[int | None, torch.Tensor]] = {}
    modules: dict[str, dict] = {}

    def put(target: str, shard: int | None, value: torch.Tensor) -> None:
        if shard in parts.setdefault(target, {}):
            raise ModelLoadError(f"{folder}: two tensors map to part {shard} of {target!r}")
        parts[target][shard] = value

    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in _SCALES:
            if f"{prefix}.weight" not in tensors:
                raise ModelLoadError(f"{folder}: scale {name!r} has no weight")
            continue
        target, shard = _map_name(name)
        if target == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy
        scale = next((tensors[f"{prefix}.{s}"] for s in _SCALES if f"{prefix}.{s}" in tensors), None)
        if leaf == "weight" and (scale is not None or tensor.dtype == FP8_DTYPE):
            if scale is None or tensor.dtype != FP8_DTYPE:
                raise ModelLoadError(f"{folder}: {name!r} is {tensor.dtype} with "
                                     f"{'a' if scale is not None else 'no'} scale; fp8 weights come with scales")
            codes, scales = channel_fp8(tensor, scale, block)
            module = target.rpartition(".")[0]
            put(f"{module}.qweight", shard, codes)
            put(f"{module}.scales", shard, scales)
            record = {"bits": 8, "group_size": None, "format": "fp8",
                      "act_fp8": activations_quantized(cfg.quantization, prefix)}
            if modules.setdefault(module, record) != record:
                raise ModelLoadError(f"{folder}: the parts of {module!r} differ in whether their inputs are quantized")
        else:
            put(target, shard, tensor)
    state = {}
    for target, pieces in parts.items():
        if None in pieces:
            state[target] = pieces[None]
            continue
        want = next(n for key, n in _SHARDS.items() if key in target)
        if sorted(pieces) != list(range(want)):
            raise ModelLoadError(f"{folder}: {target!r} has parts {sorted(pieces)} of {want}; a fused layer's parts "
                                 "must all be fp8 or all full precision")
        state[target] = torch.cat([pieces[i] for i in range(want)])
    qconfig = {"quant_method": "infinilm", "format_version": FORMAT_VERSION, "bits": 8, "format": "fp8",
               "group_size": None, "calibrated": None, "source": cfg.quantization.get("quant_method"),
               "modules": modules}
    return build_quantized_model(state, qconfig, dataclasses.replace(cfg, quantization=qconfig), backend,
                                 max_positions, dtype, device)


def activations_quantized(qconfig: dict, name: str) -> bool:
    """Whether the checkpoint quantizes the inputs of linear `name` (its Hugging Face name): those of the
    compressed-tensors group whose targets match it first by exact name, then by `re:` pattern, then by
    class (any class target names a linear here); True for the block-wise `fp8` layout."""
    groups = list((qconfig.get("config_groups") or {}).values())
    if qconfig.get("quant_method") != "compressed-tensors" or not groups:
        return True
    targets = [(t, g) for g in groups for t in g.get("targets") or ()]
    match = (next((g for t, g in targets if t == name), None)
             or next((g for t, g in targets if t.startswith("re:") and re.fullmatch(t[3:], name)), None)
             or next((g for t, g in targets if "." not in t and not t.startswith("re:")), None))
    return match is None or match.get("input_activations") is not None


# ---- writing: our fp8 state dict as compressed-tensors ----------------------------------------
def checkpoint_dtype(folder: Path) -> torch.dtype:
    """The dtype a model folder's config declares (bf16 or fp16 stay so; anything else: fp32)."""
    import json

    raw = json.loads((Path(folder) / "config.json").read_text())
    name = raw.get("torch_dtype") or raw.get("dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def compressed_tensors_config(ignore: list[str], w8a8: list[str] | None = None,
                              weight_only: list[str] | None = None) -> dict:
    """The `quantization_config` of per-channel fp8 weights with dynamic per-token activations, except
    for the linears named in `weight_only`. With some weight-only, both groups list their linears by
    name (`w8a8` the others), since engines that fuse q/k/v match a fused layer's class before its
    shards' names."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    acts = {**weights, "strategy": "token", "dynamic": True, "observer": None}
    if not weight_only:
        groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}
    elif not w8a8:
        groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}
    else:
        groups = {"group_0": {"targets": sorted(w8a8), "weights": weights, "input_activations": acts},
                  "group_1": {"targets": sorted(weight_only), "weights": weights, "input_activations": None}}
    for group in groups.values():
        group["output_activations"] = None
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {},
            "global_compression_ratio": None}


def to_compressed_tensors(state: dict[str, torch.Tensor], qconfig: dict, cfg: ModelConfig,
                          dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """Our fp8 state dict (fused qkv and gate_up) in Hugging Face names, split, with `weight_scale`s
    [N, 1]; what stays full precision in `dtype`. Returns the tensors and the `quantization_config`."""
    sizes = {"self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
             "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
    parts: dict[str, dict[int, str]] = {}  # our fused module -> shard -> their module
    for theirs, (ours, shard) in _FUSED.items():
        parts.setdefault(ours.rpartition(".")[0], {})[shard] = theirs.rpartition(".")[0]
    out: dict[str, torch.Tensor] = {}
    acts: dict[bool, list[str]] = {True: [], False: []}  # W8A8 or not -> their Hugging Face names
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if module in qconfig["modules"] and leaf == "scales":
            leaf, value = "weight_scale", value.float().reshape(-1, 1)
        elif module in qconfig["modules"] and leaf == "qweight":
            leaf = "weight"
        elif value.is_floating_point():
            value = value.to(dtype)
        fused = next((key for key in sizes if module.endswith(f".{key}")), None)
        if fused is None:
            theirs = ["lm_head" if module == "lm_head" else f"model.{module}"]
            out[f"{theirs[0]}.{leaf}"] = value.contiguous()
        else:
            base, start = module[:-len(fused)], 0
            theirs = [f"model.{base}{parts[fused][shard]}" for shard in range(len(sizes[fused]))]
            for shard, size in enumerate(sizes[fused]):
                out[f"{theirs[shard]}.{leaf}"] = value[start:start + size].contiguous()
                start += size
        if module in qconfig["modules"] and leaf == "weight":
            acts[qconfig["modules"][module].get("act_fp8", True)].extend(theirs)
    return out, compressed_tensors_config(["lm_head"], acts[True], acts[False])
