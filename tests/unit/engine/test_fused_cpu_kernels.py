"""The fused fp32 CPU kernels (engine/models/csrc/fused_cpu.cpp) against the torch ops they replace.

RMSNorm, residual add + RMSNorm, and RoPE in place: the same values as the torch reference within
fp32 rounding, each row independent of the others in the batch (deterministic mode relies on
it), and clear errors for input they cannot take. SwiGLU's activation (silu(gate) * up in place):
bitwise the two torch ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_build import cpu_kernels, fused_cpu_ok
from engine.models.llama import MLP, RMSNorm
from engine.models.rope import RotaryEmbedding

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]
G = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


@pytest.mark.parametrize("rows,width", [(1, 576), (37, 64), (300, 100), (5, 7)])
def test_rms_norm_rows_matches_torch(rows, width):
    x, w = randn(rows, width) * 3, randn(width)
    got = cpu_kernels().rms_norm_rows(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), w, 1e-5), atol=2e-6, rtol=2e-6)


def test_rms_norm_rows_reads_strided_rows_and_each_row_alone():
    wide = randn(40, 96)
    x = wide[:, 16:80]  # rows 96 floats apart, as a split of a fused projection leaves them
    w = randn(64)
    got = cpu_kernels().rms_norm_rows(x, w, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(x, (64,), w, 1e-6), atol=2e-6, rtol=2e-6)
    for i in (0, 17, 39):  # batch-invariant: a row alone gives the same bits as in the batch
        assert torch.equal(cpu_kernels().rms_norm_rows(x[i:i + 1], w, 1e-6), got[i:i + 1])


def test_add_rms_norm_rows_adds_in_place_and_normalises_the_sum():
    residual, delta, w = randn(70, 128), randn(70, 128), randn(128)
    want_sum = residual + delta
    keep = residual
    out = cpu_kernels().add_rms_norm_rows(residual, delta, w, 1e-6)
    assert keep is residual and torch.equal(residual, want_sum)  # the residual stream itself holds the sum
    torch.testing.assert_close(out, F.rms_norm(want_sum, (128,), w, 1e-6), atol=2e-6, rtol=2e-6)


def test_rmsnorm_module_takes_the_kernel_and_falls_back_elsewhere():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(64))
        x = randn(9, 64)
        assert fused_cpu_ok(x)
        torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), atol=2e-6, rtol=2e-6)
        three_d = randn(9, 4, 16)  # per-head q/k norms (Qwen3) stay on torch
        norm16 = RMSNorm(16, 1e-6)
        norm16.weight.fill_(1.5)
        torch.testing.assert_close(norm16(three_d), F.rms_norm(three_d, (16,), norm16.weight, 1e-6))
        residual, delta = randn(9, 64), randn(9, 64)
        want = residual + delta
        h = norm.add_and_norm(residual, delta)
        assert torch.equal(residual, want)
        torch.testing.assert_close(h, F.rms_norm(want, (64,), norm.weight, 1e-6), atol=2e-6, rtol=2e-6)
    assert not fused_cpu_ok(torch.ones(2, 2, dtype=torch.bfloat16))


def rope_table() -> RotaryEmbedding:
    return RotaryEmbedding(64, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                           torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tokens", [1, 3, 45])
def test_rope_kernel_matches_torch_on_views_of_the_fused_projection(tokens):
    rope = rope_table()
    positions = torch.randint(0, 512, (tokens,), generator=G)
    qkv = randn(tokens, 9 * 64 + 2 * 3 * 64)
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.reshape(tokens, 9, 64), k.reshape(tokens, 3, 64)
    v_before = v.clone()
    want_q, want_k = rope(positions, q.clone(), k.clone())
    with torch.no_grad():
        rope.apply_(positions, q, k)
    torch.testing.assert_close(q, want_q, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(k, want_k, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(qkv[:, :9 * 64].reshape(tokens, 9, 64), want_q, atol=2e-6, rtol=2e-6)
    assert torch.equal(v, v_before)  # V, beside K in the same rows, is not touched


def test_rope_kernel_rows_do_not_depend_on_the_batch():
    rope = rope_table()
    positions = torch.randint(0, 512, (40,), generator=G)
    q, k = randn(40, 4, 64), randn(40, 2, 64)
    q_one, k_one = q[7:8].clone(), k[7:8].clone()
    cpu_kernels().rope_rows_(q, k, rope.cos, rope.sin, positions)
    cpu_kernels().rope_rows_(q_one, k_one, rope.cos, rope.sin, positions[7:8].clone())
    assert torch.equal(q[7:8], q_one) and torch.equal(k[7:8], k_one)


def test_kernels_refuse_what_they_cannot_take():
    rope = rope_table()
    q, k = randn(2, 4, 64), randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu_kernels().rope_rows_(q, k, rope.cos, rope.sin, torch.tensor([3, 512]))
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels().rms_norm_rows(randn(2, 8).double(), randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="same shape"):
        cpu_kernels().add_rms_norm_rows(randn(2, 8), randn(3, 8), randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="row width"):
        cpu_kernels().rms_norm_rows(randn(2, 8), randn(9), 1e-6)
    with pytest.raises(RuntimeError, match=r"gate_up must be \[rows, 2 \* 5\]"):
        cpu_kernels().silu_mul_rows_(randn(3, 11), 5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels().silu_mul_rows_(randn(10, 3).t(), 5)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels().silu_mul_rows_(randn(3, 10).half(), 5)


@pytest.mark.parametrize("rows,intermediate", [(1, 1536), (48, 1536), (300, 100), (5, 7), (3, 20)])
def test_silu_mul_rows_is_bitwise_the_two_torch_ops(rows, intermediate):
    # Magnitudes from tiny to past exp's range, a NaN and infinities; rows strided (a slice of wider rows).
    wide = randn(rows, 2 * intermediate + 3) * torch.logspace(-3, 2.3, 2 * intermediate + 3)
    wide[0, 0], wide[-1, 1], wide[-1, intermediate - 1] = float("nan"), float("inf"), -float("inf")
    gate_up = wide[:, :2 * intermediate]
    pad = wide[:, 2 * intermediate:].clone()
    want = gate_up.clone()  # like gate_up, the gate half's rows are strided: torch loops row by row
    g, u = want.split(intermediate, dim=1)
    F.silu(g, inplace=True).mul_(u)
    cpu_kernels().silu_mul_rows_(gate_up, intermediate)
    assert torch.equal(gate_up[:, :intermediate].nan_to_num(7.0), want[:, :intermediate].nan_to_num(7.0))
    assert torch.equal(gate_up[:, intermediate:], want[:, intermediate:])  # up is left as it was
    assert torch.equal(wide[:, 2 * intermediate:], pad)  # nothing past the row is touched


def test_mlp_activation_takes_the_kernel_and_returns_the_gate_half():
    mlp = MLP.__new__(MLP)
    mlp.intermediate = 6
    x = randn(4, 12)
    want = x.clone()
    g, u = want.split(6, dim=1)
    F.silu(g, inplace=True).mul_(u)
    with torch.no_grad():
        got = mlp._activate(x)
    assert got.data_ptr() == x.data_ptr() and got.shape == (4, 6)  # written over the gate half, no copy
    assert torch.equal(got, want[:, :6])


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 1000), (64, 4099), (2, 17), (4, 16), (3, 5), (1, 1)])
def test_argmax_rows_is_torch_max_indices_with_ties_and_nan(rows, vocab):
    """The first index of each row's maximum, as torch's max(dim).indices: ties go to the lowest index, in a
    lane's own run and across lanes, and a NaN anywhere in a row is its maximum (the first NaN wins)."""
    cases = [randn(rows, vocab) * 5, torch.round(randn(rows, vocab)), torch.zeros(rows, vocab)]
    tied = randn(rows, vocab)
    tied[:, [vocab - 1, vocab // 2, vocab // 3]] = 100.0
    cases.append(tied)
    nan = randn(rows, vocab)
    nan[0, vocab - 1] = float("nan")
    nan[-1, vocab // 2] = float("nan")
    nan[-1, max(vocab // 2 - 1, 0)] = float("inf")
    cases.append(nan)
    cases.append(randn(2 * rows, vocab)[::2])  # strided rows
    for x in cases:
        assert torch.equal(cpu_kernels().argmax_rows(x), x.max(dim=-1).indices)


def test_argmax_rows_rejects_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="fp32 CPU tensor"):
        cpu_kernels().argmax_rows(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="no columns"):
        cpu_kernels().argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="2-D"):
        cpu_kernels().argmax_rows(torch.zeros(8))
