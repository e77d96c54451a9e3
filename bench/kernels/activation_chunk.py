"""Prefill steps with the MLP run in chunks of different sizes through the activation workspace.

    .venv/bin/python -m bench.kernels.activation_chunk
    .venv/bin/python -m bench.kernels.activation_chunk --rows 512 1024 2048 --rounds 12
    .venv/bin/python -m bench.kernels.activation_chunk --rows 512 2048 --rounds 6 --workload-rounds 3

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
or one pass's two outputs. `--workload-rounds N` then also runs bench.throughput's whole workload (64 requests, the
same engine and arms, alternating N rounds): its wall time and its prefill steps' time, each arm's greedy tokens
against the first arm's. Writes bench/results/kernels/activation_chunk.json and its section of docs/perf/kernels.md.
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
from bench.report import PERF, markdown_table, print_table, publish_table, run_info, write_json
from bench.throughput import TEXT, Settings, build_workload, greedy, progress_bar, run_engine
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


def run_workload(llm: LLM, arms: list[int], workspaces: dict, w, rounds: int) -> list[dict]:
    """bench.throughput's workload once per arm a round, the order reversed every other round: wall seconds,
    the prefill steps' seconds, and how many requests' greedy tokens equal the first arm's."""
    out = []
    for r in range(rounds):
        wall, prefill, tokens = {}, {}, {}
        for rows in (arms if r % 2 == 0 else reversed(arms)):
            llm.engine.model.use_workspace(workspaces[rows])
            llm.engine.block_manager.reset_prefix_cache()
            run = run_engine(llm, w, f"w{r}-{rows}")
            wall[str(rows)], tokens[rows] = run.wall_s, run.outputs
            prefill[str(rows)] = sum(step[0] for step in run.steps if step[1] > 0)
        out.append({"wall_s": wall, "prefill_steps_s": prefill,
                    "same_requests": {str(k): sum(a == b for a, b in zip(tokens[arms[0]], t, strict=True))
                                      for k, t in tokens.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048],
                    help="chunk sizes to compare, the first being the baseline (0: one pass, no workspace)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per arm, alternating (default 10)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts prefilled a round (default 16)")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    ap.add_argument("--workload-rounds", type=int, default=0,
                    help="also alternate the arms over bench.throughput's workload this many rounds (default 0)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = ap.parse_args()
    if len(set(args.rows)) != len(args.rows) or len(args.rows) < 2 or min(args.rows) < 0:
        ap.error("--rows takes at least two distinct sizes, each >= 0")
    if args.rounds < 1 or args.prompts < 1 or args.budget < PROMPT_LENS[1] or args.workload_rounds < 0:
        ap.error(f"--rounds and --prompts must be at least 1, --budget at least {PROMPT_LENS[1]}, "
                 "--workload-rounds at least 0")
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2")
    mc = ModelConfig.from_folder(path)
    ws = Settings()  # bench.throughput's workload, where --workload-rounds asks for it
    seqs, kv_tokens = args.prompts, args.prompts * (PROMPT_LENS[1] + 32)
    if args.workload_rounds:
        seqs = max(seqs, ws.num_requests)
        kv_tokens = max(kv_tokens, ws.num_requests * (ws.prompt_lens[1] + ws.output_lens[1] + 16))
    llm = LLM(model=str(path), dtype="float32", num_threads=args.threads, max_num_seqs=seqs,
              max_num_batched_tokens=args.budget, cpu_prepack_weights=True, cpu_compact_weights=False,
              kv_cache_memory_bytes=kv_tokens * roofline.kv_bytes_per_token(mc))
    model = llm.engine.model
    workspaces = {r: ActivationWorkspace(r, mc.hidden_size, mc.intermediate_size, torch.float32, torch.device("cpu"))
                  if r else None for r in args.rows}
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    rng = random.Random(0)
    data = {**run_info("bench.kernels.activation_chunk", args.threads), "model": "smollm2", "budget": args.budget,
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
        if args.workload_rounds:
            data["workload"] = run_workload(llm, args.rows, workspaces, build_workload(ids, ws, 0),
                                            args.workload_rounds)
    finally:
        model.use_workspace(before)
    write_json("kernels/activation_chunk.json", data)

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
    extra = ""
    if "workload" in data:
        wr, base = data["workload"], str(args.rows[0])
        table = [(k if k != "0" else "0 (one pass)", f"{statistics.median(r['wall_s'][k] for r in wr):.2f}",
                  f"{statistics.median(r['prefill_steps_s'][k] for r in wr):.2f}",
                  f"{statistics.median(r['wall_s'][base] / r['wall_s'][k] for r in wr):.3f}×",
                  f"{statistics.median(r['prefill_steps_s'][base] / r['prefill_steps_s'][k] for r in wr):.3f}×",
                  f"{sum(r['same_requests'][k] for r in wr)}/{len(wr) * ws.num_requests}")
                 for k in map(str, args.rows)]
        title = (f"bench.throughput's workload ({ws.num_requests} requests, all submitted at once), "
                 f"{len(wr)} alternating rounds, medians")
        headers_w = ["activation_chunk_rows", "wall s", "prefill steps s", f"whole ÷ {base} rows",
                     f"prefill steps ÷ {base} rows", "same greedy requests"]
        print_table(title, headers_w, table)
        extra = markdown_table(title, headers_w, table)
    publish_table(
        "activation_chunk", "Prefill steps by the MLP's chunk size (SmolLM2-135M, fp32 panels, CPU)", data,
        f"one engine, {args.prompts} prompts of {PROMPT_LENS[0]}-{PROMPT_LENS[1]} tokens a round (seeded offsets in "
        f"bench.throughput's text, one greedy token each), prefilled {args.budget} tokens a step; the arms swap the "
        f"model's activation workspace and alternate {args.rounds} rounds, the order reversed every other round; a "
        "round's figure is the sum of its steps' times; the speed-up is the median of the rounds' ratios, each "
        "against the first arm's round beside it. The largest MLP activation is min(rows, the longest step) x "
        "(2 x intermediate + hidden) fp32 values. Same first tokens: against the first arm's.",
        "Prefill rounds, medians of alternating rounds", headers, rows, extra, docs=PERF / "kernels.md")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.0f} s")
