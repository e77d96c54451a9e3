"""The quantized linears' Triton kernels against torch, on the CPU under TRITON_INTERPRET=1 (compiled where
a CUDA device is present): the per-token fp8 activation quantizer and the int8 weight-only GEMM.

NOTE: the interpreter runs kernels with numpy, which has no 8-bit float type. Triton 3.9's interpreter
emulates the fp32 -> E4M3 cast with bit arithmetic that rounds ties away from zero and drops the carry
when a mantissa rounds up into the next power of two, so its codes are not the GPU's. Interpreted, the
quantizer's test therefore has the kernel write its clamped quotients as fp32 and rounds them with
torch's .to(float8_e4m3fn), the round-to-nearest-even cast the compiled kernel does in registers;
compiled (on a GPU), the kernel's own E4M3 codes are compared. Its tl.dot also multiplies bf16 operands'
raw bits, so the GEMMs' bf16 cases run compiled only; their fp32 cases run the same code interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

# Before triton is imported: without a GPU, run the kernels in triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.quant.quantizers import FP8_DTYPE, quantize_rows_fp8
from engine.quant.search import quantize_weight
from engine.quant.triton_kernels import quantize_rows_fp8 as quantize_rows_kernel
from engine.quant.triton_kernels import w4a16_linear, w8a8_fp8_linear, w8a16_linear

pytestmark = pytest.mark.slow  # interpreted Triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("rows,width", [(1, 16), (5, 80), (33, 4100)])
def test_fp8_row_quantizer_matches_torch(rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * torch.logspace(-3, 2, rows)[:, None]).to(DEVICE)
    x[0, :3] = torch.tensor([300.0, -1e-4, 0.0])  # an outlier sets row 0's scale
    if rows > 1:
        x[-1] = 0.0  # a row of zeros: zero codes, the smallest scale
    want_q, want_s = quantize_rows_fp8(x)
    if INTERPRETED:
        quotients, s = quantize_rows_kernel(x, out_dtype=torch.float32)
        q = quotients.to(FP8_DTYPE)
    else:
        q, s = quantize_rows_kernel(x)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    assert q.dtype == FP8_DTYPE
    assert torch.equal(q.float(), want_q.float())
    # What the codes stand for: x within E4M3's relative step (2^-4 at worst, half a step after rounding).
    back = q.float() * s
    assert ((back - x).abs() <= x.abs() * 2**-4 + s * 2**-9).all()


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_gemm_matches_dequantized_matmul(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 144  # odd multiples of 16: partial tiles in both directions
    w = torch.randn(n, k, generator=gen) * 0.05
    q = quantize_weight(w, 8, None)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    qweight, scales = q.qweight.to(DEVICE), q.scales.to(DEVICE)
    for b in (None, bias.to(DEVICE, dtype)):
        got = w8a16_linear(x, qweight, scales, b)
        want = x.double() @ q.dequantize().double().T.to(DEVICE)
        if b is not None:
            want = want + b.double()
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_w8a16_gemm_takes_leading_dims_and_strided_rows():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=gen)
    q = quantize_weight(w, 8, None)
    base = torch.randn(2, 3, 128, generator=gen).to(DEVICE)
    x = base[..., :64]  # rows 128 apart
    got = w8a16_linear(x, q.qweight.to(DEVICE), q.scales.to(DEVICE))
    want = x.reshape(-1, 64).cpu() @ q.dequantize().T
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.reshape(-1, 32).cpu(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("k,group", [(96, 32), (192, 96)])
def test_w4a16_gemm_matches_dequantized_matmul(rows, k, group):
    gen = torch.Generator().manual_seed(rows + k)
    n = 48
    w = torch.randn(n, k, generator=gen) * 0.05
    q = quantize_weight(w, 4, group)
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE)
    got = w4a16_linear(x, q.qweight.to(DEVICE), q.scales.to(DEVICE), q.offsets.to(DEVICE), bias)
    want = x.double().cpu() @ q.dequantize().double().T + bias.double().cpu()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if not INTERPRETED:  # the kernel's bf16 path, compiled
        got = w4a16_linear(x.bfloat16(), q.qweight.to(DEVICE), q.scales.to(DEVICE), q.offsets.to(DEVICE))
        torch.testing.assert_close(got.double().cpu(), want - bias.double().cpu(), rtol=3e-2,
                                   atol=3e-2 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp8_gemm_matches_scaled_product(rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 144
    q = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, 8, None, fp8=True)
    xq, xs = quantize_rows_fp8(torch.randn(rows, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    got = w8a8_fp8_linear(xq.to(DEVICE), xs.to(DEVICE), q.qweight.to(DEVICE), q.scales.to(DEVICE),
                          bias.to(DEVICE), out_dtype=torch.float32)
    want = (xq.double() * xs.double()) @ q.dequantize().double().T + bias.double()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_w8a16_gemm_also_reads_fp8_weights():
    """fp8 weight-only (W8A16): what bench.gpu_weights times as the fallback for layers whose activations
    should stay in bf16 (docs/perf/gpu.md, "Weight formats")."""
    gen = torch.Generator().manual_seed(7)
    q = quantize_weight(torch.randn(48, 144, generator=gen) * 0.05, 8, None, fp8=True)
    x = torch.randn(5, 144, generator=gen)
    got = w8a16_linear(x.to(DEVICE), q.qweight.to(DEVICE), q.scales.to(DEVICE))
    want = x.double() @ q.dequantize().double().T
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_weight_only_fp8_linear_runs_the_w8a16_kernel_on_its_codes(monkeypatch):
    """Fp8Linear.act_fp8 False on CUDA: the weight-only GEMM on the E4M3 codes, activations unrounded
    (here the interpreter runs it on the CPU)."""
    from engine.quant import fp8, triton_kernels

    calls = []
    monkeypatch.setattr(fp8, "_use_triton", lambda x: True)
    monkeypatch.setattr(triton_kernels, "w8a16_linear", lambda *a: calls.append(a) or w8a16_linear(*a))
    gen = torch.Generator().manual_seed(8)
    q = quantize_weight(torch.randn(48, 144, generator=gen) * 0.05, 8, None, fp8=True)
    layer = fp8.Fp8Linear(144, 48, act_fp8=False).to(DEVICE)
    layer.qweight, layer.scales = q.qweight.to(DEVICE), q.scales.to(DEVICE)
    x = torch.randn(3, 144, generator=gen)
    with torch.inference_mode():
        got = layer(x.to(DEVICE))
    assert len(calls) == 1 and calls[0][1] is layer.qweight
    want = x.double() @ q.dequantize().double().T
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_k_splits_fill_the_multiprocessors_only_when_the_tiles_do_not(monkeypatch):
    from engine.quant import triton_kernels

    cpu = torch.device("cpu")  # counts as 4 multiprocessors
    assert triton_kernels.k_splits(4, 4096, 128, cpu) == (1, 4096)  # a tile per multiprocessor already
    assert triton_kernels.k_splits(1, 4096, 128, cpu) == (8, 512)  # 2 per multiprocessor, 4 steps each
    assert triton_kernels.k_splits(1, 7 * 128, 128, cpu) == (1, 896)  # too short to split into 4-step parts
    monkeypatch.setattr(triton_kernels, "multiprocessors", lambda device: 132)  # an H100
    # Batch 1 on the 8B shape, 16x64x128 tiles: qkv (96 tiles), o (64), down (64 over K 14336), gate_up (448).
    assert triton_kernels.k_splits(96, 4096, 128, cpu) == (3, 1408)
    assert triton_kernels.k_splits(64, 4096, 128, cpu) == (5, 896)
    assert triton_kernels.k_splits(64, 14336, 128, cpu) == (5, 2944)
    assert triton_kernels.k_splits(448, 4096, 128, cpu) == (1, 4096)
    assert triton_kernels.k_splits(64, 4096, 128, cpu, most=4) == (4, 1024)  # o at 16 rows: partials capped
    for programs, k in ((96, 4096), (64, 4096), (64, 14336), (1, 1100)):
        splits, per = triton_kernels.k_splits(programs, k, 128, cpu)
        assert per % 128 == 0 and (splits - 1) * per < k <= splits * per  # every input in exactly one split


def test_the_partials_of_a_split_add_at_most_an_eighth_to_the_weights_bytes(monkeypatch):
    """8B o projection (4096 x 4096) on an H100: 1 row splits 5 ways, 16 rows 4 (int8) or 2 (int4), 64 none."""
    from engine.quant import triton_kernels

    monkeypatch.setattr(triton_kernels, "multiprocessors", lambda device: 132)
    for rows, weight_bytes, want in ((1, 1.0, 5), (16, 1.0, 4), (16, 0.5, 2), (64, 1.0, 1)):
        g = triton_kernels._gemm_launch(torch.zeros(rows, 4096), 4096, weight_bytes=weight_bytes)
        assert g.grid[2] == want, (rows, weight_bytes)
        assert 8 * want * rows * 4096 <= 4096 * 4096 * weight_bytes / 8 or want == 1


def test_gemms_of_no_rows_return_empty_outputs():
    q = quantize_weight(torch.randn(48, 1152) * 0.05, 8, None)
    q4 = quantize_weight(torch.randn(48, 1152) * 0.05, 4, 128)
    x = torch.zeros(0, 1152, device=DEVICE)
    assert w8a16_linear(x, q.qweight.to(DEVICE), q.scales.to(DEVICE)).shape == (0, 48)
    assert w4a16_linear(x, q4.qweight.to(DEVICE), q4.scales.to(DEVICE), q4.offsets.to(DEVICE)).shape == (0, 48)


@pytest.mark.parametrize("splits", [None, 3])
def test_gemms_split_over_k_match_the_unsplit_products(splits):
    """K = 1152 in 3 splits of 384 (and, by default on the CPU's 4 'multiprocessors', k_splits' 2): each
    kernel's fp32 partials summed by the reduce kernel, the bias added once."""
    from engine.quant.triton_kernels import k_splits

    gen = torch.Generator().manual_seed(11)
    n, k, rows = 48, 1152, 3
    assert k_splits(1, k, 128, torch.device("cpu"))[0] == 2
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    q8, f8, q4 = quantize_weight(w, 8, None), quantize_weight(w, 8, None, fp8=True), quantize_weight(w, 4, 128)
    xd, bd = x.to(DEVICE), bias.to(DEVICE)
    for q in (q8, f8):
        got = w8a16_linear(xd, q.qweight.to(DEVICE), q.scales.to(DEVICE), bd, splits=splits)
        want = x.double() @ q.dequantize().double().T + bias.double()
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got = w4a16_linear(xd, q4.qweight.to(DEVICE), q4.scales.to(DEVICE), q4.offsets.to(DEVICE), bd, splits=splits)
    want = x.double() @ q4.dequantize().double().T + bias.double()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    xq, xs = quantize_rows_fp8(x)
    got = w8a8_fp8_linear(xq.to(DEVICE), xs.to(DEVICE), f8.qweight.to(DEVICE), f8.scales.to(DEVICE), bd,
                          out_dtype=torch.float32, splits=splits)
    want = (xq.double() * xs.double()) @ f8.dequantize().double().T + bias.double()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
