"""fp8 weights with or without fp8 activations: Fp8Linear.act_fp8 on the CPU reference path, the
calibrated choice of which layer roles stay weight-only, the setting's validation, and the choice
saved by `infinilm quantize --format fp8` (compressed-tensors groups) and loaded back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cli import app
from engine import LLM, EngineConfig
from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import InvalidRequestError
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.quant.calibration import calibration_sequences
from engine.quant.fp8 import Fp8Linear
from engine.quant.fp8_activations import choose_weight_only, w8a8_share, weight_only_modules
from engine.quant.hf_fp8 import activations_quantized
from engine.quant.quantizers import quantize_rows_fp8
from engine.quant.search import quantize_weight
from engine.tokenizer import Tokenizer

OUTLIER = 1e5  # pushes the other channels of a token into E4M3's subnormals, where rounding is coarse


def _layer(act_fp8: bool) -> tuple[Fp8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 48, generator=g) * 0.05
    q = quantize_weight(w, 8, None, fp8=True)
    layer = Fp8Linear(48, 24, bias=True, act_fp8=act_fp8)
    layer.qweight, layer.scales, layer.bias.data = q.qweight, q.scales, torch.randn(24, generator=g)
    return layer, q.dequantize()


def test_weight_only_multiplies_the_unrounded_activations_and_w8a8_the_rounded_ones():
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(4))
    x[:, 0] *= 300.0  # an outlier channel: rounding the rest per token is then visible
    codes, scales = quantize_rows_fp8(x)
    with torch.inference_mode():
        for act_fp8, inputs in ((False, x), (True, codes.float() * scales)):
            layer, w = _layer(act_fp8)
            torch.testing.assert_close(layer(x), inputs @ w.T + layer.bias, rtol=1e-5, atol=1e-5)
            assert f"activations={'fp8' if act_fp8 else 'full'}" in repr(layer)
    assert not torch.allclose(codes.float() * scales, x, rtol=1e-3, atol=0)


def test_choice_goes_by_cost_per_byte_within_the_budget():
    sizes = {"qkv": 25, "o": 17, "gate_up": 117, "down": 59}
    costs = {"qkv": 5.0, "o": 2.0, "gate_up": 7.0, "down": -0.1}
    assert choose_weight_only(costs, sizes, budget=0.3) == {"qkv", "o"}
    assert choose_weight_only(costs, sizes, budget=0.12) == {"qkv"}
    assert choose_weight_only(costs, sizes, budget=0.8) == {"qkv", "o", "gate_up"}  # down's rounding costs nothing
    assert choose_weight_only(costs, sizes, budget=0.0) == set()


def _with_qkv_outliers(src, dst):
    """A copy of the tiny Llama whose attention inputs have two outlier channels: the input norm's
    weights for them times OUTLIER, q/k/v's weight columns divided by it (the same function)."""
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    for name in state:
        if name.endswith("input_layernorm.weight"):
            state[name][:2] *= OUTLIER
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            state[name][:, :2] /= OUTLIER
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def outlier_llama(tiny_llama, tmp_path_factory):
    return _with_qkv_outliers(tiny_llama, tmp_path_factory.mktemp("outliers") / "model")


def test_auto_keeps_the_role_with_outlier_channels_weight_only(outlier_llama):
    mc = ModelConfig.from_folder(outlier_llama)
    model = load_model(outlier_llama, mc, TorchAttentionBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim), 256,
                       torch.float32, torch.device("cpu"))
    sequences = calibration_sequences(Tokenizer(outlier_llama, mc.eos_token_ids), max_tokens=256, seq_len=128)
    chosen, record = weight_only_modules(model, "auto", sequences)
    assert chosen == {f"layers.{i}.self_attn.qkv_proj" for i in range(mc.num_layers)}, record
    assert record["weight_only_groups"] == ["self_attn.qkv_proj"]
    assert max(record["kl_by_group"], key=record["kl_by_group"].get) == "self_attn.qkv_proj"
    assert weight_only_modules(model, "all", sequences)[0] == frozenset()
    assert len(weight_only_modules(model, "none", sequences)[0]) == 4 * mc.num_layers  # the head stays fp32
    assert weight_only_modules(model, "auto", None)[0] == frozenset()  # no calibration data: all W8A8


def test_the_setting_is_validated():
    assert EngineConfig(weight_bits=8, weight_format="fp8", fp8_activations="none").fp8_activations == "none"
    assert EngineConfig().fp8_activations == "auto"
    with pytest.raises(InvalidRequestError, match="fp8_activations must be 'auto', 'all' or 'none', got 'some'"):
        EngineConfig(weight_bits=8, fp8_activations="some")
    with pytest.raises(InvalidRequestError, match=r"fp8_activations none .* needs weight_bits: 8"):
        EngineConfig(fp8_activations="none")
    with pytest.raises(InvalidRequestError, match="weight_format fp8 or auto, got 8 and int8"):
        EngineConfig(weight_bits=8, weight_format="int8", fp8_activations="all")
    for args in (["--fp8-activations", "some"], ["--fp8-activations", "none", "--bits", "8"]):
        result = CliRunner().invoke(app, ["quantize", "--model", "x", "--out", "/nonexistent/q", *args])
        assert result.exit_code == 1 and "--fp8-activations" in result.output


def test_compressed_tensors_groups_say_which_layers_quantize_their_inputs():
    acts = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
    qconfig = {"quant_method": "compressed-tensors", "config_groups": {
        "a": {"targets": ["Linear"], "input_activations": acts},
        "b": {"targets": ["re:.*mlp\\.(gate|up)_proj$", "model.layers.0.self_attn.q_proj"], "input_activations": None},
        "c": {"targets": ["model.layers.1.mlp.up_proj"], "input_activations": acts}}}
    assert activations_quantized(qconfig, "model.layers.0.self_attn.k_proj")  # by class
    assert not activations_quantized(qconfig, "model.layers.0.self_attn.q_proj")  # by name
    assert not activations_quantized(qconfig, "model.layers.0.mlp.gate_proj")  # by pattern
    assert activations_quantized(qconfig, "model.layers.1.mlp.up_proj")  # a name before a pattern
    assert activations_quantized({"quant_method": "fp8", "activation_scheme": "dynamic"}, "model.layers.0.mlp.up_proj")


@pytest.mark.slow
def test_quantize_saves_the_choice_and_the_folder_loads_it_back(outlier_llama, tmp_path):
    out = tmp_path / "fp8"
    result = CliRunner().invoke(app, ["quantize", "--model", str(outlier_llama), "--out", str(out), "--format", "fp8"])
    assert result.exit_code == 0, result.output
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_1"]["input_activations"] is None
    assert "model.layers.1.self_attn.k_proj" in groups["group_1"]["targets"]
    assert "model.layers.1.self_attn.o_proj" in groups["group_0"]["targets"]
    record = json.loads((out / "infinilm_quantization.json").read_text())["fp8_activations"]
    assert record["weight_only_groups"] == ["self_attn.qkv_proj"]
    saved = LLM(model=str(out), dtype="float32", weight_bits=8, weight_format="fp8")
    flags = {n: m.act_fp8 for n, m in saved.engine.model.named_modules() if isinstance(m, Fp8Linear)}
    assert flags and all(flags[n] == ("qkv" not in n) for n in flags)
    assert w8a8_share(saved.engine.model) == pytest.approx(1 - 2 * 8192 / (2 * 36864))
    forced = LLM(model=str(out), dtype="float32", weight_bits=8, weight_format="fp8", fp8_activations="all")
    assert w8a8_share(forced.engine.model) == 1.0
