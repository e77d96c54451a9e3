"""GGUF tensors to model.safetensors: names mapped to HF's, dequantized, q/k rows unpermuted for `llama`.

NOTE: llama.cpp stores the attention q/k rows of the `llama` architecture interleaved for its RoPE
layout; we undo that here, so the folder matches what HF transformers would have written. The qwen
architectures use neox RoPE in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from engine.gguf_import.metadata import ROPE_FREQS, GGUFImportError

ProgressCallback = Callable[[int, int, str], None]
"""Called after each tensor as `progress(done, total, hf_tensor_name)`."""

_TYPE_NAMES = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K"
SUPPORTED_TENSOR_TYPES = frozenset(QType[name] for name in _TYPE_NAMES.split())
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class _TensorPlan:
    hf_name: str
    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]
    unpermute_heads: int | None  # head count to undo llama.cpp's RoPE row order with



def plan_tensors(arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> list[_TensorPlan]:
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    plan = []
    for name, tensor in tensors.items():
        if name == ROPE_FREQS:
            continue
        hf_name = _hf_tensor_name(name)
        if QType(tensor.tensor_type) not in SUPPORTED_TENSOR_TYPES:
            raise GGUFImportError(
                f"tensor {name} has unsupported type {QType(tensor.tensor_type).name}; "
                f"supported: {sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )
        heads = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = n_head if ".attn_q." in name else n_kv
        plan.append(_TensorPlan(hf_name, tensor, tuple(int(d) for d in reversed(tensor.shape)), heads))
    return plan


def _hf_tensor_name(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFImportError(f"GGUF tensor {name!r} has no Hugging Face equivalent known to this importer")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (pass the kv head count for k)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(f"cannot unpermute {rows} rows across {n_heads} heads")
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize(item: _TensorPlan) -> np.ndarray:
    t = item.tensor
    array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(item.shape)
    if item.unpermute_heads is not None:
        array = unpermute_rope_rows(array, item.unpermute_heads)
    return array


def write_safetensors(
    path: Path, plan: list[_TensorPlan], dtype: torch.dtype, progress: ProgressCallback | None
) -> None:
    # Written by hand rather than with safetensors.save_file: every shape is known from the GGUF
    # header, so the file header goes first and tensors stream after it one at a time. Memory stays
    # at one dequantized tensor instead of the whole float model.
    itemsize = torch.tensor([], dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        nbytes = math.prod(item.shape) * itemsize
        header[item.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keeps tensor data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for done, item in enumerate(plan, 1):
            array = _dequantize(item)
            if dtype != torch.float32:
                array = torch.from_numpy(np.array(array)).to(dtype).view(torch.uint8).numpy()
            f.write(np.ascontiguousarray(array).tobytes())
            if progress is not None:
                progress(done, len(plan), item.hf_name)
        f.flush()
        os.fsync(f.fileno())

