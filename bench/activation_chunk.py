"""Prefill steps with the MLP run in chunks of different sizes through the activation workspace.

    .venv/bin/python -m bench.activation_chunk
    .venv/bin/python -m bench.activation_chunk --rows 512 1024 2048 --rounds 12

A prefill longer than `activation_chunk_rows` runs each layer's MLP (gate_up, SwiGLU, down) in chunks of that
many tokens through one preallocated workspace, adding each chunk into the residual stream in place
(engine/models/llama.py, ActivationWorkspace). Smaller chunks hold less activation memory; larger ones give
MKL taller products. This measures what each size costs in prefill time.

One engine (SmolLM2-135M-Instruct, fp32, bench.throughput's headline options: packed fp32 panels, a token budget
of `--budget` (2048) a step). A round prefills `--prompts` (16) prompts of 32-512 tokens cut from
bench.throughput's text at seeded offsets, one output token each, so that its steps are prefills of about
`--budget` tokens, the shape of the throughput workload's first steps. The arms swap the model's workspace
(`use_workspace`) and alternate round after round, the order reversed every other round; a round's figure is the
sum of its steps' own times (the engine's step_time_s), and each arm's verdict is the median of its rounds'
speed against the first arm's round beside it. The prefix cache is reset before every round. The largest
MLP activation an arm holds is min(rows, the longest step) x (2 x intermediate + hidden) values: the workspace,
or one pass's two outputs. Writes bench/results/activation_chunk.json and its section of docs/BENCHMARKS.md.
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
from bench.report import publish_table, run_info, write_json
from bench.throughput import TEXT, greedy, progress_bar
from engine import LLM
from engine.model_registry import resolve_model
from engine.models.config import ModelConfig
from engine.models.llama import ActivationWorkspace

PROMPT_LENS = (32, 512)


def run_round(llm: LLM, prompts: list[list[int]], tag: str) -> tuple[float, int, list[int]]:
    """Seconds of the round's steps (all prefills), the longest step in tokens, and the sampled tokens."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, greedy(1))
    seconds, longest, out = 0.0, 0, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids[0]
        stats = engine.last_stats
        seconds += stats.step_time_s
        longest = max(longest, stats.step_prefill_tokens)
    return seconds, longest, [out[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048],
                    help="chunk sizes to compare, the first being the baseline (0: one pass, no workspace)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per arm, alternating (default 10)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts prefilled a round (default 16)")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = ap.parse_args()
    if len(set(args.rows)) != len(args.rows) or len(args.rows) < 2 or min(args.rows) < 0:
        ap.error("--rows takes at least two distinct sizes, each >= 0")
    if args.rounds < 1 or args.prompts < 1 or args.budget < PROMPT_LENS[1]:
        ap.error(f"--rounds and --prompts must be at least 1, --budget at least {PROMPT_LENS[1]}")
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2")
    mc = ModelConfig.from_folder(path)
    llm = LLM(model=str(path), dtype="float32", num_threads=args.threads, max_num_seqs=args.prompts,
              max_num_batched_tokens=args.budget, cpu_prepack_weights=True, cpu_compact_weights=False,
              kv_cache_memory_bytes=args.prompts * (PROMPT_LENS[1] + 32) * roofline.kv_bytes_per_token(mc))
    model = llm.engine.model
    workspaces = {r: ActivationWorkspace(r, mc.hidden_size, mc.intermediate_size, torch.float32, torch.device("cpu"))
                  if r else None for r in args.rows}
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    rng = random.Random(0)
    data = {**run_info("bench.activation_chunk", args.threads), "model": "smollm2", "budget": args.budget,
            "prompts": args.prompts, "rows": args.rows, "rounds": []}
    before = model.layers[0].mlp.workspace
    try:
        run_round(llm, [ids[:PROMPT_LENS[1]]], "warm")
        with progress_bar("prefill rounds", args.rounds * len(args.rows)) as advance:
            for r in range(args.rounds):
                lens = [rng.randint(*PROMPT_LENS) for _ in range(args.prompts)]
                prompts = [ids[s:s + n] for s, n in zip(rng.sample(range(len(ids) - PROMPT_LENS[1]), args.prompts),
                                                        lens, strict=True)]
                seconds, tokens, longest = {}, {}, 0
                for rows in (args.rows if r % 2 == 0 else reversed(args.rows)):
                    model.use_workspace(workspaces[rows])
                    seconds[rows], step_max, tokens[rows] = run_round(llm, prompts, f"r{r}-{rows}")
                    longest = max(longest, step_max)
                    advance()
                base = tokens[args.rows[0]]
                data["rounds"].append({"prompt_tokens": sum(lens), "longest_step": longest,
                                       "seconds": {str(k): v for k, v in seconds.items()},
                                       "same_tokens": {str(k): sum(a == b for a, b in zip(base, t, strict=True))
                                                       for k, t in tokens.items()}})
    finally:
        model.use_workspace(before)
    write_json("activation_chunk.json", data)

    rs = data["rounds"]
    longest = max(r["longest_step"] for r in rs)
    per_row = (2 * mc.intermediate_size + mc.hidden_size) * 4
    headers = ["activation_chunk_rows", "largest MLP activation MiB", "prefill tok/s (median round)",
               f"speed ÷ {args.rows[0]} rows", "per round", "same first tokens"]
    rows = []
    for k in args.rows:
        ratios = [r["seconds"][str(args.rows[0])] / r["seconds"][str(k)] for r in rs]
        held = min(k or longest, longest) * per_row / 2**20
        rows.append((k if k else "0 (one pass)", f"{held:.1f}",
                     f"{statistics.median(r['prompt_tokens'] / r['seconds'][str(k)] for r in rs):.0f}",
                     f"{statistics.median(ratios):.3f}×", " ".join(f"{x:.3f}" for x in ratios),
                     f"{sum(r['same_tokens'][str(k)] for r in rs)}/{args.prompts * len(rs)}"))
    publish_table(
        "activation_chunk", "Prefill steps by the MLP's chunk size (SmolLM2-135M, fp32 panels, CPU)", data,
        f"one engine, {args.prompts} prompts of {PROMPT_LENS[0]}-{PROMPT_LENS[1]} tokens a round (seeded offsets in "
        f"bench.throughput's text, one greedy token each), prefilled {args.budget} tokens a step; the arms swap the "
        f"model's activation workspace and alternate {args.rounds} rounds, the order reversed every other round; a "
        "round's figure is the sum of its steps' times; the speed-up is the median of the rounds' ratios, each "
        "against the first arm's round beside it. The largest MLP activation is min(rows, the longest step) x "
        "(2 x intermediate + hidden) fp32 values. Same first tokens: against the first arm's.",
        "Prefill rounds, medians of alternating rounds", headers, rows)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s")
