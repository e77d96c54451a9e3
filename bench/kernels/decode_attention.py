"""Decode attention on the CPU: this tree's kernel against the same kernel at an earlier commit.

    .venv/bin/python -m bench.kernels.decode_attention
    .venv/bin/python -m bench.kernels.decode_attention --base 71f4fbc --batches 16 48 --draws 3 --rounds 9

One decode step's attention over all 30 layers of SmolLM2-135M (9 query heads sharing 3 KV heads
of 64), each layer with its own paged fp32 cache in scattered 16-row blocks, so that as in the
engine the KV streams from memory rather than from cache. Context lengths are drawn uniformly from
40-760 rows, the range of the throughput workload's decode steps (prompts of 32-512 tokens plus up
to 256 generated), `--draws` independent draws per batch size. The base kernel is built from
`git show BASE:engine/attention/csrc/paged_attention_cpu.cpp`; the default base is the commit
before decode attention shared its sequences out longest first (it split the batch into equal
halves, one per thread). The two alternate, step after step, their outputs must be bitwise equal,
and the medians are compared. "Static split imbalance" is the larger half's share of the KV over
half of it: how much more one thread had to read under the base's split. Writes
bench/results/kernels/decode_attention.json and its section of docs/perf/kernels.md.

`--cache int8` times the int8 KV cache's kernel (cache_bits: 8; paged_attention_int8_cpu.cpp with the
fp32 file it builds on) on the same caches quantized per row as the engine stores them (int8 codes,
one fp16 scale per token and KV head): there the two kernels' outputs must agree within 1e-5 rather
than bitwise, because the int8 kernel's rounding may change. Writes decode_attention_int8.json and
its own section.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench import roofline
from bench.kernels.git_kernel import build_at_revision
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine.attention.kv_int8 import quantize_rows
from engine.kernels.cpu_build import load_kernels

KERNEL = "engine/attention/csrc/paged_attention_cpu.cpp"
INT8_KERNEL = "engine/attention/csrc/paged_attention_int8_cpu.cpp"
DEFAULT_BASE = "71f4fbc"  # the last commit with the equal-halves split
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CONTEXT = (40, 760)


def build_base(rev: str, cache: str = "fp32"):
    """The decode kernel (for `cache`) as it was at `rev`, as its own extension module."""
    if cache == "int8":
        return build_at_revision(rev, [KERNEL, INT8_KERNEL], ["paged_decode_attention_int8"])
    return build_at_revision(rev, [KERNEL], ["paged_decode_attention"])


def draw_step(batch: int, g: torch.Generator):
    """Context lengths, one block table per sequence (scattered blocks) and one fp32 cache per layer."""
    lens = torch.randint(CONTEXT[0], CONTEXT[1] + 1, (batch,), generator=g)
    blocks = (lens + BLOCK - 1) // BLOCK
    total = int(blocks.sum())
    order = torch.randperm(total, generator=g)
    tables = torch.zeros(batch, int(blocks.max()), dtype=torch.int64)
    start = 0
    for b, n in enumerate(blocks.tolist()):
        tables[b, :n] = order[start:start + n]
        start += n
    caches = [torch.randn(2, total, BLOCK, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    return lens, tables, caches, q


def quantize_cache(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 cache as the int8 cache stores it: codes and one fp16 scale per row and KV head."""
    codes, scales = quantize_rows(kv)
    return codes.contiguous(), scales.contiguous()


def attend(kernel, q, kv, tables, lens):
    """One layer's decode attention; `kv` is an fp32 cache or an int8 (codes, scales) pair."""
    scale = HEAD_DIM ** -0.5
    if isinstance(kv, tuple):
        return kernel.paged_decode_attention_int8(q, kv[0], kv[1], tables, lens, scale, None, None, None)
    return kernel.paged_decode_attention(q, kv, tables, lens, scale)


def step_seconds(kernel, q, caches, tables, lens) -> float:
    t0 = time.perf_counter()
    for kv in caches:
        attend(kernel, q, kv, tables, lens)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=DEFAULT_BASE, help="git revision whose kernel is the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 48, 64], help="decode batch sizes")
    ap.add_argument("--draws", type=int, default=3, help="independent context-length draws per batch size")
    ap.add_argument("--rounds", type=int, default=9, help="alternations of the two kernels (medians compared)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cache", choices=["fp32", "int8"], default="fp32",
                    help="KV cache format: fp32, or int8 codes with fp16 row scales (cache_bits: 8)")
    args = ap.parse_args()
    if args.rounds < 1 or args.draws < 1 or any(b < 1 or b > 256 for b in args.batches):
        raise SystemExit("--rounds and --draws must be >= 1, --batches between 1 and 256")
    torch.set_num_threads(args.threads)
    int8 = args.cache == "int8"
    kernels = {"base": build_base(args.base, args.cache), "this tree": load_kernels()}
    data = {**run_info("bench.kernels.decode_attention", args.threads), "base": args.base, "cache": args.cache,
            "shape": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK, "context": list(CONTEXT)}, "steps": []}
    g = torch.Generator().manual_seed(0)
    with progress_bar("decode attention", len(args.batches) * args.draws * args.rounds) as advance:
        for batch in args.batches:
            for draw in range(args.draws):
                lens, tables, caches, q = draw_step(batch, g)
                if int8:
                    caches = [quantize_cache(kv) for kv in caches]
                outs = {name: attend(k, q, caches[0], tables, lens) for name, k in kernels.items()}
                same = (torch.allclose(outs["this tree"], outs["base"], rtol=1e-5, atol=1e-5) if int8
                        else torch.equal(outs["base"], outs["this tree"]))
                if not same:
                    raise RuntimeError(f"batch {batch}, draw {draw}: the two kernels' outputs differ")
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for _ in range(args.rounds):
                    for name, k in kernels.items():
                        times[name].append(step_seconds(k, q, caches, tables, lens))
                    advance()
                half = (batch + 1) // 2
                first, rest = int(lens[:half].sum()), int(lens[half:].sum())
                data["steps"].append({
                    "batch": batch, "draw": draw, "context_rows": int(lens.sum()),
                    # Per row and layer: K and V of every KV head, fp32 values or int8 codes plus fp16 scales.
                    "kv_bytes": int(lens.sum()) * LAYERS * 2 * KV_HEADS * (HEAD_DIM + 2 if int8 else HEAD_DIM * 4),
                    "static_split_imbalance": 2 * max(first, rest) / (first + rest),
                    "median_s": {name: statistics.median(t) for name, t in times.items()}, "round_s": times})
                del caches
    # The read rate the KV stream is measured against, after the kernels, in the same process.
    _, read_gbps = roofline.measure_bandwidth(1 << 28, 5)
    data["read_gbps"] = read_gbps
    key = "decode_attention_int8" if int8 else "decode_attention"
    write_json(f"kernels/{key}.json", data)
    # The split's imbalance says how much the default base's equal halves cost; against another base it is noise.
    split = args.base == DEFAULT_BASE
    headers = ["batch", "context rows", *(["static split imbalance"] if split else []), "base ms", "this tree ms",
               "this tree ÷ base speed", "this tree KV GB/s", "÷ memory read rate"]
    rows = []
    for s in data["steps"]:
        m = s["median_s"]
        gbps = s["kv_bytes"] / m["this tree"] / 1e9
        rows.append((s["batch"], s["context_rows"],
                     *([f"{100 * (s['static_split_imbalance'] - 1):.0f}%"] if split else []),
                     f"{m['base'] * 1e3:.1f}", f"{m['this tree'] * 1e3:.1f}", f"{m['base'] / m['this tree']:.2f}×",
                     f"{gbps:.1f}", f"{100 * gbps / read_gbps:.0f}%"))
    what = ("int8 cache (int8 codes, one fp16 scale per token and KV head, quantized from fp32 values)" if int8
            else "fp32 cache")
    agree = "outputs within 1e-5 of each other" if int8 else "outputs bitwise equal"
    publish_table(
        key, f"Decode attention, one step over all layers (SmolLM2-135M's heads, {args.cache} KV, CPU)", data,
        f"{LAYERS} layers, each with its own paged {what} ({HEADS} query heads over {KV_HEADS} KV heads of "
        f"{HEAD_DIM}, {BLOCK}-row blocks in scattered order), contexts drawn uniformly from {CONTEXT[0]}-{CONTEXT[1]} "
        f"rows; the kernel at {args.base}"
        + (" (the batch split into equal halves, one per thread)" if split else "")
        + " against this tree's"
        + (" (sequences taken longest first from a shared counter)" if split else "")
        + f", alternating {args.rounds} rounds, medians compared, {agree}. Memory read rate measured after the "
        f"runs: {read_gbps:.1f} GB/s.",
        "one decode step's attention, all layers", headers, rows, docs=PERF / "kernels.md")


if __name__ == "__main__":
    main()
