"""The CPU roofline: what this machine can do, and how much work a workload is.

Two halves. `measure_machine` times fp32 GEMMs and large-tensor reads on the
machine the benchmark runs on, because spec-sheet peaks are never reached by
torch and would make every percentage look worse than the code is.
`FlopModel` counts the useful FLOPs of a Llama-style model: 2 FLOPs per
non-embedding weight per token, the LM head only for rows that are sampled,
and 4 * layers * heads * head_dim per attended context token (QK^T and PV).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import hugepages
from engine.models.config import ModelConfig

# (m, k, n): a large square product, and the shape of an MLP projection of the
# demo model (hidden 576 -> intermediate 1536) over a full 2048-token batch.
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((2048, 2048, 2048), (2048, 576, 1536))
BANDWIDTH_BYTES = 512 << 20


@dataclass(frozen=True)
class MachineRates:
    gemm_gflops: dict[str, float]  # "MxKxN" -> measured GFLOP/s
    peak_gflops: float  # the best of gemm_gflops: the compute roof
    read_gbps: float  # tensor.sum() over BANDWIDTH_BYTES: the memory roof
    copy_gbps: float  # bytes read + written per second by a copy of the same tensor

    def to_dict(self) -> dict:
        return asdict(self)


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # first call pays allocation and BLAS dispatch; it is not the steady state
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_gemm(m: int, k: int, n: int, reps: int) -> float:
    """Best-of-`reps` fp32 GEMM rate in GFLOP/s: the better of torch.mm (MKL) and, where torch has it, oneDNN's
    linear, because neither library is the faster one on every CPU (on the AMD EPYC dev VM of 2026-12-05
    oneDNN ran 5-25% faster than torch.mm) and the roof must be what this machine can do."""
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    out = torch.empty(m, n)
    seconds = _best_time(lambda: torch.mm(a, b, out=out), reps)
    if torch.backends.mkldnn.is_available():
        weight = b.t().contiguous()  # [n, k], a linear layer's layout
        with contextlib.suppress(RuntimeError):  # a torch build without the op keeps torch.mm's rate
            seconds = min(seconds, _best_time(
                lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""), reps))
    return 2 * m * k * n / seconds / 1e9


class ReadProbe:
    """The read rate of this moment (GB/s, the better of 4 KiB and huge pages; measure_bandwidth's read): its
    tensors are allocated once, so that it can run right before and after each round of a measurement whose
    memory floor it gives. On a shared VM the rate moves by up to 2x within seconds (36 to 63 GB/s on the dev
    VM of 2026-12-05), so a floor read minutes away from what it bounds can sit on either side of it."""

    def __init__(self, num_bytes: int = BANDWIDTH_BYTES) -> None:
        n = num_bytes // 4
        self.num_bytes = n * 4
        self.tensors = [torch.ones(n)]
        if hugepages.available():
            (huge,) = hugepages.zeros([((n,), torch.float32)])
            self.tensors.append(huge.fill_(1.0))

    def __call__(self, reps: int = 3) -> float:
        return self.num_bytes / min(_best_time(t.sum, reps) for t in self.tensors) / 1e9


def measure_bandwidth(num_bytes: int, reps: int) -> tuple[float, float]:
    """(read GB/s from a sum, copy GB/s counting read + write) over tensors far larger than any cache: the
    better of torch's 4 KiB pages and, where the host gives them, transparent huge pages (engine/hugepages.py,
    where the engine keeps its decode weights by default and its KV cache with `huge_pages: true`), so that the
    memory roof is this machine's best and not a page size's. The read is a ReadProbe's."""
    read = ReadProbe(num_bytes)(reps)
    n = num_bytes // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    copy = _best_time(lambda: y.copy_(x), reps)
    if hugepages.available():
        hx, hy = hugepages.zeros([((n,), torch.float32), ((n,), torch.float32)])
        hx.fill_(1.0)
        del x, y
        copy = min(copy, _best_time(lambda: hy.copy_(hx), reps))
    return read, 2 * n * 4 / copy / 1e9


def measure_machine(reps: int, on_step: Callable[[], None] = lambda: None) -> MachineRates:
    gemm: dict[str, float] = {}
    for m, k, n in GEMM_SHAPES:
        gemm[f"{m}x{k}x{n}"] = measure_gemm(m, k, n, reps)
        on_step()
    read, copy = measure_bandwidth(BANDWIDTH_BYTES, reps)
    on_step()
    return MachineRates(gemm, max(gemm.values()), read, copy)


def best_rates(measurements: list[dict]) -> dict:
    """The highest rate of each kind over several `MachineRates.to_dict()`: the roof is what the machine can do."""
    gemm = {shape: max(m["gemm_gflops"][shape] for m in measurements) for shape in measurements[0]["gemm_gflops"]}
    return MachineRates(gemm, max(gemm.values()), max(m["read_gbps"] for m in measurements),
                        max(m["copy_gbps"] for m in measurements)).to_dict()


def describe_machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import transformers

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        # A busy machine makes every number here meaningless; keep the evidence.
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


@dataclass(frozen=True)
class FlopModel:
    """Useful FLOPs of a forward pass, from the model's shape alone."""

    linear_per_token: int  # 2 * non-embedding parameters
    lm_head_per_row: int  # 2 * vocab * hidden, paid only by sampled rows
    attention_per_context: int  # 4 * layers * heads * head_dim, per attended token

    @classmethod
    def from_config(cls, mc: ModelConfig) -> FlopModel:
        return cls(
            linear_per_token=2 * mc.num_parameters(include_embeddings=False),
            lm_head_per_row=2 * mc.vocab_size * mc.hidden_size,
            attention_per_context=4 * mc.num_layers * mc.num_heads * mc.head_dim,
        )

    def decode_step(self, num_seqs: int, context_sum: int) -> int:
        """One decode token per sequence; together they attend to `context_sum` tokens (each its own included)."""
        return num_seqs * (self.linear_per_token + self.lm_head_per_row) + self.attention_per_context * context_sum

    def request(self, prompt_len: int, output_len: int, num_cached: int = 0) -> int:
        """The work one request needs: its uncached prompt and every output token but the last are
        forwarded (the last is sampled, never fed back); every output token costs one LM-head row."""
        first, last = num_cached, prompt_len + output_len - 1  # positions that go through the model
        tokens = last - first
        # Position i attends to i + 1 tokens: the sum of (i + 1) for i in [first, last).
        attended = (last * (last + 1) - first * (first + 1)) // 2
        return (tokens * self.linear_per_token + output_len * self.lm_head_per_row
                + attended * self.attention_per_context)


@dataclass(frozen=True)
class DecodeStepTimes:
    """A decode step's four lower bounds, in seconds: its GEMMs (LM head included) and its attention at the
    compute peak, and its weights and KV at the read rate."""

    gemm: float
    attention: float
    weights: float
    kv: float

    @classmethod
    def of(cls, flops: FlopModel, num_seqs: int, context_sum: int, weight_bytes: int, kv_token_bytes: int,
           peak_flops: float, read_bytes_s: float) -> DecodeStepTimes:
        return cls(num_seqs * (flops.linear_per_token + flops.lm_head_per_row) / peak_flops,
                   flops.attention_per_context * context_sum / peak_flops,
                   weight_bytes / read_bytes_s, context_sum * kv_token_bytes / read_bytes_s)

    @property
    def compute(self) -> float:
        return self.gemm + self.attention

    @property
    def memory(self) -> float:
        return self.weights + self.kv

    @property
    def in_turns(self) -> float:
        """GEMMs (at the peak, or reading the weights, if slower), then attention (at the peak, or reading its
        KV, if slower), as the engine's layers run them: no overlap between the two."""
        return max(self.gemm, self.weights) + max(self.attention, self.kv)


def kv_bytes_per_token(mc: ModelConfig, element_size: int = 4) -> int:
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * element_size
