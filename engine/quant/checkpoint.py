"""Quantized checkpoints on disk: a model folder like any other (config.json, tokenizer files,
model.safetensors), whose config.json carries the quant config under `quantization_config`, as
Hugging Face folders of quantized models do. The tensors use the engine's own module names (fused
qkv and gate_up), so loading is a plain `load_state_dict(assign=True)` after
`convert_for_runtime`; transformers refuses the folder because it does not know the method.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.attention.backend import AttentionBackend
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import empty_model, safetensors_files
from engine.quant.convert import FORMAT_VERSION, convert_for_runtime, quantized_buffer_names

# Files of the source folder that the quantized folder keeps as they are.
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "chat_template.jinja", "gguf_import.json")
RECORD_FILE = "infinilm_quantization.json"


def save_quantized(source: Path, out_dir: Path, state_dict: dict[str, torch.Tensor], qconfig: dict,
                   overwrite: bool = False, record: dict | None = None) -> Path:
    """Write the quantized model folder (atomically: a temporary folder moved into place). `record`,
    when given, goes to RECORD_FILE: how a checkpoint in another tool's layout was made (calibration)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite (--force) to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        config = json.loads((Path(source) / "config.json").read_text())
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if record is not None:
            (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        for name in _COPIED:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, tmp / name)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "quant_method": qconfig["quant_method"]})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_quantized(folder: Path, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                   dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model on the meta device, swap in the quantized modules, assign the tensors. (fp8
    checkpoints of other tools: engine/quant/hf_fp8.py, into the same modules.)"""
    qconfig = cfg.quantization
    if not qconfig or qconfig.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{folder}: unsupported quantized checkpoint format "
                             f"{qconfig and qconfig.get('format_version')!r}; expected {FORMAT_VERSION}")
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                state[name] = f.get_tensor(name)
    return build_quantized_model(state, qconfig, cfg, backend, max_positions, dtype, device)


def build_quantized_model(state: dict[str, torch.Tensor], qconfig: dict, cfg: ModelConfig,
                          backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                          device: torch.device) -> LlamaForCausalLM:
    model = empty_model(cfg, backend, max_positions, dtype, device)
    with torch.device("meta"):
        convert_for_runtime(model, qconfig, dtype)
    model.requires_grad_(False)  # assign=True keeps each parameter's flag
    keep = quantized_buffer_names(qconfig)
    converted = {k: (v if k in keep else v.to(dtype)).to(device) for k, v in state.items()}
    try:
        model.load_state_dict(converted, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"the quantized checkpoint does not fit the model: {exc}") from None
    return model.eval()
