"""Weight quantizers, the calibrated scale searches, and the quantized linear modules on every path."""

from __future__ import annotations

import pytest
import torch

from engine.quant import modules as qmodules
from engine.quant.modules import Int4Linear, Int8Linear
from engine.quant.quantizers import (
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    int4_params,
    int8_scales,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from engine.quant.search import (
    ErrorMetric,
    gptq_int4,
    int8_rounding_error,
    output_error,
    quantize_weight,
    search_clip,
)

FP16_EPS = 2.0**-10  # fp16 relative rounding: half an ulp of a 10-bit mantissa, doubled for margin


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 7] *= 12  # an outlier input channel, as real layers have
    return w


def activations(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    """Correlated inputs with a few large channels, like a transformer's residual stream."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(rows, k, generator=g) @ (torch.eye(k) + mix)
    x[:, :4] *= 8
    return x


def test_int8_per_channel_round_trip_is_within_half_a_step():
    w = weights(96, 256)
    scales = int8_scales(w)
    err = (dequantize_int8(quantize_int8(w, scales), scales) - w).abs()
    assert torch.all(err <= scales[:, None] / 2 * (1 + 1e-6))
    # One step is 1/127 of the row's largest weight: a per-channel, not per-tensor, bound.
    assert torch.allclose(scales, w.abs().amax(1) / 127)


def test_int4_group_round_trip_is_within_half_a_step_plus_fp16_rounding():
    w = weights(64, 512)
    scale, offset = int4_params(w, 128)
    assert scale.shape == (64, 4) and scale.dtype == torch.float16
    codes = quantize_int4(w, scale, offset)
    assert codes.max() <= 15
    deq = dequantize_int4(pack_int4(codes), scale, offset)
    groups = w.reshape(64, 4, 128)
    width = (groups.amax(-1) - groups.amin(-1))[..., None]
    # Half a step, plus what storing scale and offset in fp16 can shift the grid by.
    bound = width / 30 + (15 * scale.float()[..., None] + offset.float().abs()[..., None]) * FP16_EPS
    assert torch.all((deq - w).reshape(64, 4, 128).abs() <= bound)


def test_int4_packing_round_trips_and_groups_fit_the_width():
    codes = torch.randint(0, 16, (5, 192), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    assert int4_group_size(4096, 128) == 128
    assert int4_group_size(576, 128) == 96  # SmolLM2's hidden size is not a multiple of 128
    with pytest.raises(ValueError):
        int4_group_size(100, 128)


def test_fast_int8_error_and_full_rank_metric_equal_the_exact_forms():
    w, x = weights(40, 128), activations(512, 128)
    h = x.T @ x / len(x)
    for clip in (1.0, 0.9):
        s = int8_scales(w, clip)
        exact = dequantize_int8(quantize_int8(w, s), s) - w
        assert torch.allclose(int8_rounding_error(w, clip), exact, atol=1e-7)
    e = int8_rounding_error(w, 0.9)
    full = ErrorMetric.from_hessian(h, rank=128)
    assert torch.allclose(full.rows(e.clone()), output_error(e, h), rtol=1e-3)
    # Scaling the metric is the metric of the scaled inputs.
    s = torch.rand(128) + 0.5
    assert torch.allclose(full.scaled(s).rows(e.clone()), output_error(e, h / s[:, None] / s[None, :]), rtol=1e-3)


def test_clip_search_never_does_worse_than_round_to_nearest_on_the_layer_output():
    w, x = weights(64, 256), activations(1024, 256)
    h = x.T @ x / len(x)
    rtn = quantize_weight(w, 8, None)
    searched = search_clip(w, 8, None, h)  # exact per-row error: 1.0 is on the grid
    assert torch.all(output_error(w - searched.dequantize(), h) <= output_error(w - rtn.dequantize(), h) + 1e-9)


def test_gptq_int4_lowers_the_layer_output_error_against_round_to_nearest():
    w, x = weights(64, 256), activations(2048, 256)
    h = x.T @ x / len(x)
    rtn = quantize_weight(w, 4, 128)
    gptq = gptq_int4(w, h, 128)
    assert output_error(w - gptq.dequantize(), h).sum() < 0.8 * output_error(w - rtn.dequantize(), h).sum()


def _int8_linear(n: int, k: int, bias: bool) -> Int8Linear:
    w = weights(n, k)
    q = quantize_weight(w, 8, None)
    m = Int8Linear(k, n, bias)
    m.qweight.copy_(q.qweight)
    m.scales.copy_(q.scales)
    if bias:
        m.bias.data.normal_(0, 0.1)
    return m


def _int4_linear(n: int, k: int, bias: bool) -> Int4Linear:
    w = weights(n, k)
    q = quantize_weight(w, 4, 128)
    m = Int4Linear(k, n, 128, bias)
    m.qweight.copy_(q.qweight)
    m.scales.copy_(q.scales)
    m.offsets.copy_(q.offsets)
    if bias:
        m.bias.data.normal_(0, 0.1)
    return m


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("make", [_int8_linear, _int4_linear], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 7, qmodules.KERNEL_MAX_ROWS, 200], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_dequantize_then_matmul(make, rows, bias, monkeypatch):
    m = make(192, 256, bias)
    x = torch.randn(rows, 256)
    ref = torch.nn.functional.linear(x, m.dequantize(), m.bias)
    if rows > qmodules.KERNEL_MAX_ROWS:
        monkeypatch.setattr(qmodules, "_DEQUANT_SLICE", 256 * 50)  # several slices of 50 output rows
    with torch.inference_mode():
        got = m(x)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("make", [_int8_linear, _int4_linear], ids=["int8", "int4"])
def test_cpu_kernels_run_for_decode_batches(make):
    m = make(64, 128, True)
    x = torch.randn(3, 128)
    with torch.inference_mode():
        assert qmodules._use_kernel(x)
        got = m(x)
    assert torch.allclose(got, torch.nn.functional.linear(x, m.dequantize(), m.bias), rtol=1e-4, atol=1e-4)
