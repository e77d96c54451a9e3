"""fp8 weights on the CPU: the format's selection and errors, the reference path's numerics, the
calibrated scales, and the engine end to end (load-time quantization, dummy weights)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import InvalidRequestError
from engine.models.config import ModelConfig
from engine.models.linear import Linear
from engine.models.loader import load_model
from engine.quant import fp8 as fp8_module
from engine.quant.calibration import calibration_sequences, collect_statistics
from engine.quant.fp8 import Fp8Linear, fake_quantize_rows, resolve_weight_format
from engine.quant.modules import Int8Linear
from engine.quant.quantizers import FP8_DTYPE, fp8_scales, quantize_fp8, quantize_rows_fp8
from engine.quant.search import ErrorMetric, fp8_rounding_error, output_error, quantize_weight, search_clip
from engine.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 40, 77, 120, 9, 33], [200, 3, 3, 18]]


def test_weight_format_needs_8_bits_and_a_known_name():
    assert EngineConfig(weight_bits=8, weight_format="fp8").weight_format == "fp8"
    assert EngineConfig().weight_format == "auto"
    for bits in (4, 16):
        with pytest.raises(InvalidRequestError, match="weight_format fp8 is an 8-bit weight format"):
            EngineConfig(weight_bits=bits, weight_format="fp8")
    with pytest.raises(InvalidRequestError, match="weight_format must be"):
        EngineConfig(weight_bits=8, weight_format="fp4")


def test_auto_is_fp8_on_sm89_and_later_and_fp8_is_refused_below(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_weight_format("auto", cpu) == "int8"  # the CPU keeps its int8 kernels
    assert resolve_weight_format("fp8", cpu) == "fp8"  # the reference path (what CI runs)
    monkeypatch.setattr(fp8_module, "_capability", lambda index: (9, 0))
    assert resolve_weight_format("auto", gpu) == "fp8"
    assert resolve_weight_format("int8", gpu) == "int8"
    monkeypatch.setattr(fp8_module, "_capability", lambda index: (8, 0))
    assert resolve_weight_format("auto", gpu) == "int8"
    with pytest.raises(InvalidRequestError, match=r"compute capability 8.9 or later.*cuda:0 is 8.0"):
        resolve_weight_format("fp8", gpu)


def test_fp8_weight_round_trip_is_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    s = fp8_scales(w)
    q = quantize_fp8(w, s)
    assert q.dtype == FP8_DTYPE and torch.allclose(q.float().abs().amax(1), torch.full((48,), 448.0))
    back = q.float() * s[:, None]
    # Half a step of a 3-bit mantissa, relative; plus half the smallest subnormal step, absolute.
    assert ((back - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-10).all()
    assert torch.equal(fp8_rounding_error(w), back - w)


def test_reference_path_multiplies_per_token_fp8_activations_by_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    w, x, bias = torch.randn(40, 64, generator=g) * 0.05, torch.randn(7, 64, generator=g), torch.randn(40, generator=g)
    q = quantize_weight(w, 8, None, fp8=True)
    layer = Fp8Linear(64, 40, bias=True)
    layer.qweight, layer.scales, layer.bias.data = q.qweight, q.scales, bias
    codes, scales = quantize_rows_fp8(x)
    want = (codes.float() * scales) @ q.dequantize().T + bias
    with torch.inference_mode():
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.view(7, 1, 64)).view(7, 40), got)
    # W8A8 stays within a few percent of the full-precision product.
    exact = x @ w.T + bias
    assert ((got - exact).norm() / exact.norm()).item() < 0.05
    assert torch.equal(fake_quantize_rows(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_fp8_clip_search_lowers_the_layer_output_error_of_a_tiny_model(tiny_llama):
    mc = ModelConfig.from_folder(tiny_llama)
    model = load_model(tiny_llama, mc, TorchAttentionBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim), 256,
                       torch.float32, torch.device("cpu"))
    tokenizer = Tokenizer(tiny_llama, mc.eos_token_ids)
    stats = collect_statistics(model, calibration_sequences(tokenizer, max_tokens=512, seq_len=128))
    total_rtn = total_searched = 0.0
    for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"):
        w, h = model.get_submodule(name).weight.detach(), stats[name].hessian
        rtn = output_error(w - quantize_weight(w, 8, None, fp8=True).dequantize(), h)
        exact = output_error(w - search_clip(w, 8, None, h, fp8=True).dequantize(), h)
        approx = output_error(w - search_clip(w, 8, None, h, ErrorMetric.from_hessian(h), fp8=True).dequantize(), h)
        assert torch.all(exact <= rtn + 1e-12)  # per channel: 1.0 is on the grid, the error is separable
        assert exact.sum() < rtn.sum() and approx.sum() < rtn.sum()
        total_rtn, total_searched = total_rtn + rtn.sum().item(), total_searched + approx.sum().item()
    assert total_searched < 0.97 * total_rtn


@pytest.mark.slow
def test_load_time_fp8_quantizes_the_decoder_and_keeps_head_and_embedding(tiny_llama):
    fp32 = LLM(model=str(tiny_llama), dtype="float32")
    fp8 = LLM(model=str(tiny_llama), dtype="float32", weight_bits=8, weight_format="fp8")
    auto = LLM(model=str(tiny_llama), dtype="float32", weight_bits=8)
    model = fp8.engine.model
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, Fp8Linear) and proj.qweight.dtype == FP8_DTYPE
    assert isinstance(model.lm_head, Linear) and isinstance(model.embed_tokens, torch.nn.Embedding)
    q = model.config.quantization
    assert q["format"] == "fp8" and q["calibrated"] and "lm_head" not in q["modules"]
    assert isinstance(auto.engine.model.layers[0].mlp.down_proj, Int8Linear)  # auto on the CPU: int8, as before
    a, b = fp32.generate(PROMPTS, GREEDY), fp8.generate(PROMPTS, GREEDY)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids[:4] == y.token_ids[:4]
        assert max(abs(s[0] - t[0]) for s, t in zip(x.logprobs[:4], y.logprobs[:4], strict=True)) < 0.05
    # fp8 codes are a quarter of fp32's bytes; the head and the table stay fp32.
    assert fp8.engine.weight_bytes < fp32.engine.weight_bytes


@pytest.mark.slow
def test_dummy_weights_quantize_in_place_for_benchmarks(tmp_path):
    from bench.gpu_check import TINY, write_config_only

    path = write_config_only(TINY)
    engines = {fmt: EngineCore(EngineConfig(model=str(path), dtype="float32", device="cpu", load_format="dummy",
                                            max_model_len=128, weight_bits=8, weight_format=fmt))
               for fmt in ("fp8", "int8")}
    assert isinstance(engines["fp8"].model.layers[1].mlp.down_proj, Fp8Linear)
    assert isinstance(engines["fp8"].model.lm_head, Linear)
    assert isinstance(engines["int8"].model.layers[1].mlp.down_proj, Int8Linear)
    assert isinstance(engines["int8"].model.lm_head, Int8Linear)
    for engine in engines.values():
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
