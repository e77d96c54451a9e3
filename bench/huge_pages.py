"""The engine with its KV cache and decode-streamed weights in transparent huge pages, and without.

    .venv/bin/python -m bench.huge_pages
    .venv/bin/python -m bench.huge_pages --batches 1 48 --rounds 5 --workload-rounds 0
    .venv/bin/python -m bench.huge_pages --kv-only --batches 32 48 64 --rounds 5 --workload-rounds 0

`memory.huge_pages: true` (engine/hugepages.py) keeps the KV cache and the weights a decode step streams
(each linear's packed copy, else its fp32 weight) in one madvised region of 2 MiB pages instead of torch's
4 KiB ones; "auto", the default since 2026-12-05, does so for the weights alone, within a time budget
(bench.single_stream measures that). Here the arms are false and true. Three parts, each alternating its arms round after round in one
process (and the time each engine took to start, which huge pages lengthen where the kernel must
compact memory to find them):

1. A plain read: the sum of 1 GiB of fp32 in 4 KiB pages and in huge pages (GB/s, best of 5).
2. Decode steps of SmolLM2-135M at several batch sizes, for three weight settings (fp32 panels,
   `cpu_prepack_weights: true, cpu_compact_weights: false`, the headline engine of bench.throughput;
   the defaults, compact panels; no packed copies), each with huge_pages false and true: the
   engine's own time of each decode-only step at the full batch (prefill excluded), the median per
   round, then over rounds (bench.kv_decode's method). Huge pages move no arithmetic, so every
   greedy token must be equal; the last column counts the sequences that are.
3. bench.throughput's workload on the fp32-panel engine with and without huge pages.

Writes bench/results/huge_pages.json and its section of docs/perf/memory.md. `--kv-only` asks what the KV
cache alone gains: the arms are `huge_pages` auto (the default: the decode-streamed weights in huge pages,
the KV cache in 4 KiB pages) and true (the KV cache too), on the fp32-panel engine only; it writes
bench/results/huge_pages_kv.json and a section of its own.
"""

from __future__ import annotations

import gc
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.kv_decode import measure_batches, parse_args, passages, whole_workload, workload_table
from bench.report import PERF, markdown_table, print_table, publish_table, run_info, write_json
from bench.throughput import progress_bar
from engine import LLM, hugepages
from engine.kernels.cpu_build import cpu_kernels

SETTINGS = {"fp32 panels": {"cpu_prepack_weights": True, "cpu_compact_weights": False},
            "compact panels (defaults)": {},
            "no packed copies": {"cpu_prepack_weights": False}}
EQUAL_KEY = "requests_equal"


def read_rates(rounds: int) -> dict[str, float]:
    """Best GB/s of a sum over 1 GiB of fp32 in 4 KiB pages and in huge pages, the two alternating."""
    small = torch.ones(1 << 28)
    (huge,) = hugepages.zeros([((1 << 28,), torch.float32)])
    huge.fill_(1.0)
    best = {"4 KiB pages": float("inf"), "huge pages": float("inf")}
    for _ in range(rounds):
        for name, t in (("4 KiB pages", small), ("huge pages", huge)):
            t0 = time.perf_counter()
            t.sum()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (1 << 30) / s / 1e9 for name, s in best.items()}


def main() -> None:
    args = parse_args(__doc__, [1, 8, 16, 32, 48], "page sizes", extra=lambda ap: ap.add_argument(
        "--kv-only", action="store_true", help="arms huge_pages auto and true (the KV cache alone), fp32 panels only"))
    if not hugepages.available():
        raise SystemExit("this host gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled "
                         "is `never`, or this is not Linux): nothing to compare")
    # (label, huge_pages) of the arm without huge pages for what is compared, then of the arm with them.
    page_arms = ((("KV in 4 KiB pages", "auto"), ("KV in huge pages", True)) if args.kv_only
                 else (("4 KiB pages", False), ("huge pages", True)))
    (small_label, _), (huge_label, _) = page_arms
    settings = {"fp32 panels": SETTINGS["fp32 panels"]} if args.kv_only else SETTINGS
    biggest = max(args.batches)
    block_size = 16
    blocks = biggest * -(-(args.context + args.steps) // block_size) * 2 + 64
    cpu_kernels()  # built or loaded from disk before the engines are timed
    data = {**run_info("bench.huge_pages", args.threads), "context": args.context, "steps": args.steps,
            "rounds": args.rounds, "kv_only": args.kv_only, "settings": {}, "start_s": {}}
    with progress_bar("plain reads", 1) as advance:
        data["read_gbps"] = read_rates(5)
        advance()
    for setting, options in settings.items():
        llms, start_s = {}, {}
        for label, huge in page_arms:
            t0 = time.perf_counter()
            llms[f"{setting}, {label}"] = LLM(model="smollm2", dtype="float32", block_size=block_size,
                                              num_kv_blocks=blocks, max_num_seqs=biggest,
                                              max_model_len=args.context + args.steps + 16,
                                              max_num_batched_tokens=4096, huge_pages=huge, **options)
            start_s[label] = time.perf_counter() - t0
        data["start_s"][setting] = start_s
        prompts = passages(next(iter(llms.values())), biggest, args.context)
        data["settings"][setting] = measure_batches(llms, prompts, args, setting, "sequences_equal")
        del llms
        gc.collect()
    arms = {f"fp32 panels, {label}": {**SETTINGS["fp32 panels"], "huge_pages": huge} for label, huge in page_arms}
    if args.workload_rounds:
        data["workload"] = whole_workload(args.workload_rounds, arms, EQUAL_KEY)
    write_json("huge_pages_kv.json" if args.kv_only else "huge_pages.json", data)

    reads = data["read_gbps"]
    read_rows = [(name, f"{gbps:.1f}", f"{gbps / reads['4 KiB pages']:.2f}×") for name, gbps in reads.items()]
    read_headers = ["pages", "read GB/s", "÷ 4 KiB pages"]
    print_table("A plain read of 1 GiB", read_headers, read_rows)
    start_rows = [(setting, f"{v[small_label]:.1f}", f"{v[huge_label]:.1f}") for setting, v in data["start_s"].items()]
    start_headers = ["weights", f"{small_label}: engine start s", f"{huge_label}: engine start s"]
    print_table("Engine start (model load, packing, KV pool)", start_headers, start_rows)
    headers = ["weights", "batch", f"{small_label} ms/step", f"{huge_label} ms/step", "huge ÷ 4 KiB speed",
               "greedy tokens equal"]
    rows = []
    for setting, batches in data["settings"].items():
        for batch, r in batches.items():
            m = r["median_step_s"]
            small, huge = m[f"{setting}, {small_label}"], m[f"{setting}, {huge_label}"]
            rows.append((setting, batch, f"{small * 1e3:.1f}", f"{huge * 1e3:.1f}", f"{small / huge:.2f}×",
                         f"{r['sequences_equal']}/{batch}"))
    if args.kv_only:
        section, title = "huge_pages_kv", "The KV cache alone in huge pages (SmolLM2-135M, fp32 panels, CPU)"
        arms_text = ("`huge_pages` auto (the default: the weights a decode step streams in huge pages, the KV "
                     "cache in 4 KiB pages) and true (the KV cache in huge pages as well)")
    else:
        section, title = "huge_pages", "The KV cache and decode-streamed weights in huge pages (SmolLM2-135M, fp32, CPU)"
        arms_text = ("`huge_pages` false and true (the KV cache and the weights a decode step streams, each "
                     "linear's packed copy or else its fp32 weight, in one madvised region of 2 MiB pages)")
    publish_table(
        section, title, data,
        f"prompts of {args.context} tokens, {args.steps} greedy output tokens, fp32 KV cache; "
        f"{'on the fp32-panel engine' if args.kv_only else 'for each weight setting'}, two engines in one process, "
        f"{arms_text}, "
        f"alternating {args.rounds} rounds; the median of each round's decode-only steps at the full batch "
        f"(prefill excluded), then the median over rounds. Page sizes move no arithmetic, so the greedy tokens "
        f"must be equal. Before them, a plain read of 1 GiB (the sum, best of 5): "
        f"{reads['4 KiB pages']:.1f} GB/s in 4 KiB pages, {reads['huge pages']:.1f} GB/s in huge pages.",
        f"ms per decode step, context {args.context}", headers, rows,
        extra="\n\n".join(filter(None, [markdown_table("A plain read of 1 GiB", read_headers, read_rows),
                                        markdown_table("Engine start (model load, packing, KV pool: "
                                                       f"{blocks} blocks of {block_size} rows)", start_headers,
                                                       start_rows),
                                        workload_table(data.get("workload"), tuple(arms), "engine",
                                                       "greedy tokens equal", EQUAL_KEY)])), docs=PERF / "memory.md")


if __name__ == "__main__":
    main()
