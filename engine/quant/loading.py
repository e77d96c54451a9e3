"""Which weights an engine runs: a quantized checkpoint as saved, a full-precision checkpoint as is,
or one quantized while loading (weight_bits 8 or 4), calibrated on `calibration_file`."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.quant.calibration import (
    CALIBRATION_SEQ_LEN,
    CALIBRATION_TOKENS,
    DEFAULT_CALIBRATION_FILE,
    Progress,
    calibration_sequences,
    collect_statistics,
)
from engine.quant.checkpoint import build_quantized_model, load_quantized
from engine.quant.convert import QuantSpec, create_quantized_state_dict

log = logging.getLogger(__name__)


def quantize_pretrained(folder: Path, mc: ModelConfig, spec: QuantSpec, tokenizer, calibration_file=None,
                        device: torch.device | None = None, seq_len: int = CALIBRATION_SEQ_LEN,
                        max_tokens: int | None = None,
                        progress: Progress | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a full-precision checkpoint in fp32, calibrate it and return the quantized state dict
    and quant config (what `infinilm quantize` saves)."""
    if mc.quantization:
        raise ModelLoadError(f"{folder} is already quantized")
    device = device or torch.device("cpu")
    backend = TorchAttentionBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim)
    model = load_model(folder, mc, backend, min(seq_len, mc.max_position_embeddings), torch.float32, device)
    stats, record = None, None
    if spec.calibrated:
        if tokenizer is None:
            raise ModelLoadError("calibration reads text, so the model folder needs a tokenizer")
        path = Path(calibration_file) if calibration_file else DEFAULT_CALIBRATION_FILE
        sequences = calibration_sequences(tokenizer, path, seq_len, max_tokens or CALIBRATION_TOKENS[spec.bits])
        if not sequences:
            raise ModelLoadError(f"calibration file {path} gave no tokens")
        stats = collect_statistics(model, sequences, progress=progress)
        record = {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                  "sequences": len(sequences), "tokens": sum(map(len, sequences))}
    state, qconfig = create_quantized_state_dict(model, spec, stats, progress)
    qconfig["calibration"] = record
    return state, qconfig


def load_engine_model(config: EngineConfig, folder: Path, mc: ModelConfig, backend: AttentionBackend,
                      max_positions: int, dtype: torch.dtype, device: torch.device, tokenizer) -> LlamaForCausalLM:
    saved = mc.quantization
    if saved:
        if config.weight_bits not in (16, saved["bits"]):
            raise ModelLoadError(f"{folder} holds {saved['bits']}-bit weights but weight_bits is {config.weight_bits}")
        return load_quantized(folder, mc, backend, max_positions, dtype, device)
    if config.weight_bits == 16:
        return load_model(folder, mc, backend, max_positions, dtype, device)
    spec = QuantSpec(config.weight_bits, config.weight_group_size)
    log.info("quantizing %s to %d bits at load time (calibration: %s)", folder, spec.bits,
             config.calibration_file or DEFAULT_CALIBRATION_FILE)
    state, qconfig = quantize_pretrained(folder, mc, spec, tokenizer, config.calibration_file, device)
    return build_quantized_model(state, qconfig, dataclasses.replace(mc, quantization=qconfig), backend,
                                 max_positions, dtype, device)
