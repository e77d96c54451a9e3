"""Causal prefill attention on the CPU: the C++ kernel against the torch path it replaced, SmolLM2-135M's shape.

    .venv/bin/python -m bench.kernels.prefill_attention
    .venv/bin/python -m bench.kernels.prefill_attention --chunks 512:0 256:768 --rounds 9
    .venv/bin/python -m bench.kernels.prefill_attention --base 1cb5633   # also the kernel as it was at that commit

One layer's attention for one chunk of one sequence, with the model's heads (9 query heads sharing
3 KV heads of 64): the chunk's K/V are already in a paged fp32 cache with scattered blocks, as in
the engine. "torch" is the CPU backend's path before the kernel (TorchAttentionBackend: SDPA with
is_causal on the chunk's own K/V when nothing is cached before it, else K/V gathered from the cache
and an explicit mask); "kernel" is CpuPagedAttentionBackend's, which reads the cache in place. The
two alternate, call after call, and the medians are compared; their outputs must agree to 1e-4.
GFLOP/s count 4 x heads x head_dim per visible (query, key) pair, causal half included. With
`--base REV`, a third arm: the kernel built from its source at git revision REV, called directly, whose
outputs must equal this tree's bitwise (a timing of different arithmetic would mean nothing). Writes
bench/results/kernels/prefill_attention.json and its section of docs/perf/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine.attention.cpu_paged import CpuPagedAttentionBackend
from engine.attention.metadata import PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig


def parse_chunk(text: str) -> tuple[int, int]:
    try:
        tokens, cached = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKENS:CACHED, e.g. 512:0") from None
    if tokens < 1 or cached < 0 or tokens + cached > 32768:
        raise argparse.ArgumentTypeError(f"{text!r}: need TOKENS >= 1, CACHED >= 0, TOKENS + CACHED <= 32768")
    return tokens, cached


KERNEL_SOURCES = ["engine/attention/csrc/paged_attention_cpu.cpp", "engine/attention/csrc/prefill_attention_cpu.cpp"]


class BaseKernel:
    """The prefill kernel at an earlier revision, behind the backend's `_prefill` signature."""

    def __init__(self, rev: str, scale: float) -> None:
        from bench.kernels.git_kernel import build_at_revision

        self.ops, self.scale = build_at_revision(rev, KERNEL_SOURCES, ["paged_prefill_attention"]), scale

    def _prefill(self, q, k, v, kv_cache, span: PrefillSpan) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        self.ops.paged_prefill_attention(out, q, kv_cache, span.block_table, span.num_cached, self.scale)
        return out


def timed(path, args: tuple, reps: int) -> float:
    """Seconds per call of path._prefill(*args), averaged over `reps` calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        path._prefill(*args)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=parse_chunk, nargs="+",
                    default=[(128, 0), (256, 0), (512, 0), (1024, 0), (256, 256), (256, 768)],
                    help="TOKENS:CACHED pairs: a chunk of TOKENS queries after CACHED rows already in the cache")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the two paths (medians compared)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--base", metavar="REV",
                    help="also time the kernel as it was at git revision REV (its outputs must equal this tree's "
                         "bitwise)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    mc = ModelConfig.from_folder(resolve_model("smollm2"))
    h, kvh, d, bs = mc.num_heads, mc.num_kv_heads, mc.head_dim, 16
    paths = {"torch": TorchAttentionBackend(h, kvh, d), "kernel": CpuPagedAttentionBackend(h, kvh, d)}
    if args.base:
        paths["base"] = BaseKernel(args.base, paths["kernel"].scale)
    data = {**run_info("bench.kernels.prefill_attention", args.threads), "base": args.base,
            "shape": {"heads": h, "kv_heads": kvh, "head_dim": d, "block_size": bs}, "chunks": []}
    g = torch.Generator().manual_seed(0)
    with progress_bar("prefill attention", len(args.chunks) * args.rounds) as advance, torch.inference_mode():
        for tokens, cached in args.chunks:
            rows = tokens + cached
            nb = -(-rows // bs)
            kv = torch.randn(2, 2 * nb + 8, bs, kvh, d, generator=g)
            table = torch.randperm(2 * nb + 8, generator=g)[:nb]
            q = torch.randn(tokens, h, d, generator=g)
            slots = table[torch.arange(cached, rows) // bs] * bs + torch.arange(cached, rows) % bs
            k = kv[0].view(-1, kvh, d)[slots]
            v = kv[1].view(-1, kvh, d)[slots]
            span = PrefillSpan(0, tokens, cached, table)
            outs = {name: p._prefill(q, k, v, kv, span) for name, p in paths.items()}
            diff = (outs["torch"] - outs["kernel"]).abs().max().item()
            if diff > 1e-4:
                raise RuntimeError(f"chunk {tokens}:{cached}: the kernel differs from torch by {diff:.2e}")
            if "base" in outs and not torch.equal(outs["base"], outs["kernel"]):
                raise RuntimeError(f"chunk {tokens}:{cached}: the kernel at --base {args.base} and this tree's differ")
            reps = max(1, int(2e8 // (tokens * rows * h * d)))  # ~0.1 s of work per timing
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, p in paths.items():
                    times[name].append(timed(p, (q, k, v, kv, span), reps))
                advance()
            pairs = tokens * cached + tokens * (tokens + 1) // 2
            med = {name: statistics.median(t) for name, t in times.items()}
            data["chunks"].append({"tokens": tokens, "cached": cached, "median_s": med, "round_s": times,
                                   "max_abs_diff": diff, "gflop": 4 * h * d * pairs / 1e9})
    write_json("kernels/prefill_attention.json", data)
    base = [f"kernel at {args.base} ms", f"kernel ÷ at {args.base} speed"] if args.base else []
    headers = ["chunk tokens", "cached rows before it", "torch ms", "kernel ms", "kernel ÷ torch speed",
               "torch GFLOP/s", "kernel GFLOP/s", "max abs difference", *base]
    rows_out = []
    for c in data["chunks"]:
        m = c["median_s"]
        rows_out.append((c["tokens"], c["cached"], f"{m['torch'] * 1e3:.3f}", f"{m['kernel'] * 1e3:.3f}",
                         f"{m['torch'] / m['kernel']:.2f}×", f"{c['gflop'] / m['torch']:.0f}",
                         f"{c['gflop'] / m['kernel']:.0f}", f"{c['max_abs_diff']:.1e}",
                         *([f"{m['base'] * 1e3:.3f}", f"{m['base'] / m['kernel']:.2f}×"] if args.base else [])))
    publish_table(
        "prefill_attention", "Causal prefill attention, one layer (SmolLM2-135M's heads, fp32, CPU)", data,
        f"{h} query heads over {kvh} KV heads of {d}, a paged fp32 cache with {bs}-row blocks in scattered "
        f"order; the torch path (SDPA, with a gather and an explicit mask after cached rows) against the C++ "
        f"kernel that reads the cache in place, alternating {args.rounds} rounds, medians compared; GFLOP/s "
        "count 4 x heads x head_dim per visible (query, key) pair"
        + (f"; a third arm, the kernel at {args.base} called directly, outputs bitwise equal to this tree's."
           if args.base else "."),
        "one chunk's attention in one layer", headers, rows_out, docs=PERF / "kernels.md")


if __name__ == "__main__":
    main()
