"""Two phases, gpt-fast style: `create_quantized_state_dict` turns a full-precision model (plus
calibration statistics) into the state dict of the quantized model and a quant config;
`convert_for_runtime` swaps the model's linears and embedding for the quantized modules that state
dict fits. The quant config lists every module it quantized with its bits and group size, so a
loader never guesses from names or shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.llama import LlamaForCausalLM
from engine.quant.calibration import LayerStats, lm_head_name
from engine.quant.fp8 import Fp8Linear
from engine.quant.modules import QuantizedEmbedding, make_quantized_linear
from engine.quant.quantizers import int4_group_size
from engine.quant.search import (
    ErrorMetric,
    gptq_int4,
    quantize_weight,
    scale_hessian,
    search_clip,
    search_input_scale,
)

QUANT_METHOD = "infinilm"
FORMAT_VERSION = 1
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 8 or 4
    group_size: int = 128  # int4: inputs per group (a layer whose width it does not divide uses less)
    calibrated: bool = True  # False: plain round-to-nearest, the uncalibrated baseline
    # int4: GPTQ's error-feedback rounding instead of the per-group clip search. A Python loop per
    # input column: minutes for SmolLM2 on two CPU cores (docs/BENCHMARKS.md, "Quantization").
    error_feedback: bool = False
    # 8 bits as fp8 (E4M3) codes instead of int8; the LM head and embedding table stay full precision.
    fp8: bool = False
    # fp8: which linears round their activations to E4M3 (engine/quant/fp8_activations.py): auto, all, none.
    fp8_activations: str = "auto"

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"quantization takes 8 or 4 bits, got {self.bits}")
        if self.fp8 and self.bits != 8:
            raise ValueError(f"fp8 weights take 8 bits, got {self.bits}")
        if self.fp8_activations not in ("auto", "all", "none"):
            raise ValueError(f"fp8_activations must be auto, all or none, got {self.fp8_activations!r}")


def weight_format(spec: QuantSpec) -> str:
    return "fp8" if spec.fp8 else f"int{spec.bits}"


def group_for(spec: QuantSpec, in_features: int) -> int | None:
    return int4_group_size(in_features, spec.group_size) if spec.bits == 4 else None


@torch.no_grad()
def create_quantized_state_dict(model: LlamaForCausalLM, spec: QuantSpec, stats: dict[str, LayerStats] | None = None,
                                progress: Progress | None = None,
                                weight_only: frozenset[str] = frozenset()) -> tuple[dict[str, torch.Tensor], dict]:
    """The quantized model's state dict (fp32 for what stays full precision) and its quant config.
    fp8 linears named in `weight_only` keep their activations at full precision (`act_fp8` False).

    With `stats` and `spec.calibrated`: int8 layers get the per-channel clipping of least output
    error on the calibration activations; int4 layers first get activation-aware input scaling
    where it can be folded into the op before it (qkv and gate_up into their RMSNorm, down into the
    up rows of gate_up), then the per-group clipping of least output error (or, with
    `spec.error_feedback`, GPTQ's error-feedback rounding).
    """
    calibrated = spec.calibrated and stats is not None
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    cfg = model.config
    modules: dict[str, dict] = {}
    scaled: dict[str, torch.Tensor] = {}  # module -> input scales folded into the op before it
    metrics: dict[str, ErrorMetric] = {}

    def hessian(name: str) -> torch.Tensor:
        h = stats[name].hessian
        return scale_hessian(h, scaled[name]) if name in scaled else h

    def metric(name: str) -> ErrorMetric:
        if name not in metrics:
            metrics[name] = ErrorMetric.from_hessian(stats[name].hessian)
        return metrics[name].scaled(scaled[name]) if name in scaled else metrics[name]

    def fold(name: str, into: str, rows: slice | None = None) -> None:
        w = sd[f"{name}.weight"]
        st = stats[name]
        s = search_input_scale(w, spec.bits, group_for(spec, w.shape[1]), metric(name), st.mean_abs)
        if s is None:
            return
        sd[f"{name}.weight"] = w * s
        if rows is None:
            sd[into] = sd[into] / s
        else:
            sd[into][rows] /= s[:, None]
        scaled[name] = s

    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    head = lm_head_name(model)
    if spec.fp8:
        # W8A8's gain is in the decoder's GEMMs; the head's logits and the table's lookups keep full precision.
        targets = [n for n in targets if n != head]
    elif head == "embed_tokens":
        targets.append("embed_tokens")
    # Activation-aware scaling pays for int4 only: int8's perplexity barely moves with it, for twice the
    # quantization time (docs/perf/engine-notes.md).
    scale_inputs = calibrated and spec.bits == 4
    total = len(targets) + (cfg.num_layers if scale_inputs else 0)
    done = 0
    if scale_inputs:
        inter = cfg.intermediate_size
        for i in range(cfg.num_layers):
            p = f"layers.{i}"
            # down first: its scales land in gate_up's rows, which are searched after.
            fold(f"{p}.mlp.down_proj", f"{p}.mlp.gate_up_proj.weight", slice(inter, 2 * inter))
            fold(f"{p}.mlp.gate_up_proj", f"{p}.post_attention_layernorm.weight")
            fold(f"{p}.self_attn.qkv_proj", f"{p}.input_layernorm.weight")
            done += 1
            if progress:
                progress(done, total, "scaling")
    for name in targets:
        w = sd.pop(f"{name}.weight")
        group = group_for(spec, w.shape[1])
        if calibrated and name in stats and spec.bits == 4 and spec.error_feedback:
            q = gptq_int4(w, hessian(name), group)
        elif calibrated and name in stats:
            q = search_clip(w, spec.bits, group, hessian(name), metric(name), spec.fp8)
        else:
            q = quantize_weight(w, spec.bits, group, fp8=spec.fp8)
        prefix = f"{name}.table" if name == "embed_tokens" else name
        sd.update(q.tensors(prefix))
        modules[name] = {"bits": spec.bits, "group_size": group, "format": weight_format(spec)}
        if spec.fp8:
            modules[name]["act_fp8"] = name not in weight_only
        done += 1
        if progress:
            progress(done, total, "quantizing")
    if not cfg.tie_word_embeddings and not spec.fp8:
        # An untied input table is only looked up, so plain per-row rounding is all it needs.
        w = sd.pop("embed_tokens.weight")
        q = quantize_weight(w, spec.bits, group_for(spec, w.shape[1]))
        sd.update(q.tensors("embed_tokens.table"))
        modules["embed_tokens"] = {"bits": spec.bits, "group_size": group_for(spec, w.shape[1]),
                                   "format": weight_format(spec)}
    qconfig = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "bits": spec.bits,
        "format": weight_format(spec),
        "group_size": spec.group_size if spec.bits == 4 else None,
        "calibrated": calibrated,
        "int4_rounding": ("gptq" if spec.error_feedback else "clip_search") if calibrated and spec.bits == 4 else None,
        "input_scaled_modules": sorted(scaled),
        "modules": modules,
    }
    return sd, qconfig


def convert_for_runtime(model: LlamaForCausalLM, qconfig: dict, dtype: torch.dtype) -> LlamaForCausalLM:
    """Swap in the quantized modules the quant config lists (works on the meta device). A record
    without a "format" is an integer one (checkpoints from before fp8); an fp8 one without "act_fp8"
    is W8A8 (from before the choice)."""
    for name, record in qconfig["modules"].items():
        bits, group = int(record["bits"]), record.get("group_size")
        if name == "embed_tokens":
            old = model.embed_tokens
            model.embed_tokens = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, bits, group, dtype)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if record.get("format") == "fp8":
            new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, record.get("act_fp8", True))
        else:
            new = make_quantized_linear(old.in_features, old.out_features, old.bias is not None, bits, group)
        setattr(parent, attr, new)
    return model


def quantized_buffer_names(qconfig: dict) -> set[str]:
    """State-dict keys that keep their stored dtype (codes, scales, offsets)."""
    names = set()
    for name in qconfig["modules"]:
        prefix = f"{name}.table" if name == "embed_tokens" else name
        names.update(f"{prefix}.{suffix}" for suffix in ("qweight", "scales", "offsets"))
    return names
