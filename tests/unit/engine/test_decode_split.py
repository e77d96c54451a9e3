"""When the one-call decoder gives each thread its own rows (engine/models/decode_split.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.models import decode_split
from tests.conftest import write_tiny_model

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow


def test_split_rows_is_where_a_threads_gemms_stay_compute_bound_on_their_own_weight_stream():
    # rows = ceil(bytes per weight x GFLOP/s / (2 x GB/s)), within [MIN_ROWS, MAX_ROWS].
    assert decode_split.split_rows(330, 25, 4) == 27  # fp32 panels, the Intel dev VM's balance
    assert decode_split.split_rows(217, 65, 4) == decode_split.MIN_ROWS  # 6.7: the AMD VM at a fast moment
    assert decode_split.split_rows(217, 35, 4) == 13  # the same VM at a slow moment
    assert decode_split.split_rows(330, 60, 0.7) == decode_split.MIN_ROWS  # compact panels
    assert decode_split.split_rows(1000, 1, 4) == decode_split.MAX_ROWS
    for bad in ((0, 25, 4), (330, 0, 4), (330, 25, 0), (float("nan"), 25, 4)):
        with pytest.raises(ValueError, match="must be positive"):
            decode_split.split_rows(*bad)


def test_measured_rates_are_what_the_tensors_and_the_gemm_give():
    gflops = decode_split.measure_gemm_gflops()
    assert 0 < gflops < 1e5
    tensors = [torch.randn(256, 1024), torch.zeros(64, 10, 640, dtype=torch.uint8), torch.zeros(7, dtype=torch.uint8)]
    assert decode_split.measure_stream_gbps(tensors) > 0
    with pytest.raises(ValueError, match="nothing to read"):
        decode_split.measure_stream_gbps([torch.empty(0)])


def test_cpu_decode_split_rows_takes_auto_or_a_positive_integer():
    assert EngineConfig(model="m").cpu_decode_split_rows == "auto"
    assert EngineConfig(model="m", cpu_decode_split_rows=3).cpu_decode_split_rows == 3
    for bad in (0, -1, True, "sometimes", 2.5):
        with pytest.raises(InvalidRequestError, match="cpu_decode_split_rows must be 'auto' or an integer >= 1"):
            EngineConfig(model="m", cpu_decode_split_rows=bad)


@pytest.mark.usefixtures("kernel_isa")
def test_the_engine_measures_its_split_at_start_with_two_threads_and_not_with_one(tmp_path):
    path = write_tiny_model(tmp_path / "llama", "llama", seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, cpu_prepack_weights=True)
        model, choice = llm.engine.model, llm.engine.decode_split
        assert choice is not None
        assert model.fused_decoder.split_rows == choice.rows == decode_split.split_rows(
            choice.gemm_gflops, choice.stream_gbps, choice.bytes_per_weight)
        # The layers' fp32 panels: 4 bytes a weight, more where out_features is padded to the panels' 32 columns.
        linears = model.decoder_linears()
        packed = sum(m.packed.numel() * m.packed.element_size() for m in linears)
        assert choice.bytes_per_weight == pytest.approx(packed / sum(m.in_features * m.out_features for m in linears))
        assert choice.bytes_per_weight >= 4
        torch.set_num_threads(1)  # nothing to split: nothing measured, the default kept
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, cpu_prepack_weights=True)
        assert llm.engine.decode_split is None
        assert llm.engine.model.fused_decoder.split_rows == decode_split.MIN_ROWS
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("kernel_isa")
def test_stream_read_all_reads_every_byte_of_every_tensor():
    """With an odd number of threads the folded value is one thread's: the xor of every 8-byte word of each
    tensor's whole 256-byte chunks and of each byte after them."""
    from engine.kernels.cpu_build import cpu_kernels

    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (4096, 1000, 7)]
    tensors.append(torch.randn(33, 17, generator=g))
    expected = 0
    for t in tensors:
        raw = t.view(torch.uint8).flatten()
        whole = raw.numel() // 256 * 256
        for word in raw[:whole].view(torch.int64).tolist():
            expected ^= word & 0xFFFFFFFFFFFFFFFF
        for byte in raw[whole:].tolist():
            expected ^= byte
    expected &= 0x7FFFFFFFFFFFFFFF
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert cpu_kernels().stream_read_all(tensors) == expected
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels().stream_read_all([torch.randn(8, 8).t()])
