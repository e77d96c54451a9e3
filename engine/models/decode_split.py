"""From how many rows a thread the one-call decoder gives each thread its own group of rows.

decode_layers (engine/models/csrc/decode_layers.cpp) runs a decode-only step in one of two ways. Joint: every
kernel of every layer shares the step's rows out over the threads, which meet at the end of each kernel, about
240 times a step. Split: the rows are cut into one contiguous group per thread, each thread runs its group
through every layer, and the threads meet once. Both give the same bits. Split saves the meetings, but each
thread then streams the whole weight for its own rows, so the step reads the weights once per thread.

That pays where each thread's GEMMs stay compute-bound on their own weight stream. A thread with R rows does
2 R flops per weight while it reads b bytes of it (4 for fp32 panels, about 0.6-1.1 for compact panels), so it
is compute-bound from R >= b F / (2 W), F being the machine's fp32 GEMM rate and W the bytes per second that
all its threads read together while each of them reads all of those weights at once, as a split step does (F and
W both over all threads, which cancel). Below MIN_ROWS rows a thread the split did not pay on any machine measured
(docs/perf/engine-notes.md, "Decode split", with `.venv/bin/python -m bench.kernels.decode_split`).
The engine measures F and W once at start, in about 0.2 s (choose), unless the config fixes the rows
(`cpu_decode_split_rows`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine.kernels.cpu_build import cpu_kernels

MIN_ROWS = 8  # below this many rows a thread the split did not pay on any machine measured
MAX_ROWS = 256  # the panel kernel's largest batch: from here on the split never applies
GEMM_SHAPE = (512, 576, 1536)  # rows, in, out: about 0.9 GFLOP, near the machine's fp32 roof
GEMM_REPS = 8
GEMM_WARMUP_S = 0.1
READ_REPS = 2


@dataclass(frozen=True)
class SplitChoice:
    rows: int  # rows per thread from which decode_layers splits
    gemm_gflops: float  # F
    stream_gbps: float  # W, over the weights a decode step streams
    bytes_per_weight: float  # b
    seconds: float  # what measuring took


def split_rows(gemm_gflops: float, stream_gbps: float, bytes_per_weight: float) -> int:
    """The rows a thread needs for its GEMMs to be compute-bound on its own weight stream, within
    [MIN_ROWS, MAX_ROWS]."""
    if not (gemm_gflops > 0 and stream_gbps > 0 and bytes_per_weight > 0):
        raise ValueError(f"rates must be positive: {gemm_gflops} GFLOP/s, {stream_gbps} GB/s, "
                         f"{bytes_per_weight} bytes a weight")
    rows = math.ceil(bytes_per_weight * gemm_gflops / (2 * stream_gbps))
    return min(MAX_ROWS, max(MIN_ROWS, rows))


def _best(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm_gflops() -> float:
    """The best of GEMM_REPS fp32 GEMMs of GEMM_SHAPE (torch.mm), in GFLOP/s, after GEMM_WARMUP_S of them: a
    process's first GEMMs can run slower than its later ones."""
    m, k, n = GEMM_SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    start = time.perf_counter()
    while time.perf_counter() - start < GEMM_WARMUP_S:
        torch.mm(a, b)
    return 2 * m * k * n / _best(lambda: torch.mm(a, b), GEMM_REPS) / 1e9


def measure_stream_gbps(tensors: list[torch.Tensor]) -> float:
    """The bytes all threads read together per second when each of them reads every byte of `tensors` at once
    (as they lie in memory, in their own pages), as a split step streams the weights; best of READ_REPS passes."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total == 0:
        raise ValueError("nothing to read")
    read_all = cpu_kernels().stream_read_all
    return total * torch.get_num_threads() / _best(lambda: read_all(tensors), READ_REPS) / 1e9


def choose(packed: list[torch.Tensor], weights: int) -> SplitChoice:
    """split_rows for this machine and these packed decode weights (`weights` values in all)."""
    start = time.perf_counter()
    streamed = [t for t in packed if t.numel() > 0]
    nbytes = sum(t.numel() * t.element_size() for t in streamed)
    b = nbytes / weights
    f, w = measure_gemm_gflops(), measure_stream_gbps(streamed)
    return SplitChoice(split_rows(f, w, b), f, w, b, time.perf_counter() - start)
