"""bench.gpu_kv's accounting, and its section's dry run on the CPU (small shapes)."""

from __future__ import annotations

import math
import os

import pytest
import torch

# Before triton is imported: without a GPU, the kernel rows run in triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.gpu_check import LLAMA3_8B, write_config_only
from bench.gpu_kv import FORMATS, kv_bytes_per_token, kv_formats, max_sequences, target_lines
from engine.models.config import ModelConfig


def test_bytes_per_token_and_sequences_in_the_same_memory_on_the_8b_shape():
    mc = ModelConfig.from_folder(write_config_only(LLAMA3_8B))
    # 32 layers x K and V x 8 KV heads: 128 bf16 values, 128 fp8 codes, or 128 int8 codes + an fp16 scale.
    assert kv_bytes_per_token(mc, "bf16", torch.bfloat16) == 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(mc, "fp8", torch.bfloat16) == 32 * 2 * 8 * 128
    assert kv_bytes_per_token(mc, "int8", torch.bfloat16) == 32 * 2 * 8 * 130
    seqs = {fmt: max_sequences(mc, fmt, torch.bfloat16, 16 << 30, 4096) for fmt in FORMATS}
    assert seqs == {"bf16": 32, "fp8": 64, "int8": 63}
    # The issue's 2x: fp8 meets it; int8's fp16 scale per row leaves it just short, and the line says so.
    lines = target_lines({"concurrency": {fmt: {"1024": 4 * n, "4096": n} for fmt, n in seqs.items()}})
    assert lines == ["target: fp8 KV holds >= 2x the sequences of bf16 KV in the same memory (context 4096): 2.00x (met)",
                     "target: int8 KV holds >= 2x the sequences of bf16 KV in the same memory (context 4096): 1.97x "
                     "(missed)"]


@pytest.mark.slow
def test_kv_formats_dry_run_on_the_cpu():
    result = kv_formats(torch.device("cpu"), 20e9, quick=True)
    assert result["errors"] == {}
    got = {(r["format"], r["context"], r["batch"]) for r in result["runs"]}
    assert got == {(f, c, b) for f in FORMATS for c in (48, 96) for b in (1, 4)}
    for r in result["runs"]:
        assert r["step_ms"] > 0 and math.isclose(r["share_of_roofline"], r["roofline_step_ms"] / r["step_ms"])
        if r["format"] == "fp8":  # the CPU's fp8 path is the torch reference
            assert r["attention_backend"] == "torch_int8"
    # Fewer KV bytes read at the same context and batch: fp8 < int8 < fp32 (the CPU's dtype).
    kv = {(r["format"]): r["kv_bytes"] for r in result["runs"] if (r["context"], r["batch"]) == (96, 4)}
    assert kv["fp8"] < kv["int8"] < kv["bf16"] / 3
    assert result["perplexity"][0]["skipped"]
    kernels = result["decode_kernels"]["rows"]
    assert [r["format"] for r in kernels] == ["bf16", "int8", "fp8"]
    # Both 8-bit kernels against the bf16 kernel on the same K/V: the quantization error, and no more.
    assert 0 < kernels[1]["max_abs_error_vs_bf16"] < 0.05 and 0 < kernels[2]["max_abs_error_vs_bf16"] < 0.2
    assert kernels[2]["kv_bytes"] < kernels[1]["kv_bytes"] < kernels[0]["kv_bytes"] / 3


@pytest.mark.slow
def test_launch_sweeps_dry_run_on_the_cpu(capsys):
    from bench.gpu_check import decode_sweep, print_report

    so_far = []
    result = decode_sweep(torch.device("cpu"), torch.float32, quick=True, partial=lambda r: so_far.append(list(r)))
    # What a call cut off mid-sweep keeps: the bf16 shape, then its prefill, then the 8-bit sweeps.
    assert so_far == [["tiny b=4"], ["tiny b=4", "prefill tiny"], list(result)]
    counts = {label: len(sweep["variants"]) for label, sweep in result.items()}
    # bf16 decode: pages x warps x stages x split, and 6 with the group padded to 16 rows; prefill: tile rows
    # x keys x warps; the 8-bit decode: pages x warps x stages and 4 padded, and its prefill keys x warps.
    assert counts == {"tiny b=4": 38, "prefill tiny": 8, "int8 tiny b=4 100": 20, "prefill int8 tiny 100": 4,
                      "fp8 tiny b=4 100": 20, "prefill fp8 tiny 100": 4}
    padded = [r for r in result["int8 tiny b=4 100"]["variants"] if r.get("group_rows") == 16]
    assert len(padded) == 4 and all(r["max_abs_error"] < 1e-5 for r in padded)
    for label, sweep in result.items():
        for row in sweep["variants"]:
            # Every setting computes what the default launch does (fp32: the same sums in another order).
            assert "error" not in row and row["max_abs_error"] < 1e-5, (label, row)
        assert math.isnan(sweep["default_us"]) and sweep["best"] is None  # nothing is timed on the CPU
    assert {("pages", "warps", "stages"), ("pages", "warps")} == {
        tuple(k for k in row if k in ("pages", "warps", "stages")) for row in result["fp8 tiny b=4 100"]["variants"]}
    prefill = {(r["block_m"], r["keys"], r["warps"]) for r in result["prefill tiny"]["variants"]}
    assert len(prefill) == 8 and (64, 64, 4) in prefill  # the engine's launch is among them
    # The report line a device run prints per sweep: the best launch against the engine's default.
    timed = {**result["fp8 tiny b=4 100"], "default_us": 120.0, "kv_bytes": 60_000_000}
    timed["best"] = {**timed["variants"][-1], "us": 80.0}  # a padded row: its group_rows is named
    print_report({"device": "test", "torch": "", "triton": "", "copy_bandwidth_GBps": 1.0, "date": "",
                  "decode_sweep": {"fp8 tiny b=4 100": timed, "int8 tiny b=4 100": result["int8 tiny b=4 100"],
                                   "unfinished": True}})
    out = capsys.readouterr().out
    assert "decode_sweep: cut off before it finished" in out
    lines = [x for x in out.splitlines() if x.startswith("sweep ")]
    assert lines == ["sweep fp8 tiny b=4 100: default 120us (500 GB/s); best 80us (1.50x the default) with "
                     f"pages={timed['best']['pages']} warps={timed['best']['warps']} group_rows=16",
                     "sweep int8 tiny b=4 100: 20 settings checked, none timed (no CUDA device)"]
