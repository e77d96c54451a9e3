"""Which weights an engine runs: a quantized checkpoint as saved, a full-precision checkpoint as is,
or one quantized while loading (weight_bits 8 or 4), calibrated on `calibration_file`.

weight_bits 8 is fp8 or int8 by `weight_format` and the device (engine.quant.fp8.resolve_weight_format);
an fp8 checkpoint on a device that runs int8 instead is requantized to int8 per channel at load."""

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
    linear_modules,
    lm_head_name,
)
from engine.quant.checkpoint import build_quantized_model, load_quantized
from engine.quant.convert import QuantSpec, create_quantized_state_dict, group_for, weight_format
from engine.quant.fp8 import Fp8Linear, fp8_as_int8, resolve_weight_format
from engine.quant.fp8_activations import set_activations, weight_only_modules
from engine.quant.hf_fp8 import is_external_fp8, load_external_fp8
from engine.quant.modules import make_quantized_linear
from engine.quant.search import quantize_weight

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
    stats, record, sequences = None, None, None
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
    weight_only, choice = frozenset(), None
    if spec.fp8:
        weight_only, choice = weight_only_modules(model, spec.fp8_activations, sequences)
    state, qconfig = create_quantized_state_dict(model, spec, stats, progress, weight_only)
    qconfig["calibration"] = record
    if choice is not None:
        qconfig["fp8_activations"] = choice
    return state, qconfig


def load_engine_model(config: EngineConfig, folder: Path, mc: ModelConfig, backend: AttentionBackend,
                      max_positions: int, dtype: torch.dtype, device: torch.device, tokenizer) -> LlamaForCausalLM:
    saved = mc.quantization
    if saved:
        bits = 8 if is_external_fp8(saved) else saved["bits"]
        if config.weight_bits not in (16, bits):
            raise ModelLoadError(f"{folder} holds {bits}-bit weights but weight_bits is {config.weight_bits}")
        fp8 = is_external_fp8(saved) or saved.get("format") == "fp8"
        if config.weight_format == "fp8" and not fp8:
            raise ModelLoadError(f"{folder} holds int{bits} weights; weight_format fp8 needs an fp8 or a "
                                 "full-precision checkpoint")
        loader = load_external_fp8 if is_external_fp8(saved) else load_quantized
        model = loader(folder, mc, backend, max_positions, dtype, device)
        if fp8 and resolve_weight_format(config.weight_format, device) == "int8":
            log.info("%s: %d fp8 linears requantized to int8 per channel for %s", folder, fp8_as_int8(model), device)
        elif fp8:
            set_activations(model, config.fp8_activations)  # auto: as the checkpoint chose
        return model
    if config.weight_bits == 16:
        return load_model(folder, mc, backend, max_positions, dtype, device)
    spec = weight_spec(config, device)
    log.info("quantizing %s to %s at load time (calibration: %s)", folder, weight_format(spec),
             config.calibration_file or DEFAULT_CALIBRATION_FILE)
    state, qconfig = quantize_pretrained(folder, mc, spec, tokenizer, config.calibration_file, device)
    return build_quantized_model(state, qconfig, dataclasses.replace(mc, quantization=qconfig), backend,
                                 max_positions, dtype, device)


def weight_spec(config: EngineConfig, device: torch.device) -> QuantSpec:
    """What load-time quantization makes of weight_bits and weight_format on `device`."""
    fp8 = config.weight_bits == 8 and resolve_weight_format(config.weight_format, device) == "fp8"
    return QuantSpec(config.weight_bits, config.weight_group_size, fp8=fp8, fp8_activations=config.fp8_activations)


@torch.no_grad()
def quantize_dummy_model(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> LlamaForCausalLM:
    """Random weights (load_format dummy) quantized in place, a layer at a time, by round-to-nearest:
    benchmarks of shapes we have no checkpoint for. The linears, and for int the LM head too, as
    load-time quantization does; the embedding table stays as it is. fp8_activations auto has no
    calibration data here, so it is all."""
    spec = weight_spec(config, device)
    head = lm_head_name(model)
    for name, module in linear_modules(model).items():
        if spec.fp8 and name == head:
            continue
        q = quantize_weight(module.weight, spec.bits, group_for(spec, module.in_features), fp8=spec.fp8)
        has_bias = module.bias is not None
        with torch.device("meta"):  # every tensor is assigned below
            new = (Fp8Linear(module.in_features, module.out_features, has_bias, spec.fp8_activations != "none")
                   if spec.fp8 else
                   make_quantized_linear(module.in_features, module.out_features, has_bias, spec.bits, q.group_size))
        new.qweight, new.scales = q.qweight, q.scales
        if q.offsets is not None:
            new.offsets = q.offsets
        if has_bias:
            new.bias = module.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model
