"""Decode steps with one group of rows per thread against every kernel sharing all rows over the threads.

    .venv/bin/python -m bench.kernels.decode_split
    .venv/bin/python -m bench.kernels.decode_split --batches 16 48 --rounds 8

The one-call decoder (engine/models/csrc/decode_layers.cpp) runs a decode-only step in one of two ways. Joint:
each kernel of each layer shares the step's rows out over the threads, which meet at the end of every kernel.
Split (here from 8 rows a thread; the engine picks the rows per machine, engine/models/decode_split.py): the
rows are cut into one contiguous group per thread of about equal work, and each thread runs its group through
every layer, the threads meeting once at the end. Both compute every row the same way, so every token and
logprob is the same; this measures which is faster.

One engine (SmolLM2-135M-Instruct, fp32, bench.throughput's headline options: packed fp32 panels, the default huge
pages), `--batches` requests of 400 prompt tokens cut from bench.throughput's text, greedy, running together, with
about `--tokens` (16) decode steps a round in which every request decodes. The two ways alternate round after round
in one process (the one-call decoder's `split_rows`); a round's figure is the median of its full-batch decode steps (the
engine's own step time, LM head and sampling included), and the verdict is the median of the rounds' ratios, each
against the other way's round next to it. A read probe after each pair of rounds gives the memory rate of that
moment: the AMD dev VM's read rate moved between about 35 and 70 GB/s within seconds (the Intel one's stays near
30). The two ways' greedy tokens must be equal. Writes bench/results/kernels/decode_split.json and its section of docs/perf/kernels.md.

`--compact` runs the engine with exact compact panels instead (cpu_compact_weights, what the defaults pack for
SmolLM2: the kernel rebuilds each panel's fp32 values from 4-bit and 8-bit codes, so split, every thread rebuilds
every panel for its own rows); it writes decode_split_compact.json and its own section.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench import roofline
from bench.report import PERF, publish_table, run_info, write_json
from bench.throughput import TEXT, greedy, progress_bar
from engine import LLM
from engine.kernels.cpu_build import cpu_kernels
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig

PROMPT_TOKENS = 400
MAX_BATCHED_TOKENS = 2048
NEVER = 1 << 30  # rows per thread from which to split: never, so every step runs joint
ARMS = {"joint": NEVER, "split": 8}


def run_round(llm: LLM, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """The median seconds of the round's decode-only steps with every request running, and the tokens. The
    prompts are prefilled MAX_BATCHED_TOKENS a step, while the first requests already decode, so each request
    gets as many more tokens as there are such steps: about `tokens` full-batch decode steps a round."""
    engine = llm.engine
    prefill_steps = -(-len(prompts) * PROMPT_TOKENS // MAX_BATCHED_TOKENS)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, greedy(tokens + prefill_steps))
    steps, out = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        stats = engine.last_stats
        if not stats.step_prefill_tokens and stats.step_decode_seqs == len(prompts):
            steps.append(stats.step_time_s)
    if not steps:
        raise SystemExit(f"round {tag}: no decode step ran the whole batch (too little KV cache?)")
    return statistics.median(steps), [out[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 48, 64], help="requests running together")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per way and batch, alternating (default 6)")
    ap.add_argument("--tokens", type=int, default=16, help="full-batch decode steps per round (default 16)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--compact", action="store_true",
                    help="exact compact panels (the defaults for SmolLM2) instead of fp32 panels")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 2 or any(not 1 <= b <= 256 for b in args.batches):
        ap.error("--rounds must be at least 1, --tokens at least 2, --batches between 1 and 256")
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here: there is no one-call decoder to time")
    torch.set_num_threads(args.threads)
    if args.threads < 2:
        raise SystemExit("with one thread there is nothing to split")
    top = max(args.batches)
    path = resolve_model("smollm2")
    llm = LLM(model=str(path), dtype="float32", num_threads=args.threads, max_num_seqs=top,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, cpu_prepack_weights=True, cpu_compact_weights=args.compact,
              kv_cache_memory_bytes=top * (PROMPT_TOKENS + args.tokens + top * PROMPT_TOKENS // MAX_BATCHED_TOKENS + 48) *
              roofline.kv_bytes_per_token(ModelConfig.from_folder(path)))
    if llm.engine.model.fused_decoder is None:
        raise SystemExit("this model does not take the one-call decoder here; nothing to compare")
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    probe = roofline.ReadProbe()
    data = {**run_info("bench.kernels.decode_split", args.threads), "model": "smollm2", "tokens": args.tokens,
            "prompt_tokens": PROMPT_TOKENS,
            "weights": "compact panels" if args.compact else "fp32 panels", "batches": []}
    decoder = llm.engine.model.fused_decoder
    before = decoder.split_rows
    choice = llm.engine.decode_split  # what the engine measured at start and would use
    if choice is not None:
        data["engine_choice"] = {"rows_per_thread": choice.rows, "gemm_gflops": choice.gemm_gflops,
                                 "stream_gbps": choice.stream_gbps, "bytes_per_weight": choice.bytes_per_weight}
    try:
        with progress_bar("decode steps, joint and split", len(args.batches) * args.rounds * 2) as advance:
            for batch in args.batches:
                starts = random.Random(batch).sample(range(len(ids) - PROMPT_TOKENS), batch)
                prompts = [ids[s:s + PROMPT_TOKENS] for s in starts]
                rounds, tokens = [], {}
                for r in range(args.rounds):
                    seconds = {}
                    for arm in (ARMS if r % 2 == 0 else reversed(ARMS)):
                        decoder.split_rows = ARMS[arm]
                        seconds[arm], tokens[arm] = run_round(llm, prompts, args.tokens, f"b{batch}-r{r}-{arm}")
                        advance()
                    if tokens["joint"] != tokens["split"]:
                        raise SystemExit(f"batch {batch}: the two ways' greedy tokens differ")
                    rounds.append({**seconds, "read_gbps": probe()})
                data["batches"].append({"batch": batch, "rounds": rounds})
    finally:
        decoder.split_rows = before
    name = "decode_split_compact" if args.compact else "decode_split"
    write_json(f"kernels/{name}.json", data)

    headers = ["batch", "joint step ms", "split step ms", "split ÷ joint speed", "per round", "read GB/s",
               "the engine's choice"]
    rows = []
    for b in data["batches"]:
        rs = b["rounds"]
        ratios = [r["joint"] / r["split"] for r in rs]
        picks = ("—" if choice is None
                 else "split" if b["batch"] >= choice.rows * args.threads else "joint")
        rows.append((b["batch"], f"{statistics.median(r['joint'] for r in rs) * 1e3:.1f}",
                     f"{statistics.median(r['split'] for r in rs) * 1e3:.1f}", f"{statistics.median(ratios):.3f}×",
                     " ".join(f"{x:.2f}" for x in ratios), " ".join(f"{r['read_gbps']:.0f}" for r in rs), picks))
    publish_table(
        name, "Decode steps, a group of rows per thread against all rows shared by every kernel "
        f"(SmolLM2-135M, {data['weights']}, CPU)", data,
        f"one engine, each batch's requests ({PROMPT_TOKENS} prompt tokens each, greedy) running together, "
        f"about {args.tokens} full-batch decode steps a round; the one-call decoder's `split_rows` switches decode_layers "
        "between joint (every kernel shares all rows over the threads) and split (one contiguous group of rows "
        f"per thread, each run through every layer by its thread), alternating {args.rounds} rounds; a round's "
        "figure is the median of its full-batch decode steps (LM head and sampling included); the speed-up is "
        "the median of the rounds' ratios, each "
        "against the other way's round beside it. Greedy tokens equal in every round. The engine's choice: "
        + ("none measured (cpu_decode_split_rows fixed or one thread)" if choice is None else
           f"split from {choice.rows} rows a thread, measured at this engine's start (fp32 GEMM "
           f"{choice.gemm_gflops:.0f} GFLOP/s, the packed weights read at {choice.stream_gbps:.1f} GB/s with every "
           f"thread reading all of them, {choice.bytes_per_weight:.3f} bytes a weight; engine/models/decode_split.py)."),
        "Full-batch decode steps, medians of alternating rounds", headers, rows, docs=PERF / "kernels.md")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s")
