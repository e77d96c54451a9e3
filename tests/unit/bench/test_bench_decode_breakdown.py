"""bench.kernels.decode_breakdown: the replayed step is the engine's own, the arms alternate, the table's arithmetic."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.kernels import cpu_build
from tests.conftest import write_tiny_model


def test_measure_turns_the_order_each_round_and_records_each_rounds_rates():
    from bench.kernels import decode_breakdown

    log: list[str] = []
    calls = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    rates = iter(range(100))
    result = decode_breakdown.measure(calls, 3, gemm=lambda: float(next(rates)), read=lambda: 7.0)
    assert log[:3] == ["a", "b", "c"]  # the warm-up calls
    assert log[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(result[k]) == 3 and all(t >= 0 for t in result[k]) for k in calls)
    assert result["gemm_gflops"] == [0.0, 1.0, 2.0] and result["read_gbps"] == [7.0] * 3


def test_row_turns_medians_into_rates_and_floors():
    from bench.kernels import decode_breakdown

    batch = {"rows": 4, "context_tokens": 1000, "step": [0.010, 0.012, 0.011], "linears": [0.006] * 3,
             "linears_cached": [0.004] * 3, "attention": [0.002] * 3, "lm_head": [0.001] * 3,
             "gemm_gflops": [100.0] * 3, "read_gbps": [10.0] * 3}
    row = decode_breakdown.row(batch, layer_flops=250_000_000, weight_bytes=100_000_000, kv_row_bytes=1000)
    # 4 rows x 250 MFLOP = 1 GFLOP: 6 ms is 167 GFLOP/s, the floor at 100 GFLOP/s 10 ms; 100 MB at 10 GB/s 10 ms;
    # 1000 context rows x 1000 bytes in 2 ms is 0.5 GB/s; the rest of the step 11 - 6 - 2 = 3 ms.
    assert row == (4, 1000, "11.0", "6.0 (167)", "4.0 (250)", "10.0 / 10.0", "2.0 (0.5)", "3.0", "1.0", "100 / 10.0")


@pytest.mark.skipif(cpu_build.host_isa() == "baseline", reason="this host lacks AVX2: the one-call decoder runs on the panel kernel")
def test_the_captured_call_replays_the_engines_decode_step_bitwise(tmp_path):
    from bench.kernels import decode_breakdown

    path = write_tiny_model(tmp_path / "llama", "llama", seed=5)
    llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
              enable_prefix_caching=False, cpu_prepack_weights=True)
    prompts = [[3 + (7 * i + j) % 300 for j in range(20 + 3 * i)] for i in range(6)]
    args, out = decode_breakdown.capture_decode_call(llm, prompts, "t")
    assert args[0].shape[0] == 6 and not llm.engine.has_unfinished_requests()
    calls = decode_breakdown.arms(llm.engine.model, args, 6)
    assert set(calls) == set(decode_breakdown.ARMS)
    with torch.inference_mode():
        assert torch.equal(calls["step"](), out)
        assert torch.equal(calls["step"](), out)  # the kept rows are not changed by a replay
        assert calls["lm_head"]().shape == (6, llm.engine.model.config.vocab_size)


@pytest.mark.skipif(cpu_build.host_isa() == "baseline", reason="this host lacks AVX2: the one-call decoder runs on the panel kernel")
def test_capture_stops_clearly_where_no_decode_step_runs_in_one_call(tmp_path):
    from bench.kernels import decode_breakdown

    path = write_tiny_model(tmp_path / "llama", "llama", seed=5)
    llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=256, cpu_prepack_weights=False)
    with pytest.raises(SystemExit, match="no full-batch decode step through decode_layers"):
        decode_breakdown.capture_decode_call(llm, [[5, 6, 7], [8, 9]], "t")
