"""Decode steps with exact compact weight panels against fp32 panels (cpu_compact_weights), SmolLM2-135M,
and against no packed copies (the engine's defaults until 2026-12-05; the defaults now pack compact panels).

    .venv/bin/python -m bench.compact_weights
    .venv/bin/python -m bench.compact_weights --batches 1 48 --rounds 5 --workload-rounds 0

SmolLM2-135M-Instruct comes as a GGUF file whose linears are Q4_1 and whose embedding (the tied LM
head) is Q8_0, so its fp32 weights are exactly codes times fp16 scales. With `cpu_compact_weights`
the packed copies hold those codes (engine/models/compact_weights.py) and the panel kernel rebuilds
the fp32 values bit for bit, so both engines compute the same numbers: the last column counts the
greedy sequences that are equal token for token, and should be all of them. A third engine keeps no
packed copies (`cpu_prepack_weights: false`: skinny, oneDNN and MKL products on the fp32 weights, layer
by layer), whose different summation order may move near-ties. The three run in one process with an fp32
KV cache; they alternate round after round, and each round's decode-only steps at the full batch are
timed by the engine itself (prefill excluded, as in bench.kv_decode). Medians of the rounds are compared.

Then the whole workload of bench.throughput on each, alternating `--workload-rounds` times. Writes
bench/results/compact_weights.json and its section of docs/perf/memory.md.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.kv_decode import (
    measure_batches,
    parse_args,
    passages,
    whole_workload,
    workload_table,
)
from bench.report import PERF, markdown_table, print_table, publish_table, run_info, write_json
from engine import LLM, SamplingParams
from engine.kernels.cpu_build import cpu_kernels

# name -> engine options; the first two must compute the same numbers (greedy tokens compared).
ARMS = {"fp32 panels": {"cpu_prepack_weights": True, "cpu_compact_weights": False},
        "compact panels": {},  # the defaults: cpu_prepack_weights auto, cpu_compact_weights true
        "no packed copies": {"cpu_prepack_weights": False}}
EQUAL_KEY = "requests_equal"


def main() -> None:
    args = parse_args(__doc__, [1, 8, 16, 32, 48, 64], "engines")
    biggest = max(args.batches)
    block_size = 16
    blocks = biggest * -(-(args.context + args.steps) // block_size) * 2 + 64
    cpu_kernels()  # built or loaded from disk before the engines are timed
    llms = {name: LLM(model="smollm2", dtype="float32", block_size=block_size, num_kv_blocks=blocks,
                      max_num_seqs=biggest, max_model_len=args.context + args.steps + 16, max_num_batched_tokens=4096,
                      **options)
            for name, options in ARMS.items()}
    packed = {name: llm.engine.prepacked_bytes for name, llm in llms.items()}
    load_s = {name: llm.engine.prepack_s for name, llm in llms.items()}
    prompts = passages(llms["fp32 panels"], biggest, args.context)
    data = {**run_info("bench.compact_weights", args.threads), "context": args.context, "steps": args.steps,
            "rounds": args.rounds, "packed_bytes": packed, "prepack_s": load_s, "batches": {}}
    data["batches"] = measure_batches(llms, prompts, args, "compact weights", "sequences_equal")
    del llms
    gc.collect()
    data["memory"] = {name: measure_memory(options) for name, options in MEMORY_ARMS.items()}
    if args.workload_rounds:
        data["workload"] = whole_workload(args.workload_rounds, ARMS, EQUAL_KEY)
    write_json("compact_weights.json", data)
    headers = ["batch", "fp32 panels ms/step", "compact ms/step", "no copies ms/step", "compact tok/s",
               "compact ÷ fp32 panels speed", "compact ÷ no copies speed", "greedy tokens equal, compact and fp32"]
    rows = []
    for batch, r in data["batches"].items():
        m = r["median_step_s"]
        rows.append((batch, f"{m['fp32 panels'] * 1e3:.1f}", f"{m['compact panels'] * 1e3:.1f}",
                     f"{m['no packed copies'] * 1e3:.1f}", f"{batch / m['compact panels']:.0f}",
                     f"{m['fp32 panels'] / m['compact panels']:.2f}×",
                     f"{m['no packed copies'] / m['compact panels']:.2f}×", f"{r['sequences_equal']}/{batch}"))
    mib = {name: f"{b / 2**20:.0f} MiB" for name, b in packed.items()}
    publish_table(
        "compact_weights", "Decode steps with exact compact weight panels (SmolLM2-135M, fp32 arithmetic, CPU)", data,
        f"prompts of {args.context} tokens, {args.steps} greedy output tokens, fp32 KV cache, three engines in one "
        "process (fp32 panels and compact panels, whose decode-only steps go through decode_layers, and no packed "
        f"copies), alternating {args.rounds} rounds; the median of each round's "
        "decode-only steps at the full batch, then the median over rounds. Packed weight copies: "
        f"{mib['fp32 panels']} as fp32 panels, {mib['compact panels']} as compact panels (Q4_1 linears in 4-bit "
        "codes with fp16 scales and offsets, the Q8_0 embedding / LM head in 8-bit codes), packed at engine start "
        f"in {load_s['fp32 panels']:.1f} s against {load_s['compact panels']:.1f} s (the search for codes and the "
        "bit-for-bit check included). The panels rebuild the same fp32 values, so the greedy tokens must be equal.",
        f"ms per decode step, context {args.context}", headers, rows,
        extra="\n\n".join(filter(None, [memory_table(data["memory"]), workload_table(
            data.get("workload"), tuple(ARMS), "weights", "greedy tokens equal", EQUAL_KEY)])), docs=PERF / "memory.md")


# Engine settings whose memory is measured, each in a fresh process.
MEMORY_ARMS = {
    "fp32 weights, no packed copies (cpu_prepack_weights false, the defaults until 2026-12-05)":
        {"cpu_prepack_weights": False},
    "fp32 panels (cpu_prepack_weights true, cpu_compact_weights false)": {"cpu_prepack_weights": True,
                                                                         "cpu_compact_weights": False},
    "compact panels (the defaults: cpu_prepack_weights auto, cpu_compact_weights true)": {},
    "compact panels, fp32 copies freed (+ cpu_free_plain_weights)": {"cpu_free_plain_weights": True},
}


def _rss_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Rss line in /proc/self/smaps_rollup")


def _memory_child(options: dict, results) -> None:
    cpu_kernels()  # the libraries and the kernels are in the baseline, not in what the engine adds
    gc.collect()
    base = _rss_bytes()
    llm = LLM(model="smollm2", dtype="float32", kv_cache_memory_bytes=16 * 2**20, **options)
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    gc.collect()
    results.put({"weight_bytes": llm.engine.weight_bytes, "prepacked_bytes": llm.engine.prepacked_bytes,
                 "rss_growth_bytes": _rss_bytes() - base})


def measure_memory(options: dict) -> dict:
    """In a fresh process: the weight bytes the engine holds (engine.weight_bytes) and how much the
    process's resident memory grew from before the engine was built to after a first request (16 MiB of KV)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_memory_child, args=(options, results))
    child.start()
    out = results.get(timeout=600)
    child.join()
    return out


def memory_table(memory: dict) -> str:
    headers = ["engine settings", "weights held, plain + packed", "process memory added (RSS)"]
    rows = [(name, f"{(m['weight_bytes'] + m['prepacked_bytes']) / 2**20:.0f} MiB",
             f"{m['rss_growth_bytes'] / 2**20:.0f} MiB") for name, m in memory.items()]
    title = ("Memory, each setting in a fresh process: RSS from before the engine is built to after its first "
             "request, with a 16 MiB KV cache")
    print_table(title, headers, rows)
    return markdown_table(title, headers, rows)


if __name__ == "__main__":
    main()
